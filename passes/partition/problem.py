"""The partition problem: a chain of atoms cut into K contiguous pipeline stages, and the exact
cost of a given cut set.

Cut atoms 0..n-1 (fixed topological order) at 0 = c_0 < ... < c_K = n into exactly K non-empty
stages. Stage time T(i, j) = sum(compute[i:j]) + cut_comm[i] + cut_comm[j] (cut_comm[0] and
cut_comm[n] count as 0); with a memory model, stage memory Mem(s, i, j) = sum(mem_fixed[i:j]) +
inflight[s] * (sum(mem_act[i:j]) + cut_mem[i]) must stay within the limit. Inputs are validated
here with errors that name the offending entry; costs are computed exactly (math.fsum) from the
cuts, and a stage fits the memory limit up to a 1e-12 relative slack that absorbs prefix-sum
rounding. passes.partition_solver searches this problem; passes.partition_oracle enumerates it.
"""
from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fxpipe.errors import PartitionError

__all__ = [
    "MemoryEnds",
    "Partition",
    "Problem",
    "build_partition",
    "check_num_stages",
    "checked_vector",
    "comm_sum",
    "equal_count_cuts",
    "evaluate",
    "fits",
    "memory_error",
    "prepare",
    "stage_memory",
    "stage_time",
]

# A stage fits the memory limit when Mem <= limit + slack, with slack this fraction of the
# problem's memory scale; it absorbs the rounding of prefix sums (bytes are exact below 2**53).
_MEM_RTOL = 1e-12


@dataclass(frozen=True)
class Partition:
    """K contiguous stages: the cut positions and their exact costs."""

    cuts: tuple[int, ...]
    """K+1 positions, ``cuts[0] == 0``, ``cuts[-1] == n``; stage s is ``[cuts[s], cuts[s+1])``."""
    bottleneck: float
    """The largest stage time, computed exactly from the cuts."""
    stage_times: tuple[float, ...]
    """``T(cuts[s], cuts[s+1])`` for each stage s."""
    stage_memory: tuple[float, ...] | None
    """``Mem(s, cuts[s], cuts[s+1])`` per stage when a memory model was given, else None."""

    def sizes(self) -> list[int]:
        """Number of atoms in each stage."""
        return [b - a for a, b in zip(self.cuts, self.cuts[1:])]

    @property
    def num_stages(self) -> int:
        return len(self.cuts) - 1


# --------------------------------------------------------------------------------------------
# validation and problem set-up
# --------------------------------------------------------------------------------------------


def _fmt(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}g}"


def _fmt_pair(x: float, y: float) -> tuple[str, str]:
    """Format two numbers with the fewest digits (at least 4) that tell them apart."""
    for digits in range(4, 18):
        a, b = _fmt(x, digits), _fmt(y, digits)
        if a != b:
            return a, b
    return _fmt(x, 17), _fmt(y, 17)


def check_num_stages(n: int, num_stages: object) -> int:
    if isinstance(num_stages, bool) or not isinstance(num_stages, numbers.Integral):
        raise PartitionError(
            f"num_stages must be an integer (got {num_stages!r})",
            hint="pass the number of pipeline stages as an int",
        )
    k = int(num_stages)
    if k < 1:
        raise PartitionError(
            f"num_stages must be at least 1 (got {k})", hint="use 1 or more pipeline stages"
        )
    if n == 0:
        raise PartitionError(
            f"cannot split 0 atoms into {k} stages: the model has no atoms",
            hint="check that the model graph was captured and costed",
        )
    if k > n:
        raise PartitionError(
            f"cannot split {n} atoms into {k} stages: more stages than atoms ({k} > {n})",
            hint=f"use at most {n} stages (the maximum number of stages: one atom per stage), "
            "or cut the model into finer atoms",
        )
    return k


def checked_vector(
    name: str, values: object, length: int | None, why: str, *, positive: bool = False
) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise PartitionError(
            f"{name} must be a sequence of numbers ({exc})", hint=f"pass {name} as a list of floats"
        ) from None
    if arr.ndim != 1:
        raise PartitionError(
            f"{name} must be one-dimensional (got shape {arr.shape})",
            hint=f"pass {name} as a flat list of floats",
        )
    if length is not None and arr.shape[0] != length:
        raise PartitionError(
            f"{name} has {arr.shape[0]} entries but needs {length} ({why}; "
            f"{arr.shape[0]} != {length})",
            hint=f"give {name} exactly {length} entries",
        )
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        i = int(bad[0])
        kind = "NaN" if math.isnan(arr[i]) else "infinite"
        raise PartitionError(
            f"{name}[{i}] is {kind} ({arr[i]!r})",
            hint=f"every {name} entry must be a finite number",
        )
    bad = np.flatnonzero(arr <= 0) if positive else np.flatnonzero(arr < 0)
    if bad.size:
        i = int(bad[0])
        word = "not positive" if positive else "negative"
        need = "> 0" if positive else ">= 0"
        raise PartitionError(
            f"{name}[{i}] is {word} ({float(arr[i])!r})",
            hint=f"every {name} entry must be {need}",
        )
    return arr


