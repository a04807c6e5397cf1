"""Whether a measured profile's numbers hold together, or were measured while something else
loaded the machine.

Load elsewhere only ever slows a micro-benchmark down, and rarely all of them alike, so a profile
measured under load contradicts itself: a larger message moves fewer bytes per second than a
smaller one (a message's bandwidth only grows with its size, up to the link's), one size of a
kernel runs far slower than both its neighbours, or the loopback link (which copies through
memory) moves bytes hundreds of times slower than the memory does, or a small message costs
hundreds of kernel launches. `disagreeing` names the points
to measure again; `implausible` says, in words, what is wrong with a whole profile.
"""
from __future__ import annotations

from collections.abc import Sequence

from fxpipe.profile.device import Curve, DeviceProfile

__all__ = ["disagreeing", "dips", "implausible", "LINK_DROP", "DIP", "LINK_FLOOR",
           "LATENCY_CEILING"]

LINK_DROP = 1 / 10
"""A message size whose rate is below this share of a smaller size's rate was slowed by load
(messages past the caches run several times slower than those that fit, not 10x)."""
DIP = 1 / 3
"""A kernel size whose rate is below this share of both its neighbours' was slowed by load."""
LINK_FLOOR = 100.0
"""Loopback gloo copies a message through memory a few times: a link peak more than this many
times below the memory's bandwidth was measured under load."""
LATENCY_CEILING = 100.0
"""A small loopback message costs a few system calls: one taking more than this many kernel
launches was measured under load (idle machines measure 5-30)."""


def disagreeing(points: Sequence[tuple[float, float]]) -> list[float]:
    """Sizes of (size, rate) link points slower than LINK_DROP of a smaller size's rate."""
    out, best = [], 0.0
    for size, rate in sorted(points):
        if rate < LINK_DROP * best:
            out.append(size)
        best = max(best, rate)
    return out


def dips(points: Sequence[tuple[float, float]]) -> list[float]:
    """Sizes of (size, rate) kernel points below DIP of both neighbours' rates."""
    ordered = sorted(points)
    return [ordered[i][0] for i in range(1, len(ordered) - 1)
            if ordered[i][1] < DIP * min(ordered[i - 1][1], ordered[i + 1][1])]


def implausible(profile: DeviceProfile) -> list[str]:
    """What contradicts itself in a measured profile (nothing for a preset): one phrase each,
    with the values involved."""
    if not profile.source.startswith("measured"):
        return []
    problems = []
    # bytes/s as measured, the latency of each message included
    link = [(size, size / (size / rate + profile.link_latency))
            for size, rate in profile.link.points]
    slow = disagreeing(link)
    if slow:
        problems.append("the link moves fewer bytes/s at " + ", ".join(
            f"{int(s) // 1024} KiB" for s in slow) + " than at a smaller message ("
            + ", ".join(f"{r / 1e9:.3g}" for _, r in link) + " GB/s)")
    memory = profile.mem_bandwidth
    peak = max(rate for _, rate in link)
    if "ping-pong" in profile.source and peak * LINK_FLOOR < memory:
        problems.append(f"the loopback link peaks at {peak / 1e9:.3g} GB/s, "
                        f"over {LINK_FLOOR:.0f}x below the memory's {memory / 1e9:.3g} GB/s")
    small, speed = link[0]
    if "ping-pong" in profile.source and small / speed > LATENCY_CEILING * profile.kernel_overhead:
        problems.append(f"a {int(small) // 1024} KiB loopback message takes "
                        f"{small / speed * 1e6:.0f} us, over {LATENCY_CEILING:.0f}x a kernel "
                        f"launch ({profile.kernel_overhead * 1e6:.2f} us)")
    seen: set[Curve] = set()
    for name, rate in profile.rates:
        for axis, curve in (("GB/s", rate.bandwidth), ("GFLOP/s", rate.flops)):
            if curve is None or curve in seen:
                continue
            seen.add(curve)
            low = dips(curve.points)
            if low:
                problems.append(f"{name} runs slower at {', '.join(f'{s:.3g}' for s in low)} "
                                f"than at both neighbouring sizes ({axis}: " + ", ".join(
                                    f"{r / 1e9:.3g}" for _, r in curve.points) + ")")
    return problems
