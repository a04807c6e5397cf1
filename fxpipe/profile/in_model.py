"""What a model's training step pays that tiny probes do not show: how much slower its matrix
products run than alone, and what a checkpoint call costs.

The profile times each matrix product on operands the call before left in the caches
(fxpipe.profile.measure). Inside a model's forward and backward other kernels run between two
uses of an operand, outputs are fresh allocations and the backward's products take transposed
operands: on a 2-core CPU a transformer's MLP block ran its products 1.2-1.4x slower than the
same products alone, while its convolutions (timed by calling their kernels directly) ran as
their rates predict. So the factor is measured on a chain of such blocks at a model's small
sizes: what one more block adds to a training step (chains of 1 and 4 blocks, their steps in
bursts as a training loop runs them), less what the profile predicts for the block's other
kernels and its operations' overheads, over what it predicts for its products. It scales the
matmul class's time (DeviceProfile.matmul_in_model).

The same chains under the stages' checkpoint give what a checkpoint call costs beyond its
operations (DeviceProfile.checkpoint_overhead): what a chain of one block pays under it beyond
its step without, less what one more block adds to that. Chains of tiny units had put it at
two thirds of what realistic blocks of every kind (MLP, attention, conv, linear) measure.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

from fxpipe import ir
from fxpipe.profile.device import DeviceProfile
from fxpipe.profile.timing import interleaved, remat_step, train_step

__all__ = ["MlpBlock", "matmul_time", "measure_in_model"]

LIMITS = (1.0, 2.0)
"""The factor's range: load only slows a measurement down (below 1 is noise), and beyond 2 the
chain measured something else than the block."""


class MlpBlock(nn.Module):
    """A transformer's MLP on tokens: norm, 4x wider linear, GELU, linear back, residual."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.norm(x))))
        return out


def matmul_time(gm: GraphModule, profile: DeviceProfile, b: int) -> float:
    """Seconds the matrix products of a costed graph take at micro-batch size b, forward and
    backward, at the profile's rates."""
    return sum(profile.class_time("matmul", float(ir.evaluate(w.flops, b)),
                                  float(ir.evaluate(w.bytes, b)), w.kernels)
               for node in ir.compute_nodes(gm.graph) if ir.COST in node.meta
               for w in ir.cost(node).work if w.op_class == "matmul")


def measure_in_model(profile: DeviceProfile, *, budget: float = 2.0) -> tuple[float, float]:
    """How much slower the products of a chain of MlpBlocks ran in its training steps than
    `profile` (rates and operations' overheads, matmul_in_model 1) predicts them alone (within
    LIMITS), and the seconds a checkpoint call costs beyond its operations (at least 0)."""
    import fxpipe

    assert profile.matmul_in_model == 1.0, "measured against the products' rates alone"
    runs: dict[tuple[int, str], Callable[[], object]] = {}
    predicted: dict[int, tuple[float, float]] = {}  # blocks -> (the whole step, its products)
    for count in (1, 4):
        torch.manual_seed(0)
        model, x = nn.Sequential(*(MlpBlock() for _ in range(count))).train(), \
            torch.randn(2, 32, 64)
        program = fxpipe.compile(model, (x,), stages=1, chunks=1, remat="never", profile=profile)
        predicted[count] = (sum(s.compute_time for s in program.plan.stages),
                            matmul_time(program.graph_module, profile, x.shape[0]))
        x.requires_grad_()
        runs[count, "step"] = partial(train_step, model, x)
        runs[count, "remat"] = partial(remat_step, model, x)
    fastest = interleaved(runs, rounds=30, budget=budget, least=4, burst=4)
    block, products = ((fastest[4, "step"] - fastest[1, "step"]) / 3,
                       (predicted[4][1] - predicted[1][1]) / 3)
    rest = (predicted[4][0] - predicted[1][0]) / 3 - products
    low, high = LIMITS
    matmul = min(max((block - rest) / products, low), high)
    remat = [fastest[n, "remat"] - fastest[n, "step"] for n in (1, 4)]  # recompute, bookkeeping
    call = remat[0] - (remat[1] - remat[0]) / 3
    return matmul, max(call, 0.0)