@dataclass
class MemoryEnds:
    """The solver's cache of per-layer memory interval ends (independent of the bottleneck)."""

    windows: tuple[np.ndarray, np.ndarray] | None = None  # memory-only windows [a_s, b_s]
    layers: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)  # s -> (lo, e)


@dataclass
class Problem:
    n: int
    K: int
    compute: np.ndarray
    comm: np.ndarray  # n+1, ends zeroed
    P: np.ndarray  # prefix sums of compute, n+1
    g: np.ndarray  # comm - P
    cP: np.ndarray  # comm + P
    has_mem: bool
    limit: float | None  # finite limit to enforce, or None
    Fp: np.ndarray | None
    Ap: np.ndarray | None
    cm: np.ndarray | None
    f: np.ndarray | None
    mem_slack: float
    lim_eff: float
    # plain lists for the exact (fsum) evaluation
    compute_l: list[float]
    comm_l: list[float]
    mf_l: list[float] | None
    ma_l: list[float] | None
    cm_l: list[float] | None
    f_l: list[float] | None
    # per-layer memory interval ends, filled lazily by the probe when set to a MemoryEnds
    ecache: MemoryEnds | None = None


def prepare(
    compute: object,
    num_stages: object,
    cut_comm: object,
    memory_limit: object,
    mem_fixed: object,
    mem_act: object,
    cut_mem: object,
    inflight: object,
) -> Problem:
    comp = checked_vector("compute", compute, None, "")
    n = int(comp.shape[0])
    K = check_num_stages(n, num_stages)
    if cut_comm is None:
        comm = np.zeros(n + 1)
    else:
        comm = checked_vector(
            "cut_comm", cut_comm, n + 1, f"one per cut position 0..{n} for n = {n} atoms"
        ).copy()
    comm[0] = 0.0
    comm[n] = 0.0

    limit: float | None = None
    if memory_limit is not None:
        try:
            limit = float(memory_limit)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise PartitionError(
                f"memory_limit must be a number (got {memory_limit!r})",
                hint="pass the per-stage memory limit in bytes, or None",
            ) from None
        if math.isnan(limit) or limit < 0:
            raise PartitionError(
                f"memory_limit must be a non-negative number (got {limit!r})",
                hint="pass the per-stage memory limit in bytes, or None for no limit",
            )
        if mem_fixed is None:
            raise PartitionError(
                f"memory_limit is given ({_fmt(limit)}) but mem_fixed is not",
                hint="pass mem_fixed (and mem_act, cut_mem, inflight) to describe stage memory",
            )
        if math.isinf(limit):
            limit = None
    if mem_fixed is None:
        for name, val in (("mem_act", mem_act), ("cut_mem", cut_mem), ("inflight", inflight)):
            if val is not None:
                raise PartitionError(
                    f"{name} is given but mem_fixed is not",
                    hint="the memory model needs mem_fixed (use zeros if nothing is fixed)",
                )
    has_mem = mem_fixed is not None
    Fp = Ap = cm = f = None
    mf_l = ma_l = cm_l = f_l = None
    slack = 0.0
    if has_mem:
        mf = checked_vector("mem_fixed", mem_fixed, n, f"one per atom, like compute with {n} atoms")
        ma = (
            np.zeros(n)
            if mem_act is None
            else checked_vector("mem_act", mem_act, n,
                                f"one per atom, like compute with {n} atoms")
        )
        cm = (
            np.zeros(n + 1)
            if cut_mem is None
            else checked_vector("cut_mem", cut_mem, n + 1,
                                f"one per cut position 0..{n} for {n} atoms")
        )
        f = (
            np.ones(K)
            if inflight is None
            else checked_vector("inflight", inflight, K, f"one per stage, {K} stages",
                                positive=True)
        )
        Fp = np.concatenate(([0.0], np.cumsum(mf)))
        Ap = np.concatenate(([0.0], np.cumsum(ma)))
        # cut_mem[0] and cut_mem[n] are paid by no stage: they must not widen the slack
        interior = float(cm[1:n].max()) if n > 1 else 0.0
        scale = float(Fp[-1]) + float(f.max()) * (float(Ap[-1]) + interior)
        slack = _MEM_RTOL * max(scale, limit or 0.0)
        mf_l, ma_l, cm_l, f_l = mf.tolist(), ma.tolist(), cm.tolist(), f.tolist()
    P = np.concatenate(([0.0], np.cumsum(comp)))
    return Problem(
        n=n,
        K=K,
        compute=comp,
        comm=comm,
        P=P,
        g=comm - P,
        cP=comm + P,
        has_mem=has_mem,
        limit=limit,
        Fp=Fp,
        Ap=Ap,
        cm=cm,
        f=f,
        mem_slack=slack,
        lim_eff=(limit + slack) if limit is not None else math.inf,
        compute_l=comp.tolist(),
        comm_l=comm.tolist(),
        mf_l=mf_l,
        ma_l=ma_l,
        cm_l=cm_l,
        f_l=f_l,
    )


