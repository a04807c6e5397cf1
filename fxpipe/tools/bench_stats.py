"""The statistics `fxpipe bench` states its ratios with, and the bound of each schedule.

A shared machine drifts by tens of percent within minutes, so two variants are compared step by
step: each measured step runs every variant once, in an order rotated from step to step, and
the ratio of two variants is taken within each step (paired), then summarised by its median
with a bootstrap 95% interval. A claim of "faster" or "slower" is made only when the interval
excludes 1.0.
"""
from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.runtime.planning.schedule import make_schedule
from fxpipe.runtime.planning.simulate import simulate

__all__ = ["PairedRatio", "paired_ratio", "bootstrap_interval", "rotated", "measured_steps",
           "schedule_bound", "MAX_STEPS"]

MAX_STEPS = 400  # measured steps that `measured_steps` adds up to, however short a step


@dataclass(frozen=True)
class PairedRatio:
    """a / b step by step: the median of the per-step ratios and its bootstrap interval."""

    median: float
    low: float
    high: float
    steps: int

    @property
    def verdict(self) -> str:
        """"faster" or "slower" (a against b) only when the interval excludes 1.0."""
        if self.high < 1.0:
            return "faster"
        if self.low > 1.0:
            return "slower"
        return "not resolved"

    def describe(self) -> str:
        return (f"{self.median:.3f} (95% interval {self.low:.3f}-{self.high:.3f} over "
                f"{self.steps} paired steps: {self.verdict})")


def bootstrap_interval(values: Sequence[float], level: float = 0.95, resamples: int = 4000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of `values` (seeded: the same data give
    the same interval)."""
    if not values:
        raise ValueError("no values to take an interval of")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1.0 - tail) * (resamples - 1))]


def paired_ratio(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> PairedRatio:
    """a[i] / b[i] for each step i (both measured in step i), summarised."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired ratios need as many steps of each (got {len(a)} and {len(b)})")
    ratios = [x / y for x, y in zip(a, b)]
    low, high = bootstrap_interval(ratios, level)
    return PairedRatio(statistics.median(ratios), low, high, len(ratios))


def rotated(names: Sequence[str], step: int) -> list[str]:
    """`names` started at position step mod len: each variant runs first, second, ... in turn,
    so a drift within a step hits every variant alike over the steps."""
    if not names:
        return []
    k = step % len(names)
    return [*names[k:], *names[:k]]


def measured_steps(round_seconds: float, steps: int, seconds: float,
                   cap: int = MAX_STEPS) -> int:
    """Measured steps per variant: at least `steps`, and as many more as fill `seconds` of
    measuring at `round_seconds` a round (every variant once), up to `cap`. The noise of one
    step is about the same in milliseconds whatever it runs: a model of a few milliseconds a
    step needs a hundred steps where one of a second needs fifteen, and costs less."""
    if round_seconds <= 0 or seconds <= 0:
        return steps
    return max(steps, min(cap, int(seconds / round_seconds)))


def schedule_bound(schedule: str, chunks: int, ranks: int, stages_per_rank: int = 1) -> float:
    """The speedup a schedule reaches over one process at equal stage costs and free messages:
    one process runs 3 units per rank's share per micro-batch (F = 1, B = 2, a split backward's
    I = W = 1), the pipeline the schedule's simulated step. GPipe's is KM/(M+K-1)."""
    stages = ranks * stages_per_rank
    share = 1.0 / stages_per_rank  # a stage is this much of a rank's share
    _, makespan = simulate(make_schedule(schedule, chunks, stages, ranks),
                           forward_time=[share] * stages, backward_time=[2 * share] * stages)
    return 3.0 * ranks * chunks / makespan
