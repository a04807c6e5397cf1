"""Exact bottleneck-optimal cutting of a chain of atoms into K contiguous pipeline stages.

Objective: among the K-stage cut sets of a PartitionProblem (passes.partition.problem), minimise
the slowest stage time T(i, j), every stage within the memory limit when one is given; ties go to
the least interior communication.

Algorithm: bisection on the bottleneck B with an exact probe "is there a K-stage partition with
every T <= B and Mem <= limit?", answered by layered reachability over cut positions.  With
prefix sums P, T(i, j) <= B iff g[i] = c[i] - P[i] <= h[j] = B - c[j] - P[j], so a layer is a
prefix minimum of g (np.minimum.accumulate); under a memory limit the j allowed after i form an
interval (i, e_i] (np.searchsorted on a non-decreasing prefix, cached per layer) and a layer is an
interval-stabbing minimum on a top-down power-of-two table.  Layers are restricted to windows of
positions still reachable from 0 and still able to reach n, a thin band near the optimum; each
feasible probe is walked back into cuts whose exact bottleneck tightens the bracket, and a
min-plus pass over the final layers picks the least-communication partition (skipped when the
layers are too wide).  Reported costs are recomputed exactly from the cuts
(problem.build_partition).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from fxpipe.errors import PartitionError
from fxpipe.passes.partition.problem import (
    MemoryModel,
    Partition,
    PartitionProblem,
    build_partition,
    comm_sum,
    equal_count_cuts,
    memory_error,
)

__all__ = ["solve_partition", "min_memory_limit"]

# Most cells the least-communication tie-break may build (sum over layers of |R_s| * |R_s+1|).
_TIE_BREAK_BUDGET = 4_000_000
# Most entries of the per-layer memory interval cache (n * K); above it ends are searched per probe.
_ECACHE_MAX = 20_000_000

_INF = math.inf


# --------------------------------------------------------------------------------------------
# the problem as the probe reads it
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _MemoryPrefix:
    """A MemoryModel as prefix sums, in the probe's notation."""

    Fp: np.ndarray
    """Prefix sums of MemoryModel.fixed, n + 1 entries."""
    Ap: np.ndarray
    """Prefix sums of MemoryModel.per_microbatch, n + 1 entries."""
    cm: np.ndarray
    """MemoryModel.at_cut, n + 1 entries."""
    f: np.ndarray
    """MemoryModel.inflight, K entries."""

    @staticmethod
    def of(memory: MemoryModel) -> _MemoryPrefix:
        return _MemoryPrefix(
            Fp=np.concatenate(([0.0], np.cumsum(np.asarray(memory.fixed)))),
            Ap=np.concatenate(([0.0], np.cumsum(np.asarray(memory.per_microbatch)))),
            cm=np.asarray(memory.at_cut),
            f=np.asarray(memory.inflight),
        )


@dataclass(frozen=True)
class _Bound:
    """A memory limit the probe enforces."""

    memory: MemoryModel
    """The memory model, exact."""
    mem: _MemoryPrefix
    """The memory model as prefix sums."""
    limit: float
    """Bytes a stage may hold."""
    allowed: float
    """limit plus the memory model's slack: what the prefix arithmetic compares with."""


@dataclass
class MemoryEnds:
    """The solver's cache of per-layer memory interval ends (independent of the bottleneck)."""

    windows: tuple[np.ndarray, np.ndarray] | None = None  # memory-only windows [a_s, b_s]
    layers: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)  # s -> (lo, e)


@dataclass(frozen=True)
class _Search:
    """The problem in the probe's notation (module docstring): numpy arrays and prefix sums."""

    n: int
    """PartitionProblem.num_atoms."""
    K: int
    """PartitionProblem.num_stages."""
    compute: np.ndarray
    """PartitionProblem.compute."""
    comm: np.ndarray
    """PartitionProblem.cut_comm (c), n + 1 entries."""
    P: np.ndarray
    """Prefix sums of compute, n + 1 entries."""
    g: np.ndarray
    """comm - P."""
    cP: np.ndarray
    """comm + P."""
    bound: _Bound | None
    """The memory limit enforced, or None."""
    ecache: MemoryEnds | None = None
    """Per-layer memory interval ends, filled lazily by the probe when given."""

    @staticmethod
    def of(problem: PartitionProblem) -> _Search:
        comp = np.asarray(problem.compute, dtype=np.float64)
        comm = np.asarray(problem.cut_comm, dtype=np.float64)
        P = np.concatenate(([0.0], np.cumsum(comp)))
        memory = problem.memory
        bound = None
        if memory is not None and memory.limit is not None:
            bound = _Bound(memory, _MemoryPrefix.of(memory), memory.limit,
                           memory.limit + memory.slack)
        return _Search(n=problem.num_atoms, K=problem.num_stages, compute=comp, comm=comm, P=P,
                       g=comm - P, cP=comm + P, bound=bound)


