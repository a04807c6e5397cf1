"""Tests of the exact bottleneck partition solver (passes/partition/solver.py)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.errors import PartitionError
from fxpipe.passes.partition.problem import (
    Partition,
    equal_count_cuts,
    evaluate,
    partition_problem,
)
from fxpipe.passes.partition.solver import min_memory_limit, solve_partition
from fxpipe.testing.partition_oracle import benchmark, brute_force_partition

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

values = st.one_of(
    st.integers(0, 6).map(float),
    st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False, allow_subnormal=False),
)


@st.composite
def instances(draw, max_n: int = 12, max_k: int = 5, with_comm: bool = True):
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(1, min(n, max_k)))
    compute = draw(st.lists(values, min_size=n, max_size=n))
    comm = draw(st.lists(values, min_size=n + 1, max_size=n + 1)) if with_comm else None
    return compute, k, comm


@st.composite
def memory_models(draw, n: int, k: int):
    mem_fixed = draw(st.lists(values, min_size=n, max_size=n))
    mem_act = draw(st.lists(values, min_size=n, max_size=n))
    cut_mem = draw(st.lists(values, min_size=n + 1, max_size=n + 1))
    kind = draw(st.sampled_from(["gpipe", "1f1b", "random"]))
    micro = draw(st.integers(1, 8))
    if kind == "gpipe":
        inflight = [float(micro)] * k
    elif kind == "1f1b":
        inflight = [float(min(k - s, micro)) for s in range(k)]
    else:
        inflight = draw(
            st.lists(st.floats(0.25, 8.0, allow_subnormal=False), min_size=k, max_size=k)
        )
    return dict(mem_fixed=mem_fixed, mem_act=mem_act, cut_mem=cut_mem, inflight=inflight)


def brute_min_memory(k: int, mem: dict) -> float:
    n = len(mem["mem_fixed"])
    best = float("inf")
    for inner in itertools.combinations(range(1, n), k - 1):
        part = evaluate(partition_problem([0.0] * n, k, **mem), (0, *inner, n))
        assert part.stage_memory is not None
        best = min(best, max(part.stage_memory))
    return best


def check_shape(p: Partition, n: int, k: int) -> None:
    assert len(p.cuts) == k + 1
    assert p.cuts[0] == 0 and p.cuts[-1] == n
    assert all(a < b for a, b in zip(p.cuts, p.cuts[1:]))
    assert len(p.sizes()) == k and sum(p.sizes()) == n and min(p.sizes()) >= 1
    assert len(p.stage_times) == k
    assert p.bottleneck == max(p.stage_times)


def reference_dp(compute, k, cut_comm, limit=None, mem=None) -> float:
    """O(K n^2) min-max dynamic program, independent of the solver."""
    n = len(compute)
    c = np.asarray(cut_comm, dtype=float).copy()
    c[0] = c[n] = 0.0
    P = np.concatenate(([0.0], np.cumsum(compute)))
    T = P[None, :] - P[:, None] + c[:, None] + c[None, :]
    T[np.tril_indices(n + 1)] = np.inf
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    for s in range(k):
        M = T.copy()
        if limit is not None:
            F = np.concatenate(([0.0], np.cumsum(mem["mem_fixed"])))
            A = np.concatenate(([0.0], np.cumsum(mem["mem_act"])))
            cm = np.asarray(mem["cut_mem"], dtype=float)
            f = mem["inflight"][s]
            mem_s = F[None, :] - F[:, None] + f * (A[None, :] - A[:, None] + cm[:, None])
            M[mem_s > limit * (1 + 1e-12)] = np.inf
        best = np.maximum(best[:, None], M).min(axis=0)
    return float(best[n])


# --------------------------------------------------------------------------------------------
# literal cases
# --------------------------------------------------------------------------------------------


def test_two_stages_of_one_to_six_split_four_and_two():
    p = solve_partition(partition_problem([1, 2, 3, 4, 5, 6], 2))
    assert p.sizes() == [4, 2]
    assert p.cuts == (0, 4, 6)
    assert p.bottleneck == 11.0
    assert p.stage_times == (10.0, 11.0)
    assert p.stage_memory is None


def test_a_single_stage_holds_every_atom():
    p = solve_partition(partition_problem([3.0, 1.0, 2.0], 1, cut_comm=[9.0, 5.0, 5.0, 9.0]))
    assert p.cuts == (0, 3)
    assert p.bottleneck == 6.0  # the model's own ends pay no communication


def test_as_many_stages_as_atoms_puts_one_atom_per_stage():
    p = solve_partition(
        partition_problem([1.0, 5.0, 2.0, 7.0], 4, cut_comm=[0.0, 1.0, 1.0, 1.0, 0.0]))
    assert p.sizes() == [1, 1, 1, 1]
    assert p.stage_times == (2.0, 7.0, 4.0, 8.0)
    assert p.bottleneck == 8.0


def test_communication_moves_the_optimal_cut_to_the_cheap_position():
    compute = [2.0, 2.0, 2.0, 2.0]
    assert solve_partition(partition_problem(compute, 2)).cuts == (0, 2, 4)
    # cutting in the middle is expensive (10); the neighbouring cut is cheap (0.5)
    p = solve_partition(partition_problem(compute, 2, cut_comm=[0.0, 5.0, 10.0, 0.5, 0.0]))
    assert p.cuts == (0, 3, 4)
    assert p.bottleneck == pytest.approx(6.5)
    assert p.stage_times == pytest.approx((6.5, 2.5))


def test_the_ends_of_cut_comm_are_ignored():
    a = solve_partition(partition_problem([1.0, 2.0, 3.0], 2, cut_comm=[100.0, 0.0, 0.0, 100.0]))
    b = solve_partition(partition_problem([1.0, 2.0, 3.0], 2))
    assert a == b


def test_equal_bottlenecks_prefer_less_communication():
    # stage 0 = atom 0 (time 9) is the bottleneck either way; cut 3 is cheaper than cut 2
    compute = [9.0, 1.0, 1.0, 1.0]
    comm = [0.0, 0.0, 0.7, 0.3, 0.0]
    p = solve_partition(partition_problem(compute, 3, cut_comm=comm))
    assert p.bottleneck == 9.0
    assert p.cuts == (0, 1, 3, 4)
    assert brute_force_partition(partition_problem(compute, 3, cut_comm=comm)).cuts == (0, 1, 3, 4)


def test_the_memory_limit_forces_a_worse_bottleneck_and_1f1b_differs_from_gpipe():
    compute = [1.0] * 12
    mem = dict(mem_fixed=[0.0] * 12, mem_act=[0.0] * 8 + [1.0] * 4, cut_mem=[0.0] * 13)
    free = solve_partition(partition_problem(compute, 3))
    assert free.cuts == (0, 4, 8, 12) and free.bottleneck == 4.0

    # GPipe with 3 micro-batches: every stage keeps 3 in flight, so the last stage may hold at
    # most 3 of the activation-heavy atoms
    gpipe_problem = partition_problem(compute, 3, memory_limit=9.0, inflight=[3, 3, 3], **mem)
    gpipe = solve_partition(gpipe_problem)
    assert gpipe.bottleneck == 5.0
    assert gpipe.stage_memory is not None and max(gpipe.stage_memory) <= 9.0
    assert gpipe.bottleneck == brute_force_partition(gpipe_problem).bottleneck

    # 1F1B: stage s keeps min(K - s, M) in flight, the last stage only 1
    one_f_one_b = solve_partition(
        partition_problem(compute, 3, memory_limit=9.0, inflight=[3, 2, 1], **mem))
    assert one_f_one_b.cuts == (0, 4, 8, 12) and one_f_one_b.bottleneck == 4.0
    assert one_f_one_b.stage_memory == (0.0, 0.0, 4.0)


def test_stage_memory_follows_the_formula():
    problem = partition_problem(
        [1.0, 1.0, 1.0],
        2,
        mem_fixed=[10.0, 20.0, 30.0],
        mem_act=[1.0, 2.0, 3.0],
        cut_mem=[0.5, 7.0, 4.0, 9.0],
        inflight=[4, 2],
    )
    p = evaluate(problem, (0, 2, 3))
    assert p.stage_memory == (10 + 20 + 4 * (1 + 2 + 0.5), 30 + 2 * (3 + 4.0))


def test_equal_count_cuts_are_as_even_as_possible():
    assert equal_count_cuts(10, 3) == (0, 3, 6, 10)
    assert equal_count_cuts(4, 4) == (0, 1, 2, 3, 4)
    assert equal_count_cuts(7, 1) == (0, 7)
    sizes = np.diff(equal_count_cuts(1001, 64))
    assert sizes.min() >= 1001 // 64 and sizes.max() <= 1001 // 64 + 1


def test_the_solver_matches_an_independent_dynamic_program_on_larger_instances():
    rng = np.random.default_rng(7)
    for trial in range(12):
        n = int(rng.integers(20, 90))
        k = int(rng.integers(2, 9))
        compute = rng.random(n) if trial % 2 else rng.integers(0, 4, n).astype(float)
        comm = 0.5 * rng.random(n + 1)
        mem = None
        limit = None
        if trial % 3:
            mem = dict(
                mem_fixed=rng.random(n),
                mem_act=rng.random(n),
                cut_mem=rng.random(n + 1),
                inflight=[float(min(k - s, 4)) for s in range(k)],
            )
            limit = 1.2 * min_memory_limit(partition_problem(mem["mem_fixed"], k, **mem))
        p = solve_partition(
            partition_problem(compute, k, cut_comm=comm, memory_limit=limit, **(mem or {})))
        check_shape(p, n, k)
        assert p.bottleneck == pytest.approx(reference_dp(compute, k, comm, limit, mem), rel=1e-9)


# --------------------------------------------------------------------------------------------
# properties against the brute force
# --------------------------------------------------------------------------------------------


@settings(deadline=None, max_examples=150)
@given(instances())
def test_the_solver_bottleneck_equals_the_brute_force_one(inst):
    compute, k, comm = inst
    problem = partition_problem(compute, k, cut_comm=comm)
    p = solve_partition(problem)
    ref = brute_force_partition(problem)
    check_shape(p, len(compute), k)
    assert p.bottleneck == pytest.approx(ref.bottleneck, rel=1e-9, abs=1e-12)
    again = evaluate(problem, p.cuts)
    assert again == p


@settings(deadline=None, max_examples=150)
@given(st.data())
def test_the_solver_matches_the_brute_force_under_a_memory_limit(data):
    compute, k, comm = data.draw(instances())
    n = len(compute)
    mem = data.draw(memory_models(n, k))
    lowest = brute_min_memory(k, mem)
    limit = data.draw(
        st.one_of(
            st.sampled_from([0.0, 0.5, 0.999, 1.0, 1.01, 1.5, 3.0]).map(lambda x: x * lowest),
            st.floats(0.0, 200.0, allow_subnormal=False),
        )
    )
    problem = partition_problem(compute, k, cut_comm=comm, memory_limit=limit, **mem)
    try:
        ref = brute_force_partition(problem)
    except PartitionError:
        assert limit < lowest
        with pytest.raises(PartitionError, match="minimum"):
            solve_partition(problem)
        return
    p = solve_partition(problem)
    check_shape(p, n, k)
    assert p.bottleneck == pytest.approx(ref.bottleneck, rel=1e-9, abs=1e-12)
    assert p.stage_memory is not None
    assert max(p.stage_memory) <= limit * (1 + 1e-9) + 1e-12
    assert evaluate(problem, p.cuts) == p


@settings(deadline=None, max_examples=80)
@given(st.data())
def test_min_memory_limit_is_the_smallest_feasible_limit(data):
    n = data.draw(st.integers(1, 12))
    k = data.draw(st.integers(1, min(n, 5)))
    mem = data.draw(memory_models(n, k))
    m = min_memory_limit(partition_problem(mem["mem_fixed"], k, **mem))
    assert m == pytest.approx(brute_min_memory(k, mem), rel=1e-9, abs=1e-12)
    compute = [1.0] * n
    p = solve_partition(partition_problem(compute, k, memory_limit=m, **mem))  # feasible at it
    check_shape(p, n, k)
    if m > 0:
        with pytest.raises(PartitionError):
            brute_force_partition(partition_problem(compute, k, memory_limit=0.999 * m, **mem))
        with pytest.raises(PartitionError):
            solve_partition(partition_problem(compute, k, memory_limit=0.999 * m, **mem))


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


def test_more_stages_than_atoms_names_both_numbers_and_the_maximum():
    with pytest.raises(PartitionError, match=r"3 atoms into 4 stages.*\(4 > 3\)") as info:
        solve_partition(partition_problem([1.0, 2.0, 3.0], 4))
    assert info.value.hint is not None and "at most 3 stages" in info.value.hint
    with pytest.raises(PartitionError, match=r"\(4 > 3\)"):
        brute_force_partition(partition_problem([1.0, 2.0, 3.0], 4))
    with pytest.raises(PartitionError, match=r"\(5 > 2\)"):
        equal_count_cuts(2, 5)


def test_zero_stages_is_rejected():
    with pytest.raises(PartitionError, match=r"at least 1 \(got 0\)"):
        solve_partition(partition_problem([1.0], 0))


def test_a_memory_limit_below_the_minimum_names_the_minimum():
    mem = dict(mem_fixed=[4.0, 4.0, 4.0, 4.0], mem_act=[1.0] * 4, inflight=[2, 1])
    lowest = min_memory_limit(partition_problem(mem["mem_fixed"], 2, **mem))
    assert lowest == 12.0  # (0, 2, 4): 8 + 2*2 and 8 + 1*2
    msg = r"no 2-stage partition fits the memory limit \(limit 10 < minimum 12 bytes\)"
    with pytest.raises(PartitionError, match=msg) as info:
        solve_partition(partition_problem([1.0] * 4, 2, memory_limit=10.0, **mem))
    assert info.value.hint is not None and "12" in info.value.hint
    with pytest.raises(PartitionError, match=r"limit 10 < minimum 12 bytes"):
        brute_force_partition(partition_problem([1.0] * 4, 2, memory_limit=10.0, **mem))


def test_a_caller_asking_only_whether_one_fits_is_not_told_the_minimum(monkeypatch):
    """least_memory=False (the planner, trying hundreds of candidates) skips the bisection that
    finds the least limit: the error says only that none fits."""
    import fxpipe.passes.partition.solver as solver

    def searched(*_: object) -> float:
        raise AssertionError("the least limit was searched")

    mem = dict(mem_fixed=[4.0, 4.0, 4.0, 4.0], mem_act=[1.0] * 4, inflight=[2, 1])
    problem = partition_problem([1.0] * 4, 2, memory_limit=10.0, **mem)
    monkeypatch.setattr(solver, "_min_memory", searched)
    with pytest.raises(PartitionError, match=r"no 2-stage partition fits the memory limit "
                                             r"\(10 bytes\)") as info:
        solve_partition(problem, least_memory=False)
    assert "minimum" not in str(info.value)
    with pytest.raises(AssertionError, match="searched"):
        solve_partition(problem)


def test_length_mismatches_name_the_lengths():
    with pytest.raises(PartitionError, match=r"cut_comm has 3 entries but needs 4"):
        solve_partition(partition_problem([1.0, 2.0, 3.0], 2, cut_comm=[0.0, 1.0, 0.0]))
    with pytest.raises(PartitionError, match=r"mem_act has 2 entries but needs 3"):
        solve_partition(partition_problem(
            [1.0, 2.0, 3.0], 2, memory_limit=10.0, mem_fixed=[1.0] * 3, mem_act=[1.0] * 2
        ))
    with pytest.raises(PartitionError, match=r"inflight has 3 entries but needs 2"):
        solve_partition(
            partition_problem([1.0, 2.0, 3.0], 2, mem_fixed=[1.0] * 3, inflight=[1, 1, 1]))
    with pytest.raises(PartitionError, match=r"cut_mem has 3 entries but needs 4"):
        min_memory_limit(partition_problem([1.0] * 3, 2, mem_fixed=[1.0] * 3, cut_mem=[0.0] * 3))


def test_negative_and_nan_values_are_rejected():
    with pytest.raises(PartitionError, match=r"compute\[1\] is negative \(-1\.0\)"):
        solve_partition(partition_problem([1.0, -1.0], 1))
    with pytest.raises(PartitionError, match=r"cut_comm\[2\] is NaN"):
        solve_partition(partition_problem([1.0, 1.0], 2, cut_comm=[0.0, 0.0, float("nan")]))
    with pytest.raises(PartitionError, match=r"inflight\[0\] is not positive"):
        solve_partition(partition_problem([1.0, 1.0], 2, mem_fixed=[1.0, 1.0], inflight=[0, 1]))
    with pytest.raises(PartitionError, match=r"memory_limit must be a non-negative number"):
        solve_partition(partition_problem([1.0, 1.0], 2, mem_fixed=[1.0, 1.0], memory_limit=-1.0))
    with pytest.raises(PartitionError, match=r"mem_fixed is not"):
        solve_partition(partition_problem([1.0, 1.0], 2, memory_limit=5.0))


def test_evaluate_checks_the_cuts_and_the_memory_limit():
    with pytest.raises(PartitionError, match=r"start at 0 and end at n = 3"):
        evaluate(partition_problem([1.0, 1.0, 1.0], 1), (0, 2))
    with pytest.raises(PartitionError, match=r"stage 1 is empty"):
        evaluate(partition_problem([1.0, 1.0, 1.0], 3), (0, 2, 2, 3))
    with pytest.raises(PartitionError, match=r"stage 0 needs more memory than the limit \(3 > 2"):
        evaluate(partition_problem([1.0] * 3, 1, mem_fixed=[1.0] * 3, memory_limit=2.0), (0, 3))


# --------------------------------------------------------------------------------------------
# speed (reported, never asserted)
# --------------------------------------------------------------------------------------------


def test_the_benchmark_runs_on_100k_atoms_and_64_stages():
    result = benchmark()
    print(f"\nsolve_partition n={result['n']} K={result['stages']}: {result['seconds']:.3f} s")
    assert result["n"] == 100_000 and result["stages"] == 64
    assert result["bottleneck"] >= 100_000 * 0.5 / 64 * 0.9
    mem = benchmark(10_000, 16, with_memory=True)
    print(f"solve_partition with memory n={mem['n']} K={mem['stages']}: {mem['seconds']:.3f} s")
