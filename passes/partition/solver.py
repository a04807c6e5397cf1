"""Exact bottleneck-optimal cutting of a chain of atoms into K contiguous pipeline stages.

Objective: among the K-stage cut sets of the problem in passes.partition_problem, minimise the
slowest stage time T(i, j), every stage within the memory limit when one is given; ties go to
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
(partition_problem.build_partition).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from fxpipe.errors import PartitionError
from fxpipe.passes.partition.problem import (
    MemoryEnds,
    Partition,
    Problem,
    build_partition,
    checked_vector,
    comm_sum,
    equal_count_cuts,
    fits,
    memory_error,
    prepare,
    stage_memory,
)

__all__ = ["solve_partition", "min_memory_limit"]

# Most cells the least-communication tie-break may build (sum over layers of |R_s| * |R_s+1|).
_TIE_BREAK_BUDGET = 4_000_000
# Most entries of the per-layer memory interval cache (n * K); above it ends are searched per probe.
_ECACHE_MAX = 20_000_000

_INF = math.inf


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


def _windows(prob: Problem, B: float, L: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Per layer s, the positions [a_s, b_s] that cut c_s can take with all T <= B (B may be inf)
    and all Mem <= L (None: no limit): stage times are at least their compute, stage memories at
    least sum(mem_fixed + min_inflight * mem_act) over their atoms."""
    n, K = prob.n, prob.K
    s = np.arange(K + 1)
    a = s.copy()
    b = n - K + s
    if not math.isinf(B):
        P = prob.P
        slack = 1e-9 * (float(P[-1]) + K * B)
        with np.errstate(over="ignore", invalid="ignore"):
            # P[c_s] <= s*B and P[n] - P[c_s] <= (K - s)*B
            up = np.searchsorted(P, s * B + slack, side="right") - 1
            low = np.searchsorted(P, P[-1] - (K - s) * B - slack, side="left")
        a = np.maximum(a, low)
        b = np.minimum(b, up)
    if L is not None and not math.isinf(L):
        assert prob.Fp is not None and prob.Ap is not None and prob.f is not None
        Fp, Ap = prob.Fp, prob.Ap
        fwd = np.concatenate(([prob.f[0]], np.minimum.accumulate(prob.f)))  # min f over t < s
        bwd = np.concatenate((np.minimum.accumulate(prob.f[::-1])[::-1], [prob.f[-1]]))  # t >= s
        slack = 1e-9 * (float(Fp[-1]) + float(prob.f.max()) * float(Ap[-1]) + K * L)
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


def _memory_ends(prob: Problem, s: int) -> tuple[int, np.ndarray]:
    """For layer s, e_i = the last j with Mem(s, i, j) <= limit (prefix arithmetic, as in the
    probe) for every i of the memory-only window of layer s; independent of B, so cached."""
    cache = prob.ecache
    assert cache is not None
    hit = cache.layers.get(s)
    if hit is not None:
        return hit
    assert prob.Fp is not None and prob.Ap is not None
    assert prob.cm is not None and prob.f is not None
    if cache.windows is None:
        cache.windows = _windows(prob, _INF, prob.limit)
    wa, wb = cache.windows
    lo, top = int(wa[s]), int(wb[s + 1])
    hi = min(int(wb[s]), top)
    fs = prob.f[s]
    Q = prob.Fp[lo : top + 1] + fs * prob.Ap[lo : top + 1]
    lim = (prob.lim_eff + Q[: hi - lo + 1]) - fs * prob.cm[lo : hi + 1]
    e = (lo - 1 + np.searchsorted(Q, lim, side="right")).astype(np.int64)
    cache.layers[s] = (lo, e)
    return lo, e


