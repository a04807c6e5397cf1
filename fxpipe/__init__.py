"""fxpipe: GPipe pipeline parallelism as a torch.fx compiler pass.

    program = fxpipe.compile(model, example_inputs, stages=2, chunks=4)
    print(program.report())        # the partition: stages, costs, memory, bubble
    program.write("out/")          # one readable Python file per stage, plus a launcher
    loss = program.step(x, target=y)   # one GPipe training step (local or under torchrun)
"""
from fxpipe.capture import capture
from fxpipe.errors import FxPipeError

__version__ = "0.1.0"

__all__ = ["capture", "FxPipeError", "__version__"]
