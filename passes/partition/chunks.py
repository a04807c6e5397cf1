"""How many micro-batches: the divisor of the batch size whose plan predicts the fastest step."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from fxpipe.errors import ConfigError, PartitionError
from fxpipe.passes.partition.graph import PartitionPlan

__all__ = ["choose_chunks"]


def choose_chunks(batch: int, chunks: int | str,
                  plan_for: Callable[[int], PartitionPlan]) -> PartitionPlan:
    """The plan for `chunks` micro-batches, or with chunks="auto" the best over every divisor of
    `batch` (plan_for(c) partitions for c micro-batches and writes STAGE on the graph; the
    returned plan is the last one made, so the graph carries its stages)."""
    if isinstance(chunks, int):
        if chunks > batch:
            raise ConfigError(f"chunks ({chunks}) is larger than the batch size ({batch})",
                              hint=f"use chunks <= {batch}, or a larger example batch")
        if batch % chunks:
            raise ConfigError(f"batch size {batch} cannot be split into {chunks} equal "
                              "micro-batches", hint=f"use chunks in {_divisors(batch)} "
                                                    "(or chunks='auto')")
        return plan_for(chunks)
    candidates: list[tuple[int, float]] = []
    best: PartitionPlan | None = None
    for count in _divisors(batch):
        try:
            plan = plan_for(count)
        except PartitionError:
            continue
        candidates.append((count, plan.predicted_step_time))
        if best is None or plan.predicted_step_time < best.predicted_step_time:
            best = plan
    if best is None:
        raise PartitionError(f"no number of micro-batches (divisors of {batch}) gives a feasible "
                             "partition", hint="raise memory_limit or use more stages")
    plan = plan_for(best.chunks)  # again, so the STAGE metadata is the chosen plan's
    return replace(plan, candidates=tuple(candidates))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