def _probe(prob: Problem, B: float) -> _Layers | None:
    """Layers (a_s, reached mask over [a_s, ...]) if a K-stage partition with all T <= B and all
    Mem <= limit exists, else None.  B = inf checks memory only."""
    n, K = prob.n, prob.K
    P, g, cP = prob.P, prob.g, prob.cP
    time_free = math.isinf(B)
    use_mem = prob.limit is not None
    wa, wb = _windows(prob, B, prob.limit)
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
        if use_mem:
            assert prob.Fp is not None and prob.Ap is not None
            assert prob.cm is not None and prob.f is not None
            starts = first + np.flatnonzero(seg)
            if not time_free:  # starts whose g exceeds every h of the next window reach nothing
                starts = starts[g[starts] <= (B - cP[a2 : b2 + 1]).max()]
            if prob.ecache is not None:
                start, E = _memory_ends(prob, s)
                e = E[starts - start]
            else:
                fs = prob.f[s]
                Q = prob.Fp[first : b2 + 1] + fs * prob.Ap[first : b2 + 1]
                lim = (prob.lim_eff + Q[starts - first]) - fs * prob.cm[starts]
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
    prob: Problem, B: float, s: int, cand: np.ndarray, j: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Which candidate starts i (of layer s) may precede cut j, with the probe's arithmetic; also
    the prefix-sum stage memory when a limit is enforced."""
    ok = prob.g[cand] <= B - prob.cP[j]
    mem = None
    if prob.limit is not None:
        assert prob.Fp is not None and prob.Ap is not None
        assert prob.cm is not None and prob.f is not None
        fs = prob.f[s]
        Qj = prob.Fp[j] + fs * prob.Ap[j]
        Qi = prob.Fp[cand] + fs * prob.Ap[cand]
        ok &= Qj <= (prob.lim_eff + Qi) - fs * prob.cm[cand]
        mem = (Qj - Qi) + fs * prob.cm[cand]
    return ok, mem


def _walk_back(prob: Problem, B: float, layers: _Layers, *,
               by_memory: bool = False) -> tuple[int, ...]:
    """Concrete cuts through the probe's layers: from n backwards, each step takes the admissible
    start with the shortest stage (or the smallest stage memory)."""
    j = prob.n
    cuts = [j]
    for s in range(prob.K - 1, -1, -1):
        a, r = layers[s]
        top = min(j - 1, a + r.shape[0] - 1)
        cand = a + np.flatnonzero(r[: top - a + 1])
        ok, mem = _valid_from(prob, B, s, cand, j)
        if by_memory and mem is not None:
            key = mem[ok]
        else:
            key = prob.g[cand[ok]]
        cand = cand[ok]
        if cand.size == 0:  # pragma: no cover - the probe guarantees a predecessor
            raise AssertionError("partition walk-back found no predecessor")
        j = int(cand[int(np.argmin(key))])
        cuts.append(j)
    return tuple(reversed(cuts))


def _least_comm_cuts(prob: Problem, B: float, layers: _Layers) -> tuple[int, ...] | None:
    """Among the partitions the layers encode (all T <= B, Mem <= limit), one with the least
    interior cut_comm (ties: shortest stage walking back); None when the layers are too wide."""
    K = prob.K
    pos = [a + np.flatnonzero(r) for a, r in layers]
    if sum(len(pos[s]) * len(pos[s + 1]) for s in range(K)) > _TIE_BREAK_BUDGET:
        return None
    g, cP = prob.g, prob.cP
    costs = [np.zeros(1)]
    mats = []
    for s in range(K):
        starts, J = pos[s], pos[s + 1]
        V = (starts[:, None] < J[None, :]) & (g[starts][:, None] <= (B - cP[J])[None, :])
        if prob.limit is not None:
            assert prob.Fp is not None and prob.Ap is not None
            assert prob.cm is not None and prob.f is not None
            fs = prob.f[s]
            QI = prob.Fp[starts] + fs * prob.Ap[starts]
            QJ = prob.Fp[J] + fs * prob.Ap[J]
            V &= QJ[None, :] <= ((prob.lim_eff + QI) - fs * prob.cm[starts])[:, None]
        cost = np.where(V, costs[-1][:, None], _INF).min(axis=0) + prob.comm[J]
        mats.append(V)
        costs.append(cost)
    if not np.isfinite(costs[K][0]):  # pragma: no cover - the probe reached n
        return None
    y = 0
    cuts = [prob.n]
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


def _min_memory(prob: Problem) -> float:
    """Smallest limit admitting a K-stage partition (memory only); prob.limit is ignored."""
    assert prob.has_mem and prob.Fp is not None and prob.Ap is not None and prob.f is not None
    n, K = prob.n, prob.K
    probe_prob = Problem(**{**prob.__dict__})
    probe_prob.compute = np.zeros(n)
    probe_prob.ecache = None

    def max_mem(cuts: Sequence[int]) -> float:
        return max(stage_memory(prob, s, i, j) for s, (i, j) in enumerate(zip(cuts, cuts[1:])))

    if K == 1 or K == n:
        return max_mem(tuple(range(n + 1)) if K == n else (0, n))
    mf = np.diff(prob.Fp)
    ma = np.diff(prob.Ap)
    fmin = float(prob.f.min())
    lo = max(float((mf + fmin * ma).max()), (float(prob.Fp[-1]) + fmin * float(prob.Ap[-1])) / K)
    weights = np.concatenate(([0.0], np.cumsum(mf + float(prob.f.mean()) * ma)))
    best = min(max_mem(c) for c in (equal_count_cuts(n, K), _balanced_cuts(weights, K)))
    hi = best
    rtol = 1e-11
    for _ in range(200):
        if hi - lo <= rtol * hi:
            break
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        probe_prob.limit = mid
        probe_prob.lim_eff = mid + prob.mem_slack
        layers = _probe(probe_prob, _INF)
        if layers is None:
            lo = mid
        else:
            m = max_mem(_walk_back(probe_prob, _INF, layers, by_memory=True))
            best = min(best, m)
            hi = min(mid, best)
    return best


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def min_memory_limit(
    num_stages: int,
    *,
    mem_fixed: Sequence[float] | np.ndarray,
    mem_act: Sequence[float] | np.ndarray | None = None,
    cut_mem: Sequence[float] | np.ndarray | None = None,
    inflight: Sequence[float] | np.ndarray | None = None,
) -> float:
    """The smallest memory_limit for which some num_stages-stage partition fits (time ignored).

    The value is the exact peak stage memory of a partition found by bisection (relative
    precision 1e-11), so a solve with exactly this limit is feasible.
    """
    if mem_fixed is None:
        raise PartitionError("min_memory_limit needs mem_fixed", hint="pass mem_fixed")
    mf = checked_vector("mem_fixed", mem_fixed, None, "")
    prob = prepare(mf, num_stages, None, None, mf, mem_act, cut_mem, inflight)
    return _min_memory(prob)


def solve_partition(
    compute: Sequence[float] | np.ndarray,
    num_stages: int,
    *,
    cut_comm: Sequence[float] | np.ndarray | None = None,
    memory_limit: float | None = None,
    mem_fixed: Sequence[float] | np.ndarray | None = None,
    mem_act: Sequence[float] | np.ndarray | None = None,
    cut_mem: Sequence[float] | np.ndarray | None = None,
    inflight: Sequence[float] | np.ndarray | None = None,
    rel_tol: float = 1e-9,
) -> Partition:
    """The K-stage partition minimising the bottleneck stage time within rel_tol (relative),
    subject to the memory limit; among such partitions, the least interior communication."""
    rel_tol = float(rel_tol)
    if not rel_tol >= 0 or math.isinf(rel_tol):
        raise PartitionError(
            f"rel_tol must be a finite non-negative number (got {rel_tol!r})",
            hint="use e.g. 1e-9",
        )
    prob = prepare(
        compute, num_stages, cut_comm, memory_limit, mem_fixed, mem_act, cut_mem, inflight
    )
    n, K = prob.n, prob.K
    if prob.limit is not None and n * K <= _ECACHE_MAX:
        prob.ecache = MemoryEnds()

    mem_layers = None
    if prob.limit is not None:
        mem_layers = _probe(prob, _INF)
        if mem_layers is None:
            raise memory_error(prob, _min_memory(prob))
    if K == 1 or K == n:
        return build_partition(prob, (0, n) if K == 1 else tuple(range(n + 1)))

    best: Partition | None = None

    def consider(cuts: Sequence[int]) -> None:
        nonlocal best
        part = build_partition(prob, cuts)
        if part.stage_memory is not None and not all(fits(prob, m) for m in part.stage_memory):
            return
        if best is None or part.bottleneck < best.bottleneck:
            best = part

    consider(_balanced_cuts(prob.P, K))
    consider(equal_count_cuts(n, K))
    if best is None:
        assert mem_layers is not None
        consider(_walk_back(prob, _INF, mem_layers))
    assert best is not None

    total = float(prob.P[-1])
    lo = max(total / K, float(prob.compute.max()))
    hi = best.bottleneck

    def attempt(B: float) -> bool:
        layers = _probe(prob, B)
        if layers is None:
            return False
        consider(_walk_back(prob, B, layers))
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
    layers = _probe(prob, B_final)
    if layers is not None:
        cuts = _least_comm_cuts(prob, B_final, layers)
        if cuts is not None and cuts != best.cuts:
            cand = build_partition(prob, cuts)
            c_new, c_old = comm_sum(prob, cuts), comm_sum(prob, best.cuts)
            eps = 1e-12 * (abs(c_old) + abs(c_new))
            if c_new < c_old - eps or (
                c_new <= c_old + eps and cand.bottleneck <= best.bottleneck
            ):
                best = cand
    return best
