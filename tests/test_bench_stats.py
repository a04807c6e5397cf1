"""The statistics `fxpipe bench` states its ratios with (fxpipe.tools.bench_stats)."""
from __future__ import annotations

import random

import pytest

from fxpipe.tools.bench_stats import (
    MAX_STEPS,
    bootstrap_interval,
    measured_steps,
    paired_ratio,
    rotated,
    schedule_bound,
)


def test_every_variant_runs_at_every_position_once_over_as_many_steps():
    names = ["a", "b", "c", "d"]
    orders = [rotated(names, step) for step in range(len(names))]
    assert all(sorted(order) == names for order in orders)
    for position in range(len(names)):
        assert sorted(order[position] for order in orders) == names
    assert rotated(names, 5) == rotated(names, 1) == ["b", "c", "d", "a"]


def test_a_paired_ratio_sees_through_a_drift_that_hits_both_variants():
    """The machine slows down 40% over the run; a is 3% faster than b at every step. The
    ratio of the medians cannot tell (their spreads overlap); the paired one can."""
    rng = random.Random(0)
    speed = [1.0 + 0.4 * i / 19 for i in range(20)]
    b = [s * (1 + rng.uniform(-0.005, 0.005)) for s in speed]
    a = [0.97 * s * (1 + rng.uniform(-0.005, 0.005)) for s in speed]
    ratio = paired_ratio(a, b)
    assert ratio.median == pytest.approx(0.97, abs=0.006)
    assert ratio.high < 1.0 and ratio.verdict == "faster"
    assert min(b) < max(a)  # the unpaired spreads overlap
    assert paired_ratio(b, a).verdict == "slower"


def test_a_ratio_within_the_noise_is_not_called():
    rng = random.Random(1)
    a = [1.0 + rng.uniform(-0.1, 0.1) for _ in range(15)]
    b = [1.0 + rng.uniform(-0.1, 0.1) for _ in range(15)]
    ratio = paired_ratio(a, b)
    assert ratio.low < 1.0 < ratio.high and ratio.verdict == "not resolved"
    assert "not resolved" in ratio.describe()


def test_the_bootstrap_interval_holds_the_median_and_narrows_with_more_steps():
    rng = random.Random(2)
    values = [rng.gauss(1.0, 0.05) for _ in range(200)]
    wide = bootstrap_interval(values[:10])
    narrow = bootstrap_interval(values)
    assert narrow[0] <= 1.0 <= narrow[1]
    assert narrow[1] - narrow[0] < wide[1] - wide[0]
    assert bootstrap_interval(values[:10]) == wide  # seeded: the same data, the same interval
    with pytest.raises(ValueError, match="as many steps"):
        paired_ratio([1.0], [1.0, 2.0])


def test_short_rounds_are_measured_more_often_within_the_seconds_given():
    # the bench GPT: a round of every variant takes about 20 s, 15 steps are the least
    assert measured_steps(20.0, 15, 60.0) == 15
    # the bundled MLP: about 2.5 s a round (every variant's step and its reference work), so
    # 72 steps fill the three minutes of `fxpipe bench --seconds`'s default
    assert measured_steps(2.5, 15, 180.0) == 72
    assert measured_steps(1e-4, 15, 60.0) == MAX_STEPS
    assert measured_steps(0.4, 15, 0.0) == 15  # no seconds: just the steps asked for
    assert measured_steps(0.0, 15, 60.0) == 15  # no warm-up round timed
    assert measured_steps(0.4, 500, 60.0) == 500  # never fewer than asked


@pytest.mark.parametrize(("schedule", "per_rank", "bound"), [
    ("gpipe", 1, 2 * 8 / 9), ("1f1b", 1, 2 * 8 / 9), ("zb-h1", 1, 48 / 25),
    ("interleaved-1f1b", 2, 48 / 25.5), ("zb-v", 2, 48 / 24.5)])
def test_each_schedule_has_its_own_bound(schedule, per_rank, bound):
    """At 2 ranks x 8 micro-batches: GPipe's KM/(M+K-1) = 1.78x, interleaving 1.88x, ZB-H1 in
    the paper's order 1.92x, ZB-V 1.96x."""
    assert schedule_bound(schedule, 8, 2, per_rank) == pytest.approx(bound)
