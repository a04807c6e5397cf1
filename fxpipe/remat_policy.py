"""Remat policies: which micro-batches recompute their activations in the backward, what share
of the recomputation a step pays, and what a stage keeps for its backwards.

The passes (which regions to mark, what a partition costs and keeps) and the runtime (whether a
micro-batch's forward keeps its activations) ask the same policy, resolved once from the option
`remat=` ("never", "always", "except_last", "auto"). The regions themselves are chosen by
passes.remat; the per-micro-batch switch reaches the stage code through its communication
object (`comm.remat`).
"""
from __future__ import annotations

from enum import Enum
from typing import Any

from fxpipe.choices import REMAT_MODES  # the names, torch-free for the command line
from fxpipe.errors import ConfigError
from fxpipe.figures import kept_at_peak

__all__ = ["CHECKPOINT_OPTIONS", "RematPolicy", "REMAT_MODES", "remat_policy"]

CHECKPOINT_OPTIONS: dict[str, Any] = {
    "use_reentrant": False,
    # dropout inside a region draws the same mask when it is recomputed
    "preserve_rng_state": True,
    # torch's check compares the shape, dtype and device of every tensor the recomputation
    # saves with the forward's (about 8% of a small region's recompute on a CPU); a region is
    # traced code whose inputs fix its shapes, and autograd refuses a gradient of another shape
    # all the same
    "determinism_check": "none",
}
"""How a remat region is checkpointed: torch.utils.checkpoint's options as stage code runs it
(fxpipe.runtime.stage.checkpoint) and as the profile times a region's bookkeeping."""


class RematPolicy(Enum):
    """What recomputes in the backward: no micro-batch, every one, all but the last, or the
    regions passes.remat chose to fit a memory limit (every micro-batch)."""

    NEVER = "never"
    ALWAYS = "always"
    EXCEPT_LAST = "except_last"
    AUTO = "auto"

    def __str__(self) -> str:
        return str(self.value)

    @property
    def recomputes_any(self) -> bool:
        """Whether any micro-batch recomputes, so that remat regions are marked at all."""
        return self is not RematPolicy.NEVER

    @property
    def chooses_regions(self) -> bool:
        """Whether the regions are chosen to fit a memory limit (one per top-level block,
        the fewest that fit), rather than every run of operations that can recompute."""
        return self is RematPolicy.AUTO

    def recomputes(self, microbatch: int, chunks: int) -> bool:
        """Whether micro-batch `microbatch` of `chunks` recomputes its activations in backward.
        The last micro-batch under "except_last" keeps them: its backward comes first."""
        if self is RematPolicy.EXCEPT_LAST:
            return microbatch < chunks - 1
        return self.recomputes_any

    def recomputed_share(self, chunks: int) -> float:
        """The share of a step's micro-batches that recompute."""
        return sum(self.recomputes(m, chunks) for m in range(chunks)) / chunks

    def kept_whole(self, inflight: int, chunks: int) -> int:
        """How many of `inflight` micro-batches in flight keep every activation (the others
        keep only their remat regions' inputs). "except_last" keeps the last whole, and its
        forward finishes with the others a stage has in flight."""
        if not self.recomputes_any or chunks <= 1:
            return inflight
        return 1 if self is RematPolicy.EXCEPT_LAST else 0

    def kept_at_peak(self, saved: float, kept: float, inflight: int, chunks: int) -> float:
        """Bytes a stage keeps for its backwards with `inflight` micro-batches in flight, each
        keeping `saved` bytes whole or `kept` with its remat regions (fxpipe.figures)."""
        return kept_at_peak(saved, kept, inflight, self.kept_whole(inflight, chunks))


"""The names `remat=` accepts."""


def remat_policy(mode: str | RematPolicy) -> RematPolicy:
    """The policy called `mode` (a policy is returned as it is); ConfigError for another name."""
    if isinstance(mode, RematPolicy):
        return mode
    if mode not in REMAT_MODES:
        raise ConfigError(f"unknown remat mode {mode!r}", hint=f"use one of {REMAT_MODES}")
    return RematPolicy(mode)

