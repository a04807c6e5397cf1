"""The partition problem: a chain of atoms cut into K contiguous pipeline stages, as one frozen
value, and the exact cost of a given cut set.

Cut atoms 0..n-1 (fixed topological order) at 0 = c_0 < ... < c_K = n into exactly K non-empty
stages. Stage time T(i, j) = sum(compute[i:j]) + cut_comm[i] + cut_comm[j] (cut_comm[0] and
cut_comm[n] count as 0); with a memory model, stage memory Mem(s, i, j) = sum(fixed[i:j]) +
inflight[s] * (sum(per_microbatch[i:j]) + at_cut[i]) must stay within the limit. The problem is
made once by partition_problem, which validates its inputs with errors that name the offending
entry; costs are computed exactly (math.fsum) from the cuts, and a stage fits the memory limit up
to a 1e-12 relative slack that absorbs prefix-sum rounding. passes.partition.solver searches this
problem; fxpipe.testing.partition_oracle enumerates it.
"""
from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TypeAlias

import numpy as np

from fxpipe.errors import PartitionError

__all__ = [
    "Partition",
    "PartitionProblem",
    "MemoryModel",
    "build_partition",
    "check_num_stages",
    "checked_vector",
    "comm_sum",
    "equal_count_cuts",
    "evaluate",
    "memory_error",
    "partition_problem",
    "stage_time",
]

# A stage fits the memory limit when Mem <= limit + slack, with slack this fraction of the
# problem's memory scale; it absorbs the rounding of prefix sums (bytes are exact below 2**53).
_MEM_RTOL = 1e-12

Vector: TypeAlias = Sequence[float] | np.ndarray
"""Per-atom, per-cut or per-stage numbers as callers hold them."""


@dataclass(frozen=True)
class MemoryModel:
    """What each stage holds, Mem(s, i, j) = sum(fixed[i:j]) + inflight[s] *
    (sum(per_microbatch[i:j]) + at_cut[i]), and the limit it must stay within."""

    fixed: tuple[float, ...]
    """Bytes per atom held however many micro-batches are in flight (parameters, gradients,
    optimizer state, and what a recomputing stage keeps once)."""
    per_microbatch: tuple[float, ...]
    """Bytes per atom held for each micro-batch in flight (activations saved for backward)."""
    at_cut: tuple[float, ...]
    """Bytes per cut position 0..n held for each micro-batch in flight by the stage starting
    there (its input, kept to recompute from); n + 1 entries."""
    inflight: tuple[float, ...]
    """Micro-batches each stage holds at its peak under the schedule; one per stage, > 0."""
    limit: float | None
    """Bytes a stage may hold; None: stage memory is measured, not bounded."""

    @cached_property
    def slack(self) -> float:
        """Bytes a stage may exceed the limit by: rounding of prefix sums, relative to the
        problem's memory scale."""
        n = len(self.fixed)
        fixed_total = float(np.cumsum(np.asarray(self.fixed))[-1])
        act_total = float(np.cumsum(np.asarray(self.per_microbatch))[-1])
        # the ends (the model's input and output) are left out of the scale
        interior = float(np.asarray(self.at_cut[1:n]).max()) if n > 1 else 0.0
        scale = fixed_total + float(np.asarray(self.inflight).max()) * (act_total + interior)
        return _MEM_RTOL * max(scale, self.limit or 0.0)

    def stage_bytes(self, s: int, i: int, j: int) -> float:
        """Mem(s, i, j), exact: what stage s holds when it runs atoms i..j-1."""
        act = math.fsum(itertools.chain(self.per_microbatch[i:j], (self.at_cut[i],)))
        return math.fsum(self.fixed[i:j]) + self.inflight[s] * act

    def fits(self, nbytes: float) -> bool:
        """Whether a stage holding nbytes is within the limit (up to the slack)."""
        return self.limit is None or nbytes <= self.limit + self.slack


@dataclass(frozen=True)
class PartitionProblem:
    """Atoms in topological order, their costs, and the number of stages to cut them into;
    made and validated once by partition_problem, then read unchanged by the solver, the exact
    costs (evaluate) and the brute-force oracle."""

    compute: tuple[float, ...]
    """Seconds per atom (its forward, backward and recomputation for one micro-batch)."""
    num_stages: int
    """K, the number of contiguous non-empty stages; 1 <= K <= n."""
    cut_comm: tuple[float, ...]
    """Seconds per cut position 0..n, paid by each of the two stages it separates (values
    forward, gradients backward); n + 1 entries, the ends (model input, output) 0."""
    memory: MemoryModel | None = None
    """The stages' memory and its limit; None: stages are costed in time only."""

    @property
    def num_atoms(self) -> int:
        """n, the number of atoms."""
        return len(self.compute)


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