# --------------------------------------------------------------------------------------------
# the feasibility probe
# --------------------------------------------------------------------------------------------


def _last_true(pred: Callable[[np.ndarray], np.ndarray], lo: np.ndarray,
               hi: np.ndarray) -> np.ndarray:
    """Vectorised binary search: per entry, the last x in [lo, hi) with pred(x) true, where pred
    is true then false on [lo - 1, hi] and pred(lo - 1) is taken as true, pred(hi) as false."""
    lo = lo - 1
    while True:
        open_ = hi - lo > 1
        if not open_.any():
            return lo
        mid = (lo + hi) // 2
        ok = pred(np.where(open_, mid, lo.clip(0)))
        lo = np.where(open_ & ok, mid, lo)
        hi = np.where(open_ & ~ok, mid, hi)


def _windows(search: _Search, B: float,
             bound: _Bound | None) -> tuple[np.ndarray, np.ndarray]:
    """Per layer s, the positions [a_s, b_s] that cut c_s can take with all T <= B (B may be inf)
    and all Mem <= bound.limit (None: no limit): stage times are at least their compute, stage
    memories at least sum(fixed + min_inflight * per_microbatch) over their atoms."""
    n, K = search.n, search.K
    s = np.arange(K + 1)
    a = s.copy()
    b = n - K + s
    if not math.isinf(B):
        P = search.P
        slack = 1e-9 * (float(P[-1]) + K * B)
        with np.errstate(over="ignore", invalid="ignore"):
            # P[c_s] <= s*B and P[n] - P[c_s] <= (K - s)*B
            up = np.searchsorted(P, s * B + slack, side="right") - 1
            low = np.searchsorted(P, P[-1] - (K - s) * B - slack, side="left")
        a = np.maximum(a, low)
        b = np.minimum(b, up)
    if bound is not None and not math.isinf(bound.limit):
        L = bound.limit
        Fp, Ap, f = bound.mem.Fp, bound.mem.Ap, bound.mem.f
        fwd = np.concatenate(([f[0]], np.minimum.accumulate(f)))  # min f over t < s
        bwd = np.concatenate((np.minimum.accumulate(f[::-1])[::-1], [f[-1]]))  # t >= s
        slack = 1e-9 * (float(Fp[-1]) + float(f.max()) * float(Ap[-1]) + K * L)
        with np.errstate(over="ignore", invalid="ignore"):
            t_up = s * L + slack
            t_low = (Fp[-1] + bwd * Ap[-1]) - (K - s) * L - slack
        up = _last_true(lambda j: Fp[j] + fwd * Ap[j] <= t_up, a, b + 1)
        # first j with Fp[j] + bwd*Ap[j] >= t_low: one past the last j where it is below
        low = _last_true(lambda j: Fp[j] + bwd * Ap[j] < t_low, a, b + 1) + 1
        a = np.maximum(a, low)
        b = np.minimum(b, up)
    a[0] = b[0] = 0
    a[K] = b[K] = n
    return a, b


def _stab_min(lo: np.ndarray, hi: np.ndarray, val: np.ndarray, w: int) -> np.ndarray:
    """For every j in 0..w-1 the minimum of val over the intervals [lo, hi] that contain j."""
    length = hi - lo + 1
    k = (np.frexp(length.astype(np.float64))[1] - 1).astype(np.int64)  # floor(log2(length))
    kmax = int(k.max())
    table: np.ndarray = np.full((kmax + 1) * w, _INF)
    size = np.left_shift(np.int64(1), k)
    idx = np.concatenate((k * w + lo, k * w + hi - size + 1))
    np.minimum.at(table, idx, np.concatenate((val, val)))
    table = table.reshape(kmax + 1, w)
    for lev in range(kmax, 0, -1):
        half = 1 << (lev - 1)
        row = table[lev]
        below = table[lev - 1]
        np.minimum(below, row, out=below)
        np.minimum(below[half:], row[: w - half], out=below[half:])
    lowest: np.ndarray = table[0]
    return lowest


_Layers = list[tuple[int, np.ndarray]]


