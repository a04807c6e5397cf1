"""A node's time from its cost: each op class's work at the profile's rate for that class."""
from __future__ import annotations

from fxpipe import ir
from fxpipe.profile import DeviceProfile

__all__ = ["estimate_time", "time_key"]


def time_key(cost: ir.Cost) -> object:
    """What estimate_time reads of a cost, as a dict key: a stamped block's copies share their
    twin's `work` (the same object), so a deep model's nodes fall into a few keys."""
    if cost.work:
        return id(cost.work)  # alive in the graph's costs while a caller keys by it
    return (cost.fwd_flops, cost.fwd_bytes, cost.fwd_kernels, cost.bwd_flops, cost.bwd_bytes,
            cost.bwd_kernels)


def estimate_time(cost: ir.Cost, profile: DeviceProfile, b: int) -> tuple[float, float]:
    """Forward and backward seconds of one node at micro-batch size b: each op class's work at
    that class's rate (a roofline per class, fxpipe.profile.device)."""
    if not cost.work:  # costed without op classes: one roofline over the totals
        at = cost.at(b)
        return (profile.compute_time(at["fwd_flops"], at["fwd_bytes"], cost.fwd_kernels,
                                     op_class="matmul"),
                profile.compute_time(at["bwd_flops"], at["bwd_bytes"], cost.bwd_kernels,
                                     op_class="matmul"))
    times = [0.0, 0.0]
    for w in cost.work:
        times[w.backward] += profile.class_time(w.op_class, float(ir.evaluate(w.flops, b)),
                                                float(ir.evaluate(w.bytes, b)), w.kernels)
    return times[0], times[1]
