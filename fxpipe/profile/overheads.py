"""What a real training step pays beyond its kernels, measured on this machine.

Kernel rates alone predicted steps 10-50x faster than runs on a CPU: each operation of a stage
also costs a Python call and an autograd node in its forward and backward, each remat region a
checkpoint call (saved-tensor hooks, RNG state, the recomputation's bookkeeping), and each
micro-batch and step the executor's own work (hand-offs between stage threads, splitting and
joining the batch, the loss). Each is timed here as the fastest of repeated runs of tiny work,
where nothing but the overhead takes time:

    op_overheads         per op class, a chain of tiny units of that class (linears; norms
                         and softmax; activations and adds; convolutions; ...), and per view
                         (glue that makes a tensor without a kernel), forward and backward,
                         less what the kernel rates predict for it, per operation it adds from
                         one to four units; op_overhead is their median
    op_forward_overheads the same of the forward alone (a recomputed operation pays it again)
    region_overheads     the same chains under the stages' checkpoint, less the same without
                         it and its recomputation (the forward once more), per operation;
                         region_overhead is their median
    matmul_in_model      how much slower matrix products run in a model's step than alone,
    checkpoint_overhead  and what a checkpoint call costs beyond its operations' bookkeeping,
                         both on chains of a transformer's MLP blocks (fxpipe.profile.in_model)
    microbatch_overhead  a compiled two-stage program of two tiny layers at 1 and 8 micro-batches:
    step_overhead        the slope per stage and micro-batch and the intercept, less what the
                         above already predict for its operations
"""
from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

from fxpipe import ir
from fxpipe.profile.device import DeviceProfile
from fxpipe.profile.in_model import measure_in_model
from fxpipe.profile.kinds import overhead_kind
from fxpipe.profile.timing import fastest, interleaved, remat_step, train_step

__all__ = ["measure_overheads"]