def _memory_ends(search: _Search, bound: _Bound, cache: MemoryEnds,
                 s: int) -> tuple[int, np.ndarray]:
    """For layer s, e_i = the last j with Mem(s, i, j) <= limit (prefix arithmetic, as in the
    probe) for every i of the memory-only window of layer s; independent of B, so cached."""
    hit = cache.layers.get(s)
    if hit is not None:
        return hit
    mem = bound.mem
    if cache.windows is None:
        cache.windows = _windows(search, _INF, bound)
    wa, wb = cache.windows
    lo, top = int(wa[s]), int(wb[s + 1])
    hi = min(int(wb[s]), top)
    fs = mem.f[s]
    Q = mem.Fp[lo : top + 1] + fs * mem.Ap[lo : top + 1]
    lim = (bound.allowed + Q[: hi - lo + 1]) - fs * mem.cm[lo : hi + 1]
    e = (lo - 1 + np.searchsorted(Q, lim, side="right")).astype(np.int64)
    cache.layers[s] = (lo, e)
    return lo, e


def _probe(search: _Search, B: float) -> _Layers | None:
    """Layers (a_s, reached mask over [a_s, ...]) if a K-stage partition with all T <= B and all
    Mem <= limit exists, else None.  B = inf checks memory only."""
    n, K = search.n, search.K
    P, g, cP = search.P, search.g, search.cP
    time_free = math.isinf(B)
    bound = search.bound
    wa, wb = _windows(search, B, bound)
    if np.any(wa > wb):
        return None
    tslack = 0.0 if time_free else 1e-9 * (float(P[-1]) + K * B)
    layers: _Layers = [(0, np.ones(1, dtype=bool))]
    first = last = 0
    for s in range(K):
        a, r = layers[-1]
        a2 = max(int(wa[s + 1]), first + 1)
        b2 = int(wb[s + 1])
        if not time_free:
            b2 = min(b2, int(np.searchsorted(P, P[last] + B + tslack, side="right")) - 1)
        if a2 > b2:
            return None
        seg = r[first - a : last - a + 1]
        if bound is not None:
            mem = bound.mem
            starts = first + np.flatnonzero(seg)
            if not time_free:  # starts whose g exceeds every h of the next window reach nothing
                starts = starts[g[starts] <= (B - cP[a2 : b2 + 1]).max()]
            if search.ecache is not None:
                start, E = _memory_ends(search, bound, search.ecache, s)
                e = E[starts - start]
            else:
                fs = mem.f[s]
                Q = mem.Fp[first : b2 + 1] + fs * mem.Ap[first : b2 + 1]
                lim = (bound.allowed + Q[starts - first]) - fs * mem.cm[starts]
                e = first - 1 + np.searchsorted(Q, lim, side="right")
            lo = np.maximum(starts + 1, a2)
            hi = np.minimum(e, b2)
            keep = lo <= hi
            if not keep.any():
                return None
            b2 = min(b2, int(hi[keep].max()))
            w = b2 - a2 + 1
            lo = lo[keep] - a2
            hi = hi[keep] - a2
            if time_free:
                diff = np.bincount(lo, minlength=w + 1) - np.bincount(hi + 1, minlength=w + 1)
                r2 = np.cumsum(diff[:w]) > 0
            else:
                stab = _stab_min(lo, hi, g[starts[keep]], w)
                r2 = stab <= B - cP[a2 : b2 + 1]
        elif time_free:
            r2 = np.ones(b2 - a2 + 1, dtype=bool)
        else:
            w = b2 - a2 + 1
            pm = np.minimum.accumulate(np.where(seg, g[first : last + 1], _INF))
            m = last - first
            lo_i, hi_i = a2 - 1 - first, b2 - 1 - first
            if hi_i <= m:
                vals = pm[lo_i : hi_i + 1]
            elif lo_i >= m:
                vals = np.full(w, pm[m])
            else:
                vals = np.concatenate((pm[lo_i:], np.full(hi_i - m, pm[m])))
            r2 = vals <= B - cP[a2 : b2 + 1]
        nz = np.flatnonzero(r2)
        if nz.size == 0:
            return None
        first, last = a2 + int(nz[0]), a2 + int(nz[-1])
        layers.append((a2, r2))
    if not (layers[-1][0] == n and layers[-1][1][0]):
        return None
    return layers