def partition_problem(
    compute: Vector,
    num_stages: int,
    *,
    cut_comm: Vector | None = None,
    memory_limit: float | None = None,
    mem_fixed: Vector | None = None,
    mem_act: Vector | None = None,
    cut_mem: Vector | None = None,
    inflight: Vector | None = None,
) -> PartitionProblem:
    """The problem of cutting these atoms into num_stages stages, validated.

    compute: seconds per atom; cut_comm: seconds per cut position 0..n (default 0; the ends are
    taken as 0). A memory model is given by mem_fixed (MemoryModel.fixed) with, optionally,
    mem_act (per_microbatch, default 0), cut_mem (at_cut, default 0) and inflight (default 1
    per stage); memory_limit (bytes, or None or inf for none) needs one.

    Raises:
        PartitionError: an input of the wrong length, a negative or non-finite entry, fewer
            atoms than stages, or a memory limit without a memory model.
    """
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
            limit = float(memory_limit)
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
    memory = None
    if mem_fixed is not None:
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
        memory = MemoryModel(fixed=tuple(mf.tolist()), per_microbatch=tuple(ma.tolist()),
                             at_cut=tuple(cm.tolist()), inflight=tuple(f.tolist()), limit=limit)
    return PartitionProblem(compute=tuple(comp.tolist()), num_stages=K,
                            cut_comm=tuple(comm.tolist()), memory=memory)


# --------------------------------------------------------------------------------------------
# exact costs
# --------------------------------------------------------------------------------------------


def stage_time(problem: PartitionProblem, i: int, j: int) -> float:
    """T(i, j), exact: the time of a stage running atoms i..j-1."""
    comm = problem.cut_comm
    return math.fsum(itertools.chain(problem.compute[i:j], (comm[i], comm[j])))


def build_partition(problem: PartitionProblem, cuts: Sequence[int]) -> Partition:
    """The partition of these (valid) cuts with its exact costs."""
    cuts = tuple(int(c) for c in cuts)
    times = tuple(stage_time(problem, i, j) for i, j in zip(cuts, cuts[1:]))
    mem = None
    if problem.memory is not None:
        mem = tuple(problem.memory.stage_bytes(s, i, j)
                    for s, (i, j) in enumerate(zip(cuts, cuts[1:])))
    return Partition(cuts=cuts, bottleneck=max(times), stage_times=times, stage_memory=mem)


def comm_sum(problem: PartitionProblem, cuts: Sequence[int]) -> float:
    """The communication of the interior cuts, exact (the tie-break among equal bottlenecks)."""
    return math.fsum(problem.cut_comm[c] for c in cuts[1:-1])


def equal_count_cuts(n: int, num_stages: int) -> tuple[int, ...]:
    """Cuts giving every stage floor(n/K) or ceil(n/K) atoms (the baseline partition)."""
    K = check_num_stages(int(n), num_stages)
    return tuple((s * int(n)) // K for s in range(K + 1))


def memory_error(num_stages: int, limit: float, minimum: float | None) -> PartitionError:
    """The error for a limit below the least memory any num_stages-stage partition needs
    (None: not computed, for a caller that only asks whether one fits)."""
    if minimum is None:
        return PartitionError(
            f"no {num_stages}-stage partition fits the memory limit ({limit:.0f} bytes)",
            hint="raise the memory limit, use more stages, or keep less per micro-batch in "
            "flight (fewer micro-batches, activation recomputation)")
    least = math.ceil(minimum)  # whole bytes, rounded up: the hint's value is always enough
    return PartitionError(
        f"no {num_stages}-stage partition fits the memory limit "
        f"(limit {limit:.0f} < minimum {least} bytes)",
        hint=f"raise the memory limit to at least {least} bytes, use more stages, or keep less "
        "per micro-batch in flight (fewer micro-batches, activation recomputation)",
    )


def evaluate(problem: PartitionProblem, cuts: Sequence[int]) -> Partition:
    """The exact cost of a given partition of the problem; raises PartitionError when a stage
    exceeds the memory limit (a problem without a limit is only measured)."""
    cuts_t = tuple(cuts)
    for c in cuts_t:
        if isinstance(c, bool) or not isinstance(c, numbers.Integral):
            raise PartitionError(
                f"cut positions must be integers (got {c!r})", hint="pass integer cut positions"
            )
    n, K = problem.num_atoms, problem.num_stages
    if len(cuts_t) != K + 1:
        raise PartitionError(
            f"cuts have {len(cuts_t)} positions but {K} stages need {K + 1}",
            hint="pass K+1 positions 0 = c_0 < ... < c_K = n",
        )
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
    part = build_partition(problem, cuts_t)
    memory = problem.memory
    if memory is not None and memory.limit is not None and part.stage_memory is not None:
        for s, m in enumerate(part.stage_memory):
            if not memory.fits(m):
                m_s, l_s = _fmt_pair(m, memory.limit)
                raise PartitionError(
                    f"stage {s} needs more memory than the limit ({m_s} > {l_s} bytes)",
                    hint="move cuts to shrink that stage, or raise the memory limit",
                )
    return part
