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
from fxpipe.passes.estimate import estimate_time, time_key
from fxpipe.passes.partition.atoms import accumulation
from fxpipe.profile import DeviceProfile
from fxpipe.profile.kinds import overhead_kind

__all__ = ["GraphTotals"]


@dataclass
class GraphTotals:
    """The sums node_facts' atoms add up to (balance="cost", no corrections)."""

    weights: list[tuple[float, float, float]]  # per atom: parameter bytes, gradient bytes, elements
    accumulate: list[tuple[float, float, int]]  # per weight-using node: gradient bytes, elements,
    # tensors (what each micro-batch but the first adds into the gradients)
    kinds: Counter[str]  # operations and views by what they pay beyond kernels (overhead_kind)
    costs: list[tuple[ir.Cost, int]]  # a cost of each distinct work, and how often it occurs
    saved: list[tuple[object, int]]  # each distinct saved-bytes expression, and how often

    @classmethod
    def of(cls, groups: list[list[Node]]) -> GraphTotals:
        """The totals of a graph's atoms (atoms_of)."""
        weights: list[tuple[float, float, float]] = []
        accumulate: list[tuple[float, float, int]] = []
        works: dict[object, ir.Cost] = {}
        counts: Counter[object] = Counter()
        saved: dict[int, object] = {}
        saved_counts: Counter[int] = Counter()
        kinds: Counter[str] = Counter()
        for group in groups:
            costs = [ir.cost(x) for x in group]
            weights.append((
                math.fsum(float(ir.evaluate(c.param_bytes, 1)) for c in costs),
                math.fsum(float(ir.evaluate(c.grad_param_bytes, 1)) for c in costs),
                math.fsum(float(ir.evaluate(c.grad_param_elements, 1)) for c in costs)))
            for x, c in zip(group, costs):
                if c.grad_params:
                    accumulate.append((float(ir.evaluate(c.grad_param_bytes, 1)),
                                       float(ir.evaluate(c.grad_param_elements, 1)),
                                       c.grad_params))
                kind = overhead_kind(x)
                if kind is not None:
                    kinds[kind] += 1
                key = time_key(c)
                works.setdefault(key, c)
                counts[key] += 1
                saved.setdefault(id(c.saved_bytes), c.saved_bytes)
                saved_counts[id(c.saved_bytes)] += 1
        return cls(weights, accumulate, kinds, [(works[k], n) for k, n in counts.items()],
                   [(saved[k], n) for k, n in saved_counts.items()])

    def held(self, optimizer: OptimizerMemory) -> float:
        """Bytes of the weights, gradients and optimizer state (as `optimizer` holds them)."""
        return math.fsum(optimizer.weight_bytes(p) + optimizer.held_bytes(g, e)
                         for p, g, e in self.weights)

    def saved_bytes(self, b: int) -> float:
        """Bytes one micro-batch of size b saves for its backward."""
        return math.fsum(float(ir.evaluate(e, b)) * n for e, n in self.saved)

    def paid(self, profile: DeviceProfile) -> tuple[float, float, float]:
        """Seconds the operations of one micro-batch pay beyond their kernels: in all, in the
        forward, and for a remat region's bookkeeping where it is recomputed."""
        return (math.fsum(n * profile.operation_overhead(k) for k, n in self.kinds.items()),
                math.fsum(n * profile.operation_forward_overhead(k)
                          for k, n in self.kinds.items()),
                math.fsum(n * profile.operation_region_overhead(k)
                          for k, n in self.kinds.items()))

    def accumulation(self, profile: DeviceProfile) -> float:
        """Seconds a micro-batch after the step's first adds its weight gradients in."""
        return math.fsum(accumulation(profile, g, e, t) for g, e, t in self.accumulate)

    def kernel_time(self, profile: DeviceProfile, b: int) -> tuple[float, float]:
        """Seconds of the kernels of one micro-batch of size b: forward, backward."""
        times = [(estimate_time(cost, profile, b), n) for cost, n in self.costs]
        return math.fsum(f * n for (f, _), n in times), math.fsum(w * n for (_, w), n in times)
