"""Slow references for the partition solver: a brute force over every cut set (the test oracle)
and a timing benchmark on random instances."""
from __future__ import annotations

import itertools
import math
import time
from typing import TypedDict

import numpy as np

from fxpipe.errors import PartitionError
from fxpipe.passes.partition.problem import (
    Partition,
    PartitionProblem,
    build_partition,
    comm_sum,
    memory_error,
    partition_problem,
    stage_time,
)
from fxpipe.passes.partition.solver import min_memory_limit, solve_partition

__all__ = ["brute_force_partition", "benchmark", "SolveBenchmark"]

# Enumerations the brute force accepts before refusing.
_BRUTE_FORCE_MAX = 5_000_000


def brute_force_partition(problem: PartitionProblem) -> Partition:
    """Reference solver: enumerates every cut set (for tests, n <= ~14).  Minimises the exact
    bottleneck, then the interior communication, then the cut tuple."""
    n, K = problem.num_atoms, problem.num_stages
    count = math.comb(n - 1, K - 1)
    if count > _BRUTE_FORCE_MAX:
        raise PartitionError(
            f"brute force would enumerate {count} cut sets (more than {_BRUTE_FORCE_MAX})",
            hint="use solve_partition for instances this large",
        )
    memory = problem.memory
    limit = memory.limit if memory is not None else None
    T = {(i, j): stage_time(problem, i, j) for i in range(n) for j in range(i + 1, n + 1)}
    best_key = None
    best_cuts: tuple[int, ...] | None = None
    min_peak = math.inf
    for inner in itertools.combinations(range(1, n), K - 1):
        cuts = (0, *inner, n)
        if memory is not None and limit is not None:
            peak = max(memory.stage_bytes(s, i, j) for s, (i, j) in enumerate(zip(cuts, cuts[1:])))
            min_peak = min(min_peak, peak)
            if not memory.fits(peak):
                continue
        key = (max(T[i, j] for i, j in zip(cuts, cuts[1:])), comm_sum(problem, cuts), cuts)
        if best_key is None or key < best_key:
            best_key, best_cuts = key, cuts
    if best_cuts is None:
        raise memory_error(K, limit if limit is not None else 0.0, min_peak)
    return build_partition(problem, best_cuts)


class SolveBenchmark(TypedDict):
    """One timed solve of `benchmark`."""

    n: int
    stages: int
    seconds: float
    bottleneck: float


def benchmark(
    n: int = 100_000, stages: int = 64, seed: int = 0, *, with_memory: bool = False
) -> SolveBenchmark:
    """Time solve_partition on a random instance: compute in [0, 1), cut_comm in [0, 0.5).

    With ``with_memory`` a random memory model (1F1B in-flight counts with 2*stages micro-batches)
    is added and the limit is set halfway between the smallest feasible limit and the peak memory
    of the unconstrained optimum, so that it binds; only the constrained solve is timed.
    """
    rng = np.random.default_rng(seed)
    compute = rng.random(n)
    cut_comm = 0.5 * rng.random(n + 1)
    problem = partition_problem(compute, stages, cut_comm=cut_comm)  # without: no memory model
    if with_memory:
        mem_fixed, mem_act, cut_mem = rng.random(n), rng.random(n), 0.5 * rng.random(n + 1)
        inflight = [min(stages - s, 2 * stages) for s in range(stages)]
        unlimited = partition_problem(compute, stages, cut_comm=cut_comm, mem_fixed=mem_fixed,
                                      mem_act=mem_act, cut_mem=cut_mem, inflight=inflight)
        free = solve_partition(unlimited)
        assert free.stage_memory is not None
        memory_limit = 0.5 * (min_memory_limit(unlimited) + max(free.stage_memory))
        problem = partition_problem(compute, stages, cut_comm=cut_comm, mem_fixed=mem_fixed,
                                    mem_act=mem_act, cut_mem=cut_mem, inflight=inflight,
                                    memory_limit=memory_limit)
    t0 = time.perf_counter()
    part = solve_partition(problem)
    seconds = time.perf_counter() - t0
    return {"n": n, "stages": stages, "seconds": seconds, "bottleneck": part.bottleneck}
