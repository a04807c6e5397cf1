"""The partition benchmark's baselines: torchgpipe's "block partitions of sequences" heuristic
(Barany & Grinberg), reimplemented from its description in the reference notes (algorithms.md
section 1.3) as `bg_partition`, and the exact oracle `dp_partition`, the textbook O(n^2 K)
dynamic program, against which fxpipe's solver is checked (fxpipe.tools.bench_partition)."""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from fxpipe.passes.partition.problem import Partition, PartitionProblem, equal_count_cuts, evaluate

__all__ = ["BG_MAX_MOVES_PER_ATOM", "BGResult", "Vector", "bg_partition", "dp_partition"]

BG_MAX_MOVES_PER_ATOM = 64  # iteration bound: moves <= this x n x K

Vector: TypeAlias = Sequence[float] | np.ndarray
"""Per-atom or per-cut numbers, as the solver takes them."""


# --------------------------------------------------------------------------------------------
# torchgpipe's heuristic (Barany & Grinberg), from its description
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BGResult:
    cuts: tuple[int, ...] | None  # None when the time budget ran out
    moves: int
    seconds: float
    status: str  # "ok", "iteration limit" or "skipped (too slow: O(kn^3))"
    repaired: int = 0  # empty blocks left at the end and made non-empty (never seen so far)


def bg_partition(seq: Vector, k: int, *, normalise: str = "minmax",
                 time_budget: float | None = None, max_moves: int | None = None) -> BGResult:
    """Cut `seq` into k contiguous blocks by Barany & Grinberg's algorithm.

    normalise: "minmax" maps x to (x - min) / (max - min) first, as torchgpipe does; "max" maps x
    to x / max (block sums stay proportional); "none" uses seq as it is (elements should be <= 1).
    Start from the even split by count (`equal_count_cuts`) and repeat, in normalised units:
      (1) let p be a largest block (lowest index on ties), M its sum;
      (2) stop if M <= m + 1, m the smallest block sum;
      (3) else let q be the smallest block closest to p (lower index on ties) and h the block
          next to q on p's side; move h's element nearest q into q (p < q: the last of B_{q-1};
          q < p: the first of B_{q+1}); go to (1) if h == p, else to (2).
    Block sums come from prefix sums, so a move costs O(k) here; torchgpipe's docstring states
    O(kn^3) for its version, which re-sums every block on each step.
    """
    t0 = time.perf_counter()
    x = np.asarray(seq, dtype=np.float64)
    n = int(x.shape[0])
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} elements into {k} non-empty blocks")
    if normalise == "minmax":
        lo, span = float(x.min()), float(x.max() - x.min())
        y = (x - lo) / span if span > 0 else np.zeros(n)
    elif normalise == "max":
        top = float(x.max())
        y = x / top if top > 0 else np.zeros(n)
    elif normalise == "none":
        y = x
    else:
        raise ValueError(f"unknown normalise {normalise!r}")
    Q = np.concatenate(([0.0], np.cumsum(y))).tolist()
    c = list(equal_count_cuts(n, k))
    sums = [Q[c[s + 1]] - Q[c[s]] for s in range(k)]
    limit = max_moves if max_moves is not None else BG_MAX_MOVES_PER_ATOM * n * k
    moves = 0
    status = "ok"
    while status == "ok":
        M = max(sums)  # (1)
        p = sums.index(M)
        while True:
            m = min(sums)  # (2)
            if M <= m + 1:
                status = "done"
                break
            q = min((abs(s - p), s) for s in range(k) if sums[s] == m)[1]  # (3)
            if p < q:
                h = q - 1
                c[q] -= 1
            else:
                h = q + 1
                c[q + 1] += 1
            for s in (h, q):
                sums[s] = Q[c[s + 1]] - Q[c[s]]
            moves += 1
            if moves >= limit:
                status = "iteration limit"
                break
            if time_budget is not None and moves % 256 == 0 \
                    and time.perf_counter() - t0 > time_budget:
                return BGResult(None, moves, time.perf_counter() - t0,
                                "skipped (too slow: O(kn^3))")
            if h == p:
                break
    # The algorithm never moves an element out of an empty block; a block can only be empty at
    # the end if all block sums are <= 1.  Keep the cuts strictly increasing regardless.
    repaired = sum(1 for s in range(k) if c[s + 1] <= c[s])
    for s in range(1, k):
        c[s] = max(c[s], c[s - 1] + 1)
    for s in range(k - 1, 0, -1):
        c[s] = min(c[s], c[s + 1] - 1)
    return BGResult(tuple(c), moves, time.perf_counter() - t0,
                    "ok" if status == "done" else status, repaired)


# --------------------------------------------------------------------------------------------
# the exact oracle
# --------------------------------------------------------------------------------------------


def dp_partition(problem: PartitionProblem, *, upper: float | None = None,
                 chunk: int = 256) -> Partition:
    """The bottleneck-optimal k-stage partition by D[s][j] = min_i max(D[s-1][i], T(i, j)) with
    T(i, j) = sum(compute[i:j]) + cut_comm[i] + cut_comm[j] (ends 0), vectorised over blocks of j.

    upper: the bottleneck of any k-stage partition (an upper bound on the optimum); stages with
    compute alone above it cannot be in an optimal partition, so i starts at the first position
    with P[j] - P[i] <= upper.  Costs use float prefix sums; the result is re-scored by evaluate.
    """
    x = np.asarray(problem.compute, dtype=np.float64)
    n, k = problem.num_atoms, problem.num_stages
    c = np.asarray(problem.cut_comm, dtype=np.float64)  # the ends are 0
    P = np.concatenate(([0.0], np.cumsum(x)))
    band = math.inf if upper is None else upper * (1 + 1e-9) + 1e-12 * float(P[-1])
    prev = np.full(n + 1, math.inf)
    prev[0] = 0.0
    arg = np.zeros((k + 1, n + 1), dtype=np.int64)
    for s in range(1, k + 1):
        cur = np.full(n + 1, math.inf)
        for j0 in range(s, n - k + s + 1, chunk):
            js = np.arange(j0, min(j0 + chunk, n - k + s + 1))
            i_lo = s - 1
            if not math.isinf(band):
                i_lo = max(i_lo, int(np.searchsorted(P, P[j0] - band, side="left")))
            starts = np.arange(i_lo, int(js[-1]))  # the i of every candidate stage [i, j)
            T = (P[js][None, :] - P[starts][:, None]) + c[starts][:, None] + c[js][None, :]
            T[starts[:, None] >= js[None, :]] = math.inf
            V = np.maximum(prev[starts][:, None], T)
            best = np.argmin(V, axis=0)
            cur[js] = V[best, np.arange(js.shape[0])]
            arg[s, js] = starts[best]
        prev = cur
    if not math.isfinite(prev[n]):
        raise AssertionError("dp_partition: no partition within the upper bound")
    cuts = [n]
    for s in range(k, 0, -1):
        cuts.append(int(arg[s, cuts[-1]]))
    return evaluate(problem, tuple(reversed(cuts)))