def _valid_from(
    search: _Search, B: float, s: int, cand: np.ndarray, j: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Which candidate starts i (of layer s) may precede cut j, with the probe's arithmetic; also
    the prefix-sum stage memory when a limit is enforced."""
    ok = search.g[cand] <= B - search.cP[j]
    mem = None
    bound = search.bound
    if bound is not None:
        Fp, Ap, cm = bound.mem.Fp, bound.mem.Ap, bound.mem.cm
        fs = bound.mem.f[s]
        Qj = Fp[j] + fs * Ap[j]
        Qi = Fp[cand] + fs * Ap[cand]
        ok &= Qj <= (bound.allowed + Qi) - fs * cm[cand]
        mem = (Qj - Qi) + fs * cm[cand]
    return ok, mem


def _walk_back(search: _Search, B: float, layers: _Layers, *,
               by_memory: bool = False) -> tuple[int, ...]:
    """Concrete cuts through the probe's layers: from n backwards, each step takes the admissible
    start with the shortest stage (or the smallest stage memory)."""
    j = search.n
    cuts = [j]
    for s in range(search.K - 1, -1, -1):
        a, r = layers[s]
        top = min(j - 1, a + r.shape[0] - 1)
        cand = a + np.flatnonzero(r[: top - a + 1])
        ok, mem = _valid_from(search, B, s, cand, j)
        if by_memory and mem is not None:
            key = mem[ok]
        else:
            key = search.g[cand[ok]]
        cand = cand[ok]
        if cand.size == 0:  # pragma: no cover - the probe guarantees a predecessor
            raise AssertionError("partition walk-back found no predecessor")
        j = int(cand[int(np.argmin(key))])
        cuts.append(j)
    return tuple(reversed(cuts))


def _least_comm_cuts(search: _Search, B: float, layers: _Layers) -> tuple[int, ...] | None:
    """Among the partitions the layers encode (all T <= B, Mem <= limit), one with the least
    interior cut_comm (ties: shortest stage walking back); None when the layers are too wide."""
    K = search.K
    pos = [a + np.flatnonzero(r) for a, r in layers]
    if sum(len(pos[s]) * len(pos[s + 1]) for s in range(K)) > _TIE_BREAK_BUDGET:
        return None
    g, cP = search.g, search.cP
    bound = search.bound
    costs = [np.zeros(1)]
    mats = []
    for s in range(K):
        starts, J = pos[s], pos[s + 1]
        V = (starts[:, None] < J[None, :]) & (g[starts][:, None] <= (B - cP[J])[None, :])
        if bound is not None:
            Fp, Ap, cm = bound.mem.Fp, bound.mem.Ap, bound.mem.cm
            fs = bound.mem.f[s]
            QI = Fp[starts] + fs * Ap[starts]
            QJ = Fp[J] + fs * Ap[J]
            V &= QJ[None, :] <= ((bound.allowed + QI) - fs * cm[starts])[:, None]
        cost = np.where(V, costs[-1][:, None], _INF).min(axis=0) + search.comm[J]
        mats.append(V)
        costs.append(cost)
    if not np.isfinite(costs[K][0]):  # pragma: no cover - the probe reached n
        return None
    y = 0
    cuts = [search.n]
    for s in range(K - 1, -1, -1):
        col = mats[s][:, y]
        c = costs[s]
        cand = np.flatnonzero(col & np.isfinite(c))
        best = c[cand].min()
        tied = cand[c[cand] == best]
        x = int(tied[int(np.argmin(g[pos[s][tied]]))])
        cuts.append(int(pos[s][x]))
        y = x
    return tuple(reversed(cuts))


# --------------------------------------------------------------------------------------------
# baselines and bounds
# --------------------------------------------------------------------------------------------


def _balanced_cuts(P: np.ndarray, K: int) -> tuple[int, ...]:
    """Cuts nearest the K-quantiles of the compute prefix sum (a cheap upper-bound partition)."""
    n = P.shape[0] - 1
    s = np.arange(K + 1)
    t = s * (P[-1] / K)
    x = np.clip(np.searchsorted(P, t), 1, n)
    x = np.where(np.abs(P[x - 1] - t) <= np.abs(P[x] - t), x - 1, x)
    x = np.clip(x, s, n - K + s)
    x = np.maximum.accumulate(x - s) + s
    x[0], x[K] = 0, n
    return tuple(int(v) for v in x)


def _min_memory(search: _Search, memory: MemoryModel) -> float:
    """Smallest limit admitting a K-stage partition (memory only); memory.limit counts only in
    the slack, and the bottleneck is ignored."""
    n, K = search.n, search.K
    mem = _MemoryPrefix.of(memory)

    def max_mem(cuts: Sequence[int]) -> float:
        return max(memory.stage_bytes(s, i, j) for s, (i, j) in enumerate(zip(cuts, cuts[1:])))

    if K == 1 or K == n:
        return max_mem(tuple(range(n + 1)) if K == n else (0, n))
    mf = np.diff(mem.Fp)
    ma = np.diff(mem.Ap)
    fmin = float(mem.f.min())
    lo = max(float((mf + fmin * ma).max()), (float(mem.Fp[-1]) + fmin * float(mem.Ap[-1])) / K)
    weights = np.concatenate(([0.0], np.cumsum(mf + float(mem.f.mean()) * ma)))
    best = min(max_mem(c) for c in (equal_count_cuts(n, K), _balanced_cuts(weights, K)))
    hi = best
    rtol = 1e-11
    for _ in range(200):
        if hi - lo <= rtol * hi:
            break
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        trial = replace(search, bound=_Bound(memory, mem, mid, mid + memory.slack), ecache=None)
        layers = _probe(trial, _INF)
        if layers is None:
            lo = mid
        else:
            m = max_mem(_walk_back(trial, _INF, layers, by_memory=True))
            best = min(best, m)
            hi = min(mid, best)
    return best


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def min_memory_limit(problem: PartitionProblem) -> float:
    """The smallest memory limit for which some partition of the problem fits (its compute,
    communication and own limit ignored).

    The value is the exact peak stage memory of a partition found by bisection (relative
    precision 1e-11), so a solve with exactly this limit is feasible.
    """
    if problem.memory is None:
        raise PartitionError("min_memory_limit needs a memory model, and the problem has none",
                             hint="build the problem with mem_fixed (partition_problem)")
    return _min_memory(_Search.of(problem), replace(problem.memory, limit=None))


def solve_partition(problem: PartitionProblem, *, rel_tol: float = 1e-9,
                    least_memory: bool = True) -> Partition:
    """The K-stage partition minimising the bottleneck stage time within rel_tol (relative),
    subject to the memory limit; among such partitions, the least interior communication.
    When none fits the limit, the PartitionError names the least limit that would fit (a
    bisection of its own), unless `least_memory` is False (a caller asking only whether one
    fits)."""
    rel_tol = float(rel_tol)
    if not rel_tol >= 0 or math.isinf(rel_tol):
        raise PartitionError(
            f"rel_tol must be a finite non-negative number (got {rel_tol!r})",
            hint="use e.g. 1e-9",
        )
    search = _Search.of(problem)
    n, K = search.n, search.K
    bound = search.bound
    if bound is not None and n * K <= _ECACHE_MAX:
        search = replace(search, ecache=MemoryEnds())

    mem_layers = None
    if bound is not None:
        mem_layers = _probe(search, _INF)
        if mem_layers is None:
            raise memory_error(K, bound.limit, _min_memory(search, bound.memory)
                               if least_memory else None)
    if K == 1 or K == n:
        return build_partition(problem, (0, n) if K == 1 else tuple(range(n + 1)))

    best: Partition | None = None

    def consider(cuts: Sequence[int]) -> None:
        nonlocal best
        part = build_partition(problem, cuts)
        memory = problem.memory
        if part.stage_memory is not None and memory is not None \
                and not all(memory.fits(m) for m in part.stage_memory):
            return
        if best is None or part.bottleneck < best.bottleneck:
            best = part

    consider(_balanced_cuts(search.P, K))
    consider(equal_count_cuts(n, K))
    if best is None:
        assert mem_layers is not None
        consider(_walk_back(search, _INF, mem_layers))
    assert best is not None

    total = float(search.P[-1])
    lo = max(total / K, float(search.compute.max()))
    hi = best.bottleneck

    def attempt(B: float) -> bool:
        layers = _probe(search, B)
        if layers is None:
            return False
        consider(_walk_back(search, B, layers))
        return True

    if lo < hi and attempt(lo):
        hi = min(hi, best.bottleneck)
    for _ in range(400):
        if hi - lo <= 0.5 * rel_tol * hi:
            break
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        if attempt(mid):
            hi = min(mid, best.bottleneck)
        else:
            lo = mid

    # Least-communication tie-break among partitions no worse than the best found.
    b = best.bottleneck
    B_final = b + min(1e-12, 0.25 * rel_tol) * b
    layers = _probe(search, B_final)
    if layers is not None:
        cuts = _least_comm_cuts(search, B_final, layers)
        if cuts is not None and cuts != best.cuts:
            cand = build_partition(problem, cuts)
            c_new, c_old = comm_sum(problem, cuts), comm_sum(problem, best.cuts)
            eps = 1e-12 * (abs(c_old) + abs(c_new))
            if c_new < c_old - eps or (
                c_new <= c_old + eps and cand.bottleneck <= best.bottleneck
            ):
                best = cand
    return best
