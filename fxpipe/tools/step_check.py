"""`python -m fxpipe.tools.step_check`: predicted against measured step time of every bundled
model and of two of the kinds users bring (fxpipe.testing.user_models), in one process
(program.step) and under `fxpipe run` on two ranks.

The prediction is what the report prints: in one process every stage's compute one after
another (fxpipe.runtime.planning.timeline.predicted_local_step), on two ranks the schedule played
with the stage costs (predicted_step); both include what a step pays beyond kernels (the profile's
overheads). Measured are the fastest and the median of a few steps after warm-up (in one
process the models taking turns, a warm-up step and a timed one each), and in one
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

--blocks times what one more block of each of a few reference blocks (a transformer's MLP and
attention, a conv block, a linear layer with 256 KiB of weights) adds to a training step
against what the profile predicts for it: kernels and overheads apart, and how much slower the
kernels ran in the chain of blocks than predicted. The profile times each kernel alone, on
operands the call before left in the caches, and scales matrix products by how much slower
they ran in a chain of the MLP block (fxpipe.profile.in_model); the other blocks show how well
that carries over.
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
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.models import MODELS, load
from fxpipe.profile import DeviceProfile, cached_profile
from fxpipe.profile.in_model import MlpBlock
from fxpipe.profile.timing import interleaved, train_step
from fxpipe.runtime.planning.timeline import predicted_local_step, predicted_step
from fxpipe.testing.user_models import USER_MODELS, load_user_model

__all__ = ["BLOCKS", "check_blocks", "check_model", "check_models", "check_variants",
           "compiled_model", "VARIANTS", "main"]

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


_Compiled = tuple[fxpipe.Program, tuple[Any, ...], dict[str, Any]]
"""A compiled model, its inputs and its keyword inputs by name."""


def compiled_model(name: str, *, stages: int = 2, chunks: int = 4) -> _Compiled:
    """A bundled or user model compiled as step_check measures it, its inputs and keyword
    inputs."""
    model, inputs, named = load_user_model(name) if name in USER_MODELS else \
        load(name, deterministic=True)
    kwargs: dict[str, Any] = dict(named)
    program = fxpipe.compile(model, inputs, stages=stages, chunks=chunks, example_kwargs=kwargs)
    return program, tuple(inputs), kwargs


def check_models(compiled: dict[str, _Compiled], *, steps: int = 8,
                 ranks: bool = True) -> dict[str, dict[str, float]]:
    """Predicted and measured step times (seconds) of compiled models (program, inputs, keyword
    inputs by name), and how fast the machine ran around them ("machine_s"). In one process
    the models' steps take turns, each a step that warms the caches and a timed one, `steps`
    rounds: a slow spell of the machine slows every model alike. Under `fxpipe run` each model
    runs `steps` steps after two."""
    before = machine_time()
    times: dict[str, list[float]] = {name: [] for name in compiled}
    cpu: dict[str, list[float]] = {name: [] for name in compiled}
    for _ in range(steps):
        for name, (program, inputs, kwargs) in compiled.items():
            for timed in (False, True):
                start, used = time.perf_counter(), time.process_time()
                program.zero_grad(set_to_none=True)  # as a training loop's optimizer does
                program.step(*inputs, **kwargs)
                if timed:
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - used)
    after = machine_time()
    out: dict[str, dict[str, float]] = {}
    for name, (program, _, _) in compiled.items():
        plan = program.plan
        row = {"predicted_local_s": predicted_local_step(plan),
               "local_min_s": min(times[name]), "local_median_s": statistics.median(times[name]),
               "local_cpu_s": statistics.median(cpu[name]),
               "predicted_ranks_s": predicted_step(plan, program.built.spec.schedule)[0],
               "machine_s": min(before, after)}
        if ranks:
            with tempfile.TemporaryDirectory() as folder:
                program.write(folder)
                printed = _ranks(folder, steps + 2)[2:]  # the first steps warm up
            row["ranks_min_s"], row["ranks_median_s"] = min(printed), statistics.median(printed)
            row["machine_s"] = min(row["machine_s"], machine_time())
        out[name] = row
    return out


def check_model(name: str, *, stages: int = 2, chunks: int = 4, steps: int = 8,
                ranks: bool = True) -> dict[str, float]:
    """check_models of one model."""
    compiled = {name: compiled_model(name, stages=stages, chunks=chunks)}
    return check_models(compiled, steps=steps, ranks=ranks)[name]


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


class _AttentionBlock(nn.Module):
    """Causal self-attention on tokens: norm, one linear for q, k and v, heads, attention,
    output linear, residual."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2)
                   for y in self.qkv(self.norm(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = x + self.out(y.transpose(1, 2).reshape(b, t, c))
        return out


class _ConvBlock(nn.Module):
    """A residual conv block: 3x3 convolution, batch norm, ReLU."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + F.relu(self.norm(self.conv(x)))
        return out


class _WideLinear(nn.Module):
    """A linear layer whose weights (256 KiB) outgrow the fastest caches, and a ReLU."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = F.relu(self.linear(x))
        return out


BLOCKS: dict[str, tuple[type[nn.Module], tuple[int, ...]]] = {
    "mlp block (2 x 32 tokens of 64)": (MlpBlock, (2, 32, 64)),
    "attention block (2 x 32 tokens of 64)": (_AttentionBlock, (2, 32, 64)),
    "conv block (2 x 16 x 16 x 16)": (_ConvBlock, (2, 16, 16, 16)),
    "linear 256 -> 256 (8 rows)": (_WideLinear, (8, 256)),
}
"""check_blocks' reference blocks and the input of each."""


def check_blocks(*, profile: DeviceProfile | None = None, rounds: int = 40, burst: int = 4,
                 budget: float = 20.0) -> dict[str, tuple[float, float, float]]:
    """Per reference block (BLOCKS): the seconds one more block adds to a training step
    (zero_grad, forward, backward; chains of 1 and 4 blocks taking turns in bursts of steps,
    the fastest of each chain's steps that follow a step of its own, as in a training loop),
    and what the profile predicts for it: its kernels and its overheads."""
    profile = profile or cached_profile("cpu", torch.float32)
    chains: dict[tuple[str, int], tuple[nn.Module, torch.Tensor]] = {}
    predicted: dict[tuple[str, int], tuple[float, float]] = {}  # (kernels, overheads)
    for name, (block, shape) in BLOCKS.items():
        for count in (1, 4):
            torch.manual_seed(0)
            model = nn.Sequential(*(block() for _ in range(count))).train()
            x = torch.randn(shape)
            stages = fxpipe.compile(model, (x,), stages=1, chunks=1, remat="never",
                                    profile=profile).plan.stages
            overheads = sum(s.overhead_time for s in stages)
            chains[name, count] = (model, x.requires_grad_())
            predicted[name, count] = (sum(s.compute_time for s in stages) - overheads, overheads)

    fastest = interleaved({key: partial(train_step, *chain) for key, chain in chains.items()},
                          rounds=rounds, budget=budget, least=4, burst=burst)
    return {name: ((fastest[name, 4] - fastest[name, 1]) / 3,
                   (predicted[name, 4][0] - predicted[name, 1][0]) / 3,
                   (predicted[name, 4][1] - predicted[name, 1][1]) / 3)
            for name in BLOCKS}


def _print_blocks() -> None:
    rows = check_blocks()
    print("what one more block adds to a training step in one process (us): measured, and "
          "predicted as kernels + overheads; kernels meas/pred: how much slower the kernels ran "
          "in the chain than predicted ((measured - overheads) / kernels)")
    print(f"{'block':40} {'measured':>9} {'kernels':>8} {'overheads':>9} {'predicted':>9}"
          f" {'pred/meas':>9} {'kernels meas/pred':>17}")
    for name, (measured, kernels, overheads) in rows.items():
        print(f"{name:40} {measured * 1e6:9.1f} {kernels * 1e6:8.1f} {overheads * 1e6:9.1f}"
              f" {(kernels + overheads) * 1e6:9.1f} {(kernels + overheads) / measured:9.2f}"
              f" {(measured - overheads) / kernels:17.2f}")


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
    parser.add_argument("--steps", type=int, default=32,
                        help="timed steps of each model in one process and on two ranks")
    parser.add_argument("--no-ranks", action="store_true", help="only in one process")
    parser.add_argument("--variants", action="store_true",
                        help="compare each model's compiled forms in one process instead")
    parser.add_argument("--blocks", action="store_true",
                        help="time reference blocks against their predicted kernels and "
                             "overheads instead")
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
    if args.blocks:
        _print_blocks()
        return 0
    profiled = machine_time()
    print("one process: zero_grad and program.step; 2 ranks: the steps fxpipe run prints; "
          "wall times (min, median) in ms; pred/min: the predicted over the fastest step; at "
          "speed: the same with the prediction scaled by how much slower the machine ran "
          "around the model's runs than right after the profile (speed)")
    print(f"{'model':10} {'speed':>6} | {'1 process: pred':>15} {'min':>7} {'median':>7}"
          f" {'pred/min':>8} {'at speed':>8} | {'2 ranks: pred':>13} {'min':>7} {'median':>7}"
          f" {'pred/min':>8} {'at speed':>8}")
    compiled = {}
    for name in args.models:
        try:
            compiled[name] = compiled_model(name)
        except Exception as e:  # noqa: BLE001 - one model's failure is a row, not the end
            print(f"{name:10} failed: {type(e).__name__}: {str(e).splitlines()[0]}")
    for name, r in check_models(compiled, steps=args.steps, ranks=not args.no_ranks).items():
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
