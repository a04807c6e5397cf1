"""`python -m fxpipe.tools.step_check`: predicted against measured step time of every bundled
model, in one process (program.step) and under `fxpipe run` on two ranks.

The prediction is what the report prints: in one process every stage's compute one after
another (fxpipe.runtime.planning.timeline.predicted_local_step), on two ranks the schedule played
with the stage costs (predicted_step); both include what a step pays beyond kernels (the profile's
overheads). Measured are the fastest and the median of a few steps after warm-up, and in one
process the CPU time the step used: the profile holds the fastest of short runs, the machine's
own speed, and on a machine other processes load a step's wall time grows by the share of the
cores they take, its CPU time does not.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

import fxpipe
from fxpipe.models import MODELS, load
from fxpipe.runtime.planning.timeline import predicted_local_step, predicted_step

__all__ = ["check_model", "main"]

_STEP = re.compile(r"^step \d+ loss \S+ \((\d+\.\d+) s\)$", re.MULTILINE)


def _ranks(folder: str, steps: int) -> list[float]:
    """Step times `fxpipe run FOLDER --nproc 2` prints (seconds)."""
    result = subprocess.run([sys.executable, "-m", "fxpipe", "run", folder, "--nproc", "2",
                             "--steps", str(steps)], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode:
        raise RuntimeError(f"fxpipe run {folder} failed: {result.stderr.strip()[-800:]}")
    return [float(t) for t in _STEP.findall(result.stdout)]


def check_model(name: str, *, stages: int = 2, chunks: int = 4, steps: int = 8,
                ranks: bool = True) -> dict[str, float]:
    """Predicted and measured step times (seconds) of one bundled model."""
    model, inputs, named = load(name, deterministic=True)
    kwargs: dict[str, Any] = dict(named)
    program = fxpipe.compile(model, inputs, stages=stages, chunks=chunks, example_kwargs=kwargs)
    plan = program.plan
    for _ in range(2):
        program.step(*inputs, **kwargs)
    times, cpu = [], []
    for _ in range(steps):
        start, used = time.perf_counter(), time.process_time()
        program.step(*inputs, **kwargs)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - used)
    out = {"predicted_local_s": predicted_local_step(plan), "local_min_s": min(times),
           "local_median_s": statistics.median(times), "local_cpu_s": statistics.median(cpu),
           "predicted_ranks_s": predicted_step(plan, program.built.spec.schedule)[0]}
    if ranks:
        with tempfile.TemporaryDirectory() as folder:
            program.write(folder)
            printed = _ranks(folder, steps + 2)[2:]  # the first steps warm up
        out["ranks_min_s"], out["ranks_median_s"] = min(printed), statistics.median(printed)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxpipe.tools.step_check",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-ranks", action="store_true", help="only in one process")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("one process: program.step, wall time (min, median) and the process's CPU time "
          "(median; what a loaded machine does not inflate); 2 ranks: the steps fxpipe run "
          "prints (wall)")
    print(f"{'model':10} {'one process: predicted':>24} {'min':>9} {'median':>9} {'CPU':>9}"
          f" {'pred/CPU':>9} {'2 ranks: predicted':>20} {'min':>9} {'median':>9}"
          f" {'pred/min':>9}")
    for name in args.models:
        try:
            r = check_model(name, steps=args.steps, ranks=not args.no_ranks)
        except Exception as e:  # noqa: BLE001 - one model's failure is a row, not the end
            print(f"{name:10} failed: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        row = (f"{name:10} {r['predicted_local_s'] * 1e3:21.2f} ms {r['local_min_s'] * 1e3:9.2f}"
               f" {r['local_median_s'] * 1e3:9.2f} {r['local_cpu_s'] * 1e3:9.2f}"
               f" {r['predicted_local_s'] / r['local_cpu_s']:9.2f}"
               f" {r['predicted_ranks_s'] * 1e3:17.2f} ms")
        if "ranks_min_s" in r:
            row += (f" {r['ranks_min_s'] * 1e3:9.2f} {r['ranks_median_s'] * 1e3:9.2f}"
                    f" {r['predicted_ranks_s'] / r['ranks_min_s']:9.2f}")
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
