"""The exception hierarchy: one root, one subclass per phase, messages that carry a hint."""
from __future__ import annotations

__all__ = [
    "FxPipeError",
    "CaptureError",
    "CostError",
    "PartitionError",
    "SplitError",
    "CodegenError",
    "ConfigError",
    "RuntimeInputError",
    "PipelineRuntimeError",
    "PeerLostError",
    "LossError",
    "NotBuiltError",
    "MissingMetaError",
    "InvariantError",
    "CheckpointError",
    "ProgramFolderError",
    "StorageError",
]


class FxPipeError(Exception):
    """Root of every error fxpipe raises.

    The message states what was wrong with the values involved; `hint` says how to fix it.
    """

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\nhint: {hint}")


class ConfigError(FxPipeError, ValueError):
    """An argument of compile() or of a command is out of range or unknown."""


class CaptureError(FxPipeError):
    """The model could not be turned into a correct fx graph."""


class CostError(FxPipeError):
    """The cost of a node could not be determined."""


class PartitionError(FxPipeError, ValueError):
    """No partition satisfies the stage count or the memory limit."""


class SplitError(FxPipeError):
    """The partitioned graph could not be cut into stage modules."""


class CodegenError(FxPipeError):
    """A stage could not be rendered as standalone Python source."""


class RuntimeInputError(FxPipeError, ValueError):
    """Inputs at run time do not match what the program was compiled for."""


class PipelineRuntimeError(FxPipeError, RuntimeError):
    """A stage failed while the pipeline ran (names the stage and micro-batch)."""


class PeerLostError(PipelineRuntimeError):
    """Communication with another stage failed: it raised, died, or timed out."""


class LossError(FxPipeError, ValueError):
    """The loss cannot be computed the way the program runs it (per micro-batch, across
    ranks) with the result of the plain model."""


class NotBuiltError(FxPipeError, RuntimeError):
    """The program was compiled lazily and has not seen inputs yet."""


class CheckpointError(FxPipeError):
    """A checkpoint could not be written or read."""


class ProgramFolderError(FxPipeError, ValueError):
    """A written program's folder is missing files, altered, or not a program at all."""


class StorageError(FxPipeError, OSError):
    """A file could not be written (a full disk, a file size limit, no permission): the message
    names the file; what was there before is kept."""


class MissingMetaError(FxPipeError, KeyError):
    """A pass needs node metadata that an earlier pass writes."""

    def __init__(self, node: object, key: str, *, run_first: str) -> None:
        super().__init__(
            f"node {getattr(node, 'name', node)!s} has no {key!r} metadata",
            hint=f"run {run_first} first",
        )

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        message: str = self.args[0]
        return message


class InvariantError(FxPipeError, AssertionError):
    """ir.verify found broken invariants; the message lists every one."""
