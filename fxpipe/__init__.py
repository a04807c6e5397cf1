"""fxpipe: GPipe pipeline parallelism as a torch.fx compiler pass.

    program = fxpipe.compile(model, example_inputs, stages=2, chunks=4)
    print(program.report())        # the partition: stages, costs, memory, bubble
    program.write("out/")          # one readable Python file per stage, plus a launcher
    loss = program.step(x, target=y)   # one GPipe training step (local or under torchrun)
"""
from fxpipe.capture import capture
from fxpipe.checkpoint import load_checkpoint
from fxpipe.compile import compile  # noqa: A004 - fxpipe.compile, as torch.compile
from fxpipe.errors import FxPipeError
from fxpipe.program import Program

__version__ = "0.1.0"

__all__ = ["compile", "capture", "load_checkpoint", "Program", "FxPipeError", "__version__"]
