"""Tests of fxpipe.tools.bench_partition: the Barany-Grinberg baseline, the DP oracle, the
comparison and the bench-partition command (no assertions on wall times)."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.passes.partition.problem import equal_count_cuts, evaluate, partition_problem
from fxpipe.passes.partition.solver import solve_partition
from fxpipe.testing.partition_oracle import brute_force_partition
from fxpipe.tools.bench_partition import compare, run_bench_partition
from fxpipe.tools.partition_baselines import bg_partition, dp_partition
from fxpipe.tools.partition_instances import live_bytes, synthetic_chain, synthetic_dag

values = st.one_of(st.integers(0, 6).map(float),
                   st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False,
                             allow_subnormal=False))


@st.composite
def instances(draw, max_n: int = 10, max_k: int = 5):
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(1, min(n, max_k)))
    compute = draw(st.lists(values, min_size=n, max_size=n))
    comm = draw(st.one_of(st.none(), st.lists(values, min_size=n + 1, max_size=n + 1)))
    return compute, k, comm


def _valid(cuts, n, k):
    return (len(cuts) == k + 1 and cuts[0] == 0 and cuts[-1] == n
            and all(a < b for a, b in itertools.pairwise(cuts)))


# --------------------------------------------------------------------------------------------
# Barany-Grinberg
# --------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, derandomize=True)
@given(instances(max_n=40, max_k=8), st.sampled_from(["minmax", "max"]))
def test_bg_gives_k_contiguous_nonempty_blocks(inst, normalise):
    compute, k, _ = inst
    r = bg_partition(compute, k, normalise=normalise)
    assert _valid(r.cuts, len(compute), k)
    assert r.repaired == 0
    # the moves can cycle on ties (e.g. [1.9, 1, 2, 1] into 3): then the iteration bound stops
    # them with valid blocks, and the stopping rule below need not hold
    assert r.status in ("ok", "iteration limit")
    if r.status != "ok":
        return
    # the stopping rule holds in normalised units
    x = np.asarray(compute)
    if normalise == "minmax":
        y = (x - x.min()) / (x.max() - x.min()) if x.max() > x.min() else 0 * x
    else:
        y = x / x.max() if x.max() > 0 else 0 * x
    sums = [y[a:b].sum() for a, b in zip(r.cuts, r.cuts[1:])]
    assert max(sums) <= min(sums) + 1 + 1e-9


def test_bg_worked_example_p_before_q():
    # [6,6,6,6,6,6,0,0,0], k=3; (x-0)/(6-0) -> [1,1,1,1,1,1,0,0,0]; even split (0,3,6,9).
    #   sums [3,3,0]: (1) M=3, p=0.  (2) m=0, q=2, 3 > 0+1: p<q so h=1 gives its last element
    #   to B2: cuts (0,3,5,9), sums [3,2,1]; h != p -> (2): m=1, q=2, 3 > 2: h=1 again:
    #   (0,3,4,9), sums [3,1,2]; (2): m=1, q=1 (the smallest block closest to p), 3 > 2: h=0:
    #   (0,2,4,9), sums [2,2,2]; h == p -> (1): M=2, p=0; (2): 2 <= 2+1, stop.  3 moves.
    r = bg_partition([6, 6, 6, 6, 6, 6, 0, 0, 0], 3)
    assert (r.cuts, r.moves) == ((0, 2, 4, 9), 3)


def test_bg_worked_example_q_before_p():
    # The mirror image [0,0,0,6,6,6,6,6,6] -> [0,0,0,1,1,1,1,1,1]; sums [0,3,3], p=1 (lowest
    # index among the largest).  q=0 < p: h=1 gives its first element to B0: (0,4,6,9), sums
    # [1,2,3]; h == p -> (1): p=2; q=0, 3 > 2: h=1: (0,5,6,9), sums [2,1,3]; h != p -> (2):
    # q=1, 3 > 2: h=2: (0,5,7,9), sums [2,2,2]; h == p -> (1): stop.  Blocks 12, 12, 12.
    r = bg_partition([0, 0, 0, 6, 6, 6, 6, 6, 6], 3)
    assert (r.cuts, r.moves) == ((0, 5, 7, 9), 3)


def test_bg_normalisation_flaw():
    # [2,2,2,2,10,2], k=2: (x-2)/8 -> [0,0,0,0,1,0]; the even split has normalised sums 0 and
    # 1, so it stops at once: real blocks 6 | 14.  The optimum is 8 | 12 (cuts (0,4,6)).
    seq = [2, 2, 2, 2, 10, 2]
    r = bg_partition(seq, 2)
    assert (r.cuts, r.moves) == ((0, 3, 6), 0)
    assert evaluate(partition_problem(seq, 2), r.cuts).bottleneck == 14
    assert solve_partition(partition_problem(seq, 2)).bottleneck == 12
    # one step: [4,4,4,4,4,0,0,0] -> [1,1,1,1,1,0,0,0], sums [4,1] -> move one -> [3,2], stop
    assert bg_partition([4, 4, 4, 4, 4, 0, 0, 0], 2).cuts == (0, 3, 8)
    # constant sequences normalise to zeros: the even split
    assert bg_partition([3.0] * 10, 4).cuts == equal_count_cuts(10, 4)


def test_bg_time_budget_and_iteration_limit():
    seq = [0.0] * 1000 + [1.0] * 1000  # needs ~500 moves from the even split
    r = bg_partition(seq, 2, time_budget=0.0)
    assert r.cuts is None and r.status.startswith("skipped")
    r = bg_partition(seq, 2, max_moves=10)
    assert r.status == "iteration limit" and _valid(r.cuts, 2000, 2)
    r = bg_partition(seq, 2)
    assert r.status == "ok" and abs(r.cuts[1] - 1500) <= 1


def test_bg_rejects_more_blocks_than_elements():
    with pytest.raises(ValueError):
        bg_partition([1.0, 2.0], 3)


# --------------------------------------------------------------------------------------------
# the DP oracle
# --------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(instances())
def test_dp_equals_brute_force(inst):
    compute, k, comm = inst
    problem = partition_problem(compute, k, cut_comm=comm)
    dp = dp_partition(problem)
    bf = brute_force_partition(problem)
    assert _valid(dp.cuts, len(compute), k)
    assert dp.bottleneck == pytest.approx(bf.bottleneck, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_dp_band_keeps_the_optimum(seed):
    rng = np.random.default_rng(seed)
    n, k = 300, 6
    compute, comm = rng.lognormal(size=n), rng.random(n + 1)
    problem = partition_problem(compute, k, cut_comm=comm)
    upper = evaluate(problem, equal_count_cuts(n, k)).bottleneck
    full = dp_partition(problem, chunk=64)
    band = dp_partition(problem, upper=upper, chunk=37)
    assert band.bottleneck == pytest.approx(full.bottleneck, rel=1e-12)


# --------------------------------------------------------------------------------------------
# fxpipe against the oracle and the baselines
# --------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(instances(max_n=60, max_k=8))
def test_fxpipe_optimal_and_no_worse_than_baselines(inst):
    compute, k, comm = inst
    problem = partition_problem(compute, k, cut_comm=comm)
    fx = solve_partition(problem).bottleneck
    dp = dp_partition(problem).bottleneck
    assert fx == pytest.approx(dp, rel=1e-9, abs=1e-12)
    for cuts in (equal_count_cuts(len(compute), k), bg_partition(compute, k).cuts,
                 bg_partition(compute, k, normalise="max").cuts):
        assert fx <= evaluate(problem, cuts).bottleneck * (1 + 1e-9) + 1e-12


@pytest.mark.parametrize("kind", ["chain", "dag"])
def test_compare_on_synthetic_instances(kind):
    for seed, n, k in itertools.product(range(2), (50, 300), (2, 8)):
        compute, comm, _ = (synthetic_chain(n, seed) if kind == "chain"
                            else synthetic_dag(n, seed, k))
        res = compare(partition_problem(compute, k, cut_comm=comm))
        assert res["exact"]["method"] == "dp"
        assert all(res["checks"].values()), res["checks"]
        for m in ("equal", "bg", "bg_max"):
            assert res[m]["ratio_to_fxpipe"] >= 1 - 1e-9


def test_live_bytes_matches_definition():
    rng = np.random.default_rng(3)
    n = 30
    src = rng.integers(0, n - 1, size=40)
    dst = np.minimum(src + rng.integers(1, 10, size=40), n - 1)
    nbytes = rng.random(40)
    live = live_bytes(n, src, dst, nbytes)
    for p in range(1, n):
        want = sum(b for u, v, b in zip(src, dst, nbytes) if u < p <= v)
        assert live[p] == pytest.approx(want, abs=1e-12)
    assert live[0] == live[n] == 0


def test_synthetic_instances_are_deterministic():
    a = synthetic_dag(500, 7, 4)
    b = synthetic_dag(500, 7, 4)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert a[1].shape == (501,) and a[1][0] == a[1][-1] == 0


# --------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------


def test_run_bench_partition_writes_json_and_markdown(tmp_path, capsys):
    assert run_bench_partition([200, 400], 4, str(tmp_path), models=["branchy"]) == 0
    printed = capsys.readouterr().out
    assert "bg/fx" in printed and "chain-400" in printed
    data = json.loads((tmp_path / "bench_partition.json").read_text())
    md = (tmp_path / "bench_partition.md").read_text()
    names = {(r["name"], r["K"]) for r in data["instances"]}
    assert {("chain-200", 4), ("dag-200", 4), ("chain-400", 4), ("dag-400", 4),
            ("branchy", 2), ("branchy", 4)} <= names
    for r in data["instances"]:
        for m in ("fxpipe", "exact", "equal", "bg", "bg_max"):
            assert isinstance(r[m]["bottleneck"], float), (r["name"], m)
        assert r["fxpipe"]["solve_seconds"] >= 0
        assert r["exact"]["method"] == "dp"
        assert all(r["checks"].values())
        assert r["name"] in md
    assert data["failed"] == []
