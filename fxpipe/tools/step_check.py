"""`python -m fxpipe.tools.step_check`: predicted against measured step time of every bundled
model and of two of the kinds users bring (fxpipe.testing.user_models), in one process
(program.step) and under `fxpipe run` on two ranks.

The prediction is what the report prints: in one process every stage's compute one after
another (fxpipe.runtime.planning.timeline.predicted_local_step), on two ranks the schedule played
with the stage costs (predicted_step); both include what a step pays beyond kernels (the profile's
overheads). Measured are the fastest and the median of a few steps after warm-up, and in one
process the CPU time the step used: the profile holds the fastest of short runs, the machine's
own speed, and on a machine other processes load a step's wall time grows by the share of the
cores they take, its CPU time does not.

A virtual machine's speed drifts by tens of percent within minutes, so the profile is measured
again first (unless --keep-profile), a fixed mix of work is timed right after it and again around
each model's runs, and each ratio is also given at the profile's speed: the prediction scaled
by how much slower that mix ran then, at its fastest ("speed" column).

--variants compares instead one model's compiled forms in one process, their steps taking
turns (drift slows all alike): 1 and 2 stages, remat never, except_last and always; which
part of the cost model is off shows as the variant whose prediction is.
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

import fxpipe
from fxpipe.models import MODELS, load
from fxpipe.profile import cached_profile
from fxpipe.profile.overheads import interleaved
from fxpipe.runtime.planning.timeline import predicted_local_step, predicted_step
from fxpipe.testing.user_models import USER_MODELS, load_user_model

__all__ = ["check_model", "check_variants", "VARIANTS", "main"]

VARIANTS = ((1, "never"), (2, "never"), (2, "except_last"), (2, "always"))
"""(stages, remat) of the compiled forms --variants compares."""

_STEP = re.compile(r"^step \d+ loss \S+ \((\d+\.\d+) s\)$", re.MULTILINE)


def _ranks(folder: str, steps: int) -> list[float]:
    """Step times `fxpipe run FOLDER --nproc 2` prints (seconds)."""
    result = subprocess.run([sys.executable, "-m", "fxpipe", "run", folder, "--nproc", "2",
                             "--steps", str(steps)], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode:
        raise RuntimeError(f"fxpipe run {folder} failed: {result.stderr.strip()[-800:]}")
    return [float(t) for t in _STEP.findall(result.stdout)]


def machine_time() -> float:
    """Seconds of a fixed mix of work (matrix products, element-wise kernels, a small
    backward), the fastest of a few runs: how fast the machine runs now."""
    a, x = torch.randn(64, 64), torch.randn(8192)
    w = torch.randn(32, 32, requires_grad=True)

    def mix() -> None:
        for _ in range(20):
            a @ a
            torch.tanh(x)
            torch.autograd.backward(torch.tanh(w @ w).sum())

    mix()
    best = float("inf")
    for _ in range(15):
        start = time.perf_counter()
        mix()
        best = min(best, time.perf_counter() - start)
    return best


def check_model(name: str, *, stages: int = 2, chunks: int = 4, steps: int = 8,
                ranks: bool = True) -> dict[str, float]:
    """Predicted and measured step times (seconds) of one bundled or user model, and how fast
    the machine ran around them ("machine_s")."""
    before = machine_time()
    model, inputs, named = load_user_model(name) if name in USER_MODELS else \
        load(name, deterministic=True)
    kwargs: dict[str, Any] = dict(named)
    program = fxpipe.compile(model, inputs, stages=stages, chunks=chunks, example_kwargs=kwargs)
    plan = program.plan
    for _ in range(2):
        program.step(*inputs, **kwargs)
    times, cpu = [], []
    for _ in range(steps):
        start, used = time.perf_counter(), time.process_time()
        program.zero_grad(set_to_none=True)  # as a training loop's optimizer does
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
    out["machine_s"] = min(before, machine_time())
    return out


def check_variants(name: str, *, chunks: int = 4, rounds: int = 30,
                   budget: float = 20.0) -> dict[tuple[int, str], tuple[float, float]]:
    """(predicted, fastest measured) seconds of one step (zero_grad and program.step) of each
    of VARIANTS of one model, their steps taking turns for `rounds` rounds or `budget` s."""
    model, inputs, named = load_user_model(name) if name in USER_MODELS else \
        load(name, deterministic=True)
    kwargs: dict[str, Any] = dict(named)
    programs = {(stages, remat): fxpipe.compile(copy.deepcopy(model), inputs, stages=stages,
                                                chunks=chunks, remat=remat,
                                                example_kwargs=kwargs)
                for stages, remat in VARIANTS}

    def step(program: fxpipe.Program) -> None:
        program.zero_grad(set_to_none=True)
        program.step(*inputs, **kwargs)

    fastest = interleaved({key: partial(step, program) for key, program in programs.items()},
                          rounds=rounds, budget=budget, least=4)
    return {key: (predicted_local_step(program.plan), fastest[key])
            for key, program in programs.items()}


def _print_variants(names: Sequence[str]) -> None:
    print("one process, zero_grad and program.step, the variants' steps taking turns; "
          "predicted / fastest measured in ms, and their ratio")
    print(f"{'model':10}" + "".join(f" | {f'{s} stage(s), {r}':>27}" for s, r in VARIANTS))
    for name in names:
        rows = check_variants(name)
        print(f"{name:10}" + "".join(
            f" | {p * 1e3:8.2f} /{m * 1e3:8.2f} ({p / m:5.2f})" for p, m in rows.values()),
            flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxpipe.tools.step_check",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("models", nargs="*", default=[*MODELS, *USER_MODELS])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-ranks", action="store_true", help="only in one process")
    parser.add_argument("--variants", action="store_true",
                        help="compare each model's compiled forms in one process instead")
    parser.add_argument("--keep-profile", action="store_true",
                        help="predict with the cached profile as it is (default: measure it "
                             "again first)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if not args.keep_profile:
        cached_profile("cpu", torch.float32, refresh=True)
    if args.variants:
        _print_variants(args.models)
        return 0
    profiled = machine_time()
    print("one process: zero_grad and program.step; 2 ranks: the steps fxpipe run prints; "
          "wall times (min, median) in ms; pred/min: the predicted over the fastest step; at "
          "speed: the same with the prediction scaled by how much slower the machine ran "
          "around the model's runs than right after the profile (speed)")
    print(f"{'model':10} {'speed':>6} | {'1 process: pred':>15} {'min':>7} {'median':>7}"
          f" {'pred/min':>8} {'at speed':>8} | {'2 ranks: pred':>13} {'min':>7} {'median':>7}"
          f" {'pred/min':>8} {'at speed':>8}")
    for name in args.models:
        try:
            r = check_model(name, steps=args.steps, ranks=not args.no_ranks)
        except Exception as e:  # noqa: BLE001 - one model's failure is a row, not the end
            print(f"{name:10} failed: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        slower = r["machine_s"] / profiled
        row = f"{name:10} {slower:6.2f}"
        for where in ("local", "ranks"):
            if f"{where}_min_s" not in r:
                continue
            predicted, fastest = r[f"predicted_{where}_s"], r[f"{where}_min_s"]
            row += (f" | {predicted * 1e3:15.2f} {fastest * 1e3:7.2f}"
                    f" {r[f'{where}_median_s'] * 1e3:7.2f} {predicted / fastest:8.2f}"
                    f" {predicted * slower / fastest:8.2f}")
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
