"""What a real training step pays beyond its kernels, measured on this machine.

Kernel rates alone predicted steps 10-50x faster than runs on a CPU: each operation of a stage
also costs a Python call and an autograd node in its forward and backward, each remat region a
checkpoint call (saved-tensor hooks, RNG state, the recomputation's bookkeeping), and each
micro-batch and step the executor's own work (hand-offs between stage threads, splitting and
joining the batch, the loss). Each is timed here as the fastest of repeated runs of tiny work,
where nothing but the overhead takes time:

    op_overhead          a small model's forward and backward (convolution, norms, linears),
                         less what the kernel rates predict for it, per operation it adds
                         from one to three blocks
    region_overhead      a chain of tiny operations under the stages' checkpoint, less the same
                         without it and its recomputation, per operation
    microbatch_overhead  a compiled two-stage program of two tiny layers at 1 and 8 micro-batches:
    step_overhead        the slope per stage and micro-batch and the intercept, less what the
                         above already predict for its operations
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
import torch.utils.checkpoint
from torch import nn

from fxpipe import ir
from fxpipe.profile.device import DeviceProfile

__all__ = ["Overheads", "measure_overheads"]


@dataclass(frozen=True)
class Overheads:
    """Seconds a real step pays beyond kernels (fxpipe.profile.device.DeviceProfile)."""

    op: float = 0.0  # per operation (graph node) per micro-batch, forward and backward
    region: float = 0.0  # per operation of a remat region per micro-batch it recomputes
    microbatch: float = 0.0  # per stage per micro-batch
    step: float = 0.0  # per training step


def _fastest(fn: Callable[[], object], repeat: int = 25, budget: float = 1.0) -> float:
    fn()
    best = float("inf")
    start = time.perf_counter()
    for i in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if i >= 5 and time.perf_counter() - start > budget:
            break
    return best


class _Mixed(nn.Module):
    """A small model of the common operations, `blocks` times: convolution, norm and
    activation on an image, then residual linear, norm and activation blocks."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1),
                                                 nn.BatchNorm2d(4), nn.ReLU())
                                   for _ in range(blocks))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(256, 64), nn.LayerNorm(64),
                                                nn.GELU(), nn.Linear(64, 256))
                                  for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = conv(x)
        y = x.flatten(1)
        for mlp in self.mlps:
            y = y + mlp(y)
        return y


def _op_overhead(kernels: DeviceProfile) -> float:
    """Per operation: what a forward and backward of the small model takes beyond what
    `kernels` (a profile of kernel rates alone) predicts for it, per operation it adds: the
    slope from 1 to 3 blocks, so that what a step pays once (starting the backward, the loss)
    is left to the step's own overheads. This is what each operation pays beyond its kernels
    in a real backward: the Python call, the autograd node, allocations, gradient
    accumulation."""
    import fxpipe

    runs, paid = {}, {}
    for blocks in (1, 3):
        torch.manual_seed(0)
        model, x = _Mixed(blocks).eval(), torch.randn(2, 4, 8, 8)
        program = fxpipe.compile(model, (x,), stages=1, chunks=1, remat="never",
                                 profile=kernels)
        predicted = sum(s.compute_time for s in program.plan.stages)
        ops = sum(1 for n in ir.compute_nodes(program.graph_module.graph)
                  if ir.COST in n.meta and ir.cost(n).fwd_kernels)

        def run(model: nn.Module = model, x: torch.Tensor = x) -> None:
            torch.autograd.backward(model(x).sum())

        runs[blocks], paid[blocks] = run, (predicted, ops)
    fastest = _interleaved(runs)
    (kernels_one, ops_one), (kernels_three, ops_three) = paid[1], paid[3]
    grown = (fastest[3] - kernels_three) - (fastest[1] - kernels_one)
    return max(grown / max(ops_three - ops_one, 1), 0.0)


def _interleaved(runs: Mapping[int, Callable[[], object]], rounds: int = 60,
                 budget: float = 2.0) -> dict[int, float]:
    """The fastest run of each, their runs taking turns (a burst of load slows all alike)."""
    fastest = {key: float("inf") for key in runs}
    for run in runs.values():
        run()
    start = time.perf_counter()
    for i in range(rounds):
        for key, run in runs.items():
            t0 = time.perf_counter()
            run()
            fastest[key] = min(fastest[key], time.perf_counter() - t0)
        if i >= 10 and time.perf_counter() - start > budget:
            break
    return fastest


def _region_overhead(ops: int = 20) -> float:
    """Per operation of a remat region: a chain of `ops` tiny operations under the stages'
    checkpoint (torch's non-reentrant one, keeping the RNG state, as stage code runs it),
    forward and backward, less the same without it and its recomputation."""
    x = torch.randn(8, 8, requires_grad=True)

    def region(v: torch.Tensor) -> torch.Tensor:
        for _ in range(ops):
            v = torch.tanh(v)
        return v

    def run(enabled: bool) -> None:
        out: torch.Tensor = torch.utils.checkpoint.checkpoint(
            region, x, use_reentrant=False, preserve_rng_state=True) if enabled else region(x)
        torch.autograd.backward(out.sum())

    with_remat, without = _fastest(lambda: run(True)), _fastest(lambda: run(False))
    forward = _fastest(lambda: region(x))
    return max((with_remat - without - forward) / ops, 0.0)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.a(x))
        return out


def _executor_overheads(kernels: DeviceProfile, op: float) -> tuple[float, float]:
    """(per stage and micro-batch, per step) of a compiled program run in this process, less
    what its operations cost (`kernels` rates and `op` overhead each)."""
    import fxpipe

    torch.manual_seed(0)
    model, x = _Tiny(), torch.randn(8, 8)
    times, predicted = {}, {}
    for chunks in (1, 8):
        program = fxpipe.compile(model, (x,), stages=2, chunks=chunks, remat="never",
                                 profile=replace(kernels, op_overhead=op))
        predicted[chunks] = sum(s.compute_time for s in program.plan.stages)
        times[chunks] = _fastest(lambda p=program: p.step(x), repeat=20)  # type: ignore[misc]
    per_microbatch = max((times[8] - times[1] - 8 * predicted[8] + predicted[1]) / 7 / 2, 0.0)
    step = max(times[1] - predicted[1] - 2 * per_microbatch, 0.0)
    return per_microbatch, step


def measure_overheads(kernels: DeviceProfile) -> Overheads:
    """Every overhead of a real step on the CPU (one thread, as a pipeline rank runs), given
    the profile of kernel rates measured (its overheads 0)."""
    op = _op_overhead(kernels)
    region = _region_overhead()
    microbatch, step = _executor_overheads(kernels, op)
    return Overheads(op, region, microbatch, step)
