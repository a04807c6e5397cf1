"""fxpipe: GPipe pipeline parallelism as a torch.fx compiler pass.

    program = fxpipe.compile(model, example_inputs, stages=2, chunks=4)
    print(program.report())        # the partition: stages, costs, memory, bubble
    program.write("out/")          # one readable Python file per stage, plus a launcher
    loss = program.step(x, target=y)   # one GPipe training step (local or under torchrun)
"""
import importlib
from typing import TYPE_CHECKING, Any

from fxpipe.errors import FxPipeError
from fxpipe.version import __version__

if TYPE_CHECKING:
    from fxpipe.api import compile  # noqa: A004 - fxpipe.compile, as torch.compile
    from fxpipe.frontend.capture import capture
    from fxpipe.planner import plan
    from fxpipe.program import Program
    from fxpipe.storage.checkpoint import load_checkpoint

__all__ = ["compile", "capture", "plan", "load_checkpoint", "Program", "FxPipeError",
           "__version__"]

# Imported on first use, so that importing a torch-free module of the package (the command
# line's parser answering --help) does not import torch; a submodule (fxpipe.pipeline) is
# imported when it is first named, as importing the API used to import it.
_LAZY = {"compile": "fxpipe.api", "load_checkpoint": "fxpipe.storage.checkpoint",
         "capture": "fxpipe.frontend.capture", "Program": "fxpipe.program",
         "plan": "fxpipe.planner"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
