"""`fxpipe demo`: the main job end to end on the bundled GPT."""
from __future__ import annotations

import os
import subprocess
import sys

import fxpipe
from fxpipe.models import gpt
from fxpipe.runtime.program.torchrun import free_port

__all__ = ["run_demo"]


# what the stage files' headers say regenerates them
COMMAND = ("fxpipe compile fxpipe.models.gpt:build --set dropout=0.0 --stages 2 --chunks 4 "
           "--remat except_last")


def run_demo(out: str, *, nproc: int = 2, steps: int = 3) -> int:
    """Compiles the bundled GPT into 2 stages, prints the report, writes the program to `out`,
    trains it on `nproc` processes (NCCL when each has a GPU of its own, else gloo on the CPU,
    said in one line) and checks the loss against the plain model."""
    model, inputs = gpt.build(dropout=0.0)  # so the pipeline's losses can equal the model's
    target = gpt.target(inputs)
    print("compiling the bundled GPT into 2 stages x 4 micro-batches ...", flush=True)
    program = fxpipe.compile(model, inputs, stages=2, chunks=4, command=COMMAND)
    print(program.report().text(), flush=True)
    files = program.write(out, target=target)
    print(f"\nwrote {len(files)} files to {out}/: " + ", ".join(os.path.basename(f) for f in files))
    timeline = os.path.join(out, "timeline.json")
    print(f"\ntraining {steps} steps on {nproc} processes (torchrun), verifying against the "
          "plain model ...", flush=True)
    code = subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                            str(nproc), "--master-port", str(free_port()),
                            os.path.join(out, "program.py"), "--steps", str(steps), "--verify",
                            "--timeline", timeline],
                           env={**os.environ, "OMP_NUM_THREADS": "1",
                                "TORCHELASTIC_ERROR_FILE": ""})
    if code == 0:
        print(f"\ntimeline (open in https://ui.perfetto.dev or chrome://tracing): {timeline}")
        print(f"stage code: {out}/stage_0.py, {out}/stage_1.py; run again: fxpipe run {out} "
              f"--nproc {nproc} --steps 5 --verify")
    return code