class _Chain(nn.Module):
    """`units` copies of one unit of work, each giving what it takes."""

    def __init__(self, unit: Callable[[], nn.Module], units: int) -> None:
        super().__init__()
        self.units = nn.ModuleList(unit() for _ in range(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = unit(x)
        return x


class _Pointwise(nn.Module):
    """The common element-wise operations: activations, a residual add, a scaling."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(x)
        x = nn.functional.gelu(x)
        return (x + x) * 0.5


class _Norms(nn.Module):
    """The common reductions: layer and batch norm, softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.batch = nn.LayerNorm(16), nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.batch(self.layer(x)), dim=-1)


class _Attention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(x, x, x)


class _Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(32, 16)
        self.rows: torch.Tensor
        self.register_buffer("rows", torch.arange(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        looked_up: torch.Tensor = self.table(self.rows)
        return x + looked_up.unsqueeze(0)


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lstm(x)[0]
        return out


class _Views(nn.Module):
    """Glue that makes tensors without kernels: views and transposes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], 4, 4).transpose(1, 2).transpose(1, 2).flatten(1)


# each kind's unit of work and its input, element-wise first: the other units' figures
# subtract what their element-wise operations (an embedding's add, a norm's counter) pay
_UNITS: tuple[tuple[str, Callable[[], nn.Module], tuple[int, ...]], ...] = (
    ("elementwise", _Pointwise, (4, 16)),
    ("view", _Views, (4, 16)),
    ("matmul", lambda: nn.Linear(16, 16), (4, 16)),
    ("reduction", _Norms, (4, 16)),
    ("convolution", lambda: nn.Conv2d(4, 4, 3, padding=1), (2, 4, 8, 8)),
    ("attention", _Attention, (2, 2, 4, 8)),
    ("embedding", _Lookup, (2, 4, 16)),
    ("recurrent", _Recurrent, (2, 4, 8)),
)


@dataclass(frozen=True)
class _Chained:
    """A chain of units, compiled to count its operations and predict its kernels."""

    model: nn.Module
    x: torch.Tensor
    kinds: Counter[str]  # its operations by overhead kind
    kernels: tuple[float, float]  # predicted seconds of its kernels: in all, in the forward

    @staticmethod
    def of(unit: Callable[[], nn.Module], count: int, shape: tuple[int, ...],
           kernels: DeviceProfile) -> _Chained:
        import fxpipe

        torch.manual_seed(0)
        model, x = _Chain(unit, count).train(), torch.randn(shape)
        program = fxpipe.compile(model, (x,), stages=1, chunks=1, remat="never",
                                 profile=kernels)
        nodes = [n for n in ir.compute_nodes(program.graph_module.graph) if ir.COST in n.meta]
        kinds = Counter(k for k in map(overhead_kind, nodes) if k is not None)
        stages = program.plan.stages
        return _Chained(model, x.requires_grad_(), kinds,
                        (sum(s.compute_time for s in stages), sum(s.forward_time for s in stages)))

    def step(self) -> None:
        train_step(self.model, self.x)

    def forward(self) -> None:
        self.model(self.x)

    def remat(self) -> None:
        """A step with the chain under the checkpoint stage code runs its remat regions with
        (fxpipe.remat_policy.CHECKPOINT_OPTIONS)."""
        remat_step(self.model, self.x)


def _op_overheads(kernels: DeviceProfile, units: tuple[int, int] = (1, 4),
                  budget: float = 1.5) -> dict[str, tuple[float, float, float]]:
    """Per operation of each kind (op class, or view): what a step of a chain of tiny units of
    that kind takes beyond what `kernels` (a profile of kernel rates alone) predicts for it,
    in all and in the forward, and what the chain under a checkpoint takes beyond that and its
    forward once more (the region's bookkeeping); each per operation the longer chain adds (a
    slope, so that what a step pays once is left to the step's own overheads), less what the
    other kinds' operations among them pay. This is what an operation pays beyond its kernels
    in a real step: the Python call, the autograd node, allocations, a kernel's fixed costs that
    its rate leaves out, and in a remat region the saved-tensor hooks."""
    found: dict[str, tuple[float, float, float]] = {}
    for kind, unit, shape in _UNITS:
        try:
            chains = [_Chained.of(unit, count, shape, kernels) for count in units]
            fastest = interleaved({(i, part): getattr(chain, part)
                                   for i, chain in enumerate(chains)
                                   for part in ("step", "forward", "remat")}, budget=budget)
        except RuntimeError:  # no kernel at this precision here (an LSTM in fp16 on a CPU):
            continue  # the kind pays the median of the others (DeviceProfile.op_overhead)
        # per chain: beyond its kernels in all and in the forward; the checkpoint's bookkeeping
        paid = [(fastest[i, "step"] - chain.kernels[0], fastest[i, "forward"] - chain.kernels[1],
                 fastest[i, "remat"] - fastest[i, "step"] - fastest[i, "forward"])
                for i, chain in enumerate(chains)]
        added = chains[1].kinds - chains[0].kinds
        slopes = [(paid[1][f] - paid[0][f]
                   - sum(n * found[k][f] for k, n in added.items() if k != kind and k in found))
                  / max(added[kind], 1) for f in range(3)]
        total, forward, region = (max(x, 0.0) for x in slopes)
        found[kind] = (total, min(forward, total), region)
    return found


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.a(x))
        return out


def _executor_overheads(kernels: DeviceProfile) -> tuple[float, float]:
    """(per stage and micro-batch, per step) of a compiled program run in this process, less
    what its operations cost (`kernels`: the rates and the operations' overheads)."""
    import fxpipe

    torch.manual_seed(0)
    model, x = _Tiny(), torch.randn(8, 8)
    times, predicted = {}, {}
    for chunks in (1, 8):
        program = fxpipe.compile(model, (x,), stages=2, chunks=chunks, remat="never",
                                 profile=kernels)
        predicted[chunks] = sum(s.compute_time for s in program.plan.stages)
        times[chunks] = fastest(partial(_train_step, program, x), repeat=20)
    per_microbatch = max((times[8] - times[1] - 8 * predicted[8] + predicted[1]) / 7 / 2, 0.0)
    step = max(times[1] - predicted[1] - 2 * per_microbatch, 0.0)
    return per_microbatch, step


def _train_step(program: nn.Module, x: torch.Tensor) -> None:
    program.zero_grad(set_to_none=True)
    program.step(x)  # type: ignore[operator]


def measure_overheads(kernels: DeviceProfile) -> DeviceProfile:
    """`kernels` (a profile of kernel rates alone, its overheads 0) with every overhead of a
    real step on the CPU (one thread, as a pipeline rank runs)."""
    found = _op_overheads(kernels)

    def figures(index: int) -> tuple[tuple[str, float], ...]:
        return tuple((kind, values[index]) for kind, values in found.items())

    totals, regions = figures(0), figures(2)
    profile = replace(kernels, op_overhead=statistics.median(t for _, t in totals),
                      op_overheads=totals, op_forward_overheads=figures(1),
                      region_overhead=statistics.median(t for _, t in regions),
                      region_overheads=regions)
    matmul, checkpoint = measure_in_model(profile)
    profile = replace(profile, matmul_in_model=matmul, checkpoint_overhead=checkpoint)
    microbatch, step = _executor_overheads(profile)
    return replace(profile, microbatch_overhead=microbatch, step_overhead=step)