# --------------------------------------------------------------------------------------------
# exact costs
# --------------------------------------------------------------------------------------------


def stage_time(prob: Problem, i: int, j: int) -> float:
    return math.fsum(itertools.chain(prob.compute_l[i:j], (prob.comm_l[i], prob.comm_l[j])))


def stage_memory(prob: Problem, s: int, i: int, j: int) -> float:
    assert prob.mf_l is not None and prob.ma_l is not None
    assert prob.cm_l is not None and prob.f_l is not None
    act = math.fsum(itertools.chain(prob.ma_l[i:j], (prob.cm_l[i],)))
    return math.fsum(prob.mf_l[i:j]) + prob.f_l[s] * act


def fits(prob: Problem, mem: float) -> bool:
    return prob.limit is None or mem <= prob.lim_eff


def build_partition(prob: Problem, cuts: Sequence[int]) -> Partition:
    cuts = tuple(int(c) for c in cuts)
    times = tuple(stage_time(prob, i, j) for i, j in zip(cuts, cuts[1:]))
    mem = None
    if prob.has_mem:
        mem = tuple(stage_memory(prob, s, i, j) for s, (i, j) in enumerate(zip(cuts, cuts[1:])))
    return Partition(cuts=cuts, bottleneck=max(times), stage_times=times, stage_memory=mem)


def comm_sum(prob: Problem, cuts: Sequence[int]) -> float:
    return math.fsum(prob.comm_l[c] for c in cuts[1:-1])


def equal_count_cuts(n: int, num_stages: int) -> tuple[int, ...]:
    """Cuts giving every stage floor(n/K) or ceil(n/K) atoms (the baseline partition)."""
    K = check_num_stages(int(n), num_stages)
    return tuple((s * int(n)) // K for s in range(K + 1))


def memory_error(prob: Problem, minimum: float) -> PartitionError:
    limit = prob.limit if prob.limit is not None else 0.0
    least = math.ceil(minimum)  # whole bytes, rounded up: the hint's value is always enough
    return PartitionError(
        f"no {prob.K}-stage partition fits the memory limit "
        f"(limit {limit:.0f} < minimum {least} bytes)",
        hint=f"raise the memory limit to at least {least} bytes, use more stages, or keep less "
        "per micro-batch in flight (fewer micro-batches, activation recomputation)",
    )


def evaluate(
    cuts: Sequence[int],
    compute: Sequence[float] | np.ndarray,
    *,
    cut_comm: Sequence[float] | np.ndarray | None = None,
    memory_limit: float | None = None,
    mem_fixed: Sequence[float] | np.ndarray | None = None,
    mem_act: Sequence[float] | np.ndarray | None = None,
    cut_mem: Sequence[float] | np.ndarray | None = None,
    inflight: Sequence[float] | np.ndarray | None = None,
) -> Partition:
    """The exact cost of a given partition; raises PartitionError when a stage exceeds
    memory_limit (pass no limit to just measure)."""
    cuts_t = tuple(cuts)
    if len(cuts_t) < 2:
        raise PartitionError(
            f"cuts must have at least 2 positions (got {len(cuts_t)})",
            hint="pass K+1 positions 0 = c_0 < ... < c_K = n",
        )
    for c in cuts_t:
        if isinstance(c, bool) or not isinstance(c, numbers.Integral):
            raise PartitionError(
                f"cut positions must be integers (got {c!r})", hint="pass integer cut positions"
            )
    prob = prepare(
        compute, len(cuts_t) - 1, cut_comm, memory_limit, mem_fixed, mem_act, cut_mem, inflight
    )
    n = prob.n
    if cuts_t[0] != 0 or cuts_t[-1] != n:
        raise PartitionError(
            f"cuts must start at 0 and end at n = {n} (got {cuts_t[0]} and {cuts_t[-1]})",
            hint="the first cut is the model's input (0), the last its output (n)",
        )
    for s, (i, j) in enumerate(zip(cuts_t, cuts_t[1:])):
        if j <= i:
            raise PartitionError(
                f"stage {s} is empty or reversed (cuts[{s}] = {i} >= cuts[{s + 1}] = {j})",
                hint="cut positions must be strictly increasing",
            )
    part = build_partition(prob, cuts_t)
    if prob.limit is not None and part.stage_memory is not None:
        for s, m in enumerate(part.stage_memory):
            if not fits(prob, m):
                m_s, l_s = _fmt_pair(m, prob.limit)
                raise PartitionError(
                    f"stage {s} needs more memory than the limit ({m_s} > {l_s} bytes)",
                    hint="move cuts to shrink that stage, or raise the memory limit",
                )
    return part
