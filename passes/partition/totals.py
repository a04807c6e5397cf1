"""What every cut of a graph adds up to, at any micro-batch size, without measuring its atoms.

A planner bounds hundreds of candidates before partitioning any: every rank holds at least its
share of the graph's weights, gradients, optimizer state and saved activations, and computes at
least its share of the work. Those sums do not depend on where the cuts fall, so they need no
per-atom measurement (node_facts) at each micro-batch size: the weights per atom are counted
once, and the times and saved bytes of a deep model's few distinct costs are evaluated once per
size and multiplied by how often each occurs.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from torch.fx import Node

from fxpipe import ir
from fxpipe.optimizers import OptimizerMemory
from fxpipe.passes.cost import estimate_time, time_key
from fxpipe.passes.partition.graph import is_glue
from fxpipe.profile import DeviceProfile

__all__ = ["GraphTotals"]


@dataclass
class GraphTotals:
    """The sums node_facts' atoms add up to (balance="cost", no corrections)."""

    weights: list[tuple[float, float, float]]  # per atom: parameter bytes, gradient bytes, elements
    ops: int  # operations that launch kernels (each pays the profile's op_overhead)
    costs: list[tuple[ir.Cost, int]]  # a cost of each distinct work, and how often it occurs
    saved: list[tuple[object, int]]  # each distinct saved-bytes expression, and how often

    @classmethod
    def of(cls, groups: list[list[Node]]) -> GraphTotals:
        """The totals of a graph's atoms (atoms_of)."""
        weights: list[tuple[float, float, float]] = []
        works: dict[object, ir.Cost] = {}
        counts: Counter[object] = Counter()
        saved: dict[int, object] = {}
        saved_counts: Counter[int] = Counter()
        ops = 0
        for group in groups:
            costs = [ir.cost(x) for x in group]
            weights.append((
                math.fsum(float(ir.evaluate(c.param_bytes, 1)) for c in costs),
                math.fsum(float(ir.evaluate(c.grad_param_bytes, 1)) for c in costs),
                math.fsum(float(ir.evaluate(c.grad_param_elements, 1)) for c in costs)))
            for x, c in zip(group, costs):
                ops += not is_glue(x)
                key = time_key(c)
                works.setdefault(key, c)
                counts[key] += 1
                saved.setdefault(id(c.saved_bytes), c.saved_bytes)
                saved_counts[id(c.saved_bytes)] += 1
        return cls(weights, ops, [(works[k], n) for k, n in counts.items()],
                   [(saved[k], n) for k, n in saved_counts.items()])

    def held(self, optimizer: OptimizerMemory) -> float:
        """Bytes of the weights, gradients and optimizer state (as `optimizer` holds them)."""
        return math.fsum(optimizer.weight_bytes(p) + optimizer.held_bytes(g, e)
                         for p, g, e in self.weights)

    def saved_bytes(self, b: int) -> float:
        """Bytes one micro-batch of size b saves for its backward."""
        return math.fsum(float(ir.evaluate(e, b)) * n for e, n in self.saved)

    def kernel_time(self, profile: DeviceProfile, b: int) -> tuple[float, float]:
        """Seconds of the kernels of one micro-batch of size b: forward, backward."""
        times = [(estimate_time(cost, profile, b), n) for cost, n in self.costs]
        return math.fsum(f * n for (f, _), n in times), math.fsum(w * n for (_, w), n in times)
