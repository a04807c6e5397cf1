"""fxpipe: GPipe pipeline parallelism as a torch.fx compiler pass.

    program = fxpipe.compile(model, example_inputs, stages=2, chunks=4)
    print(program.report())        # the partition: stages, costs, memory, bubble
    program.write("out/")          # one readable Python file per stage, plus a launcher
    loss = program.step(x, target=y)   # one GPipe training step (local or under torchrun)
"""
from fxpipe.api import compile  # noqa: A004 - fxpipe.compile, as torch.compile
from fxpipe.checkpoint import load_checkpoint
from fxpipe.errors import FxPipeError
from fxpipe.frontend.capture import capture
from fxpipe.program import Program
from fxpipe.version import __version__

__all__ = ["compile", "capture", "load_checkpoint", "Program", "FxPipeError", "__version__"]
