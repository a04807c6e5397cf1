"""The bench's core-speed probe: a rank whose core ran slower is not counted as more work."""
from __future__ import annotations

import pytest
import torch

from fxpipe.tools.core_speed import (
    CoreProbe,
    imbalance_at_equal_speed,
    relative_slowness,
    speed_spread,
)


def test_relative_slowness_is_each_rank_over_the_mean():
    assert relative_slowness([1.0, 3.0]) == pytest.approx([0.5, 1.5])
    assert relative_slowness([2.0, 2.0, 2.0]) == pytest.approx([1.0, 1.0, 1.0])


def test_speed_spread_is_the_median_step_spread():
    probes = [[1.0, 1.2], [1.1, 1.0], [1.0, 1.5]]  # 20%, 10%, 50% apart
    assert speed_spread(probes) == pytest.approx(0.2)


def test_a_slower_core_explains_the_extra_compute():
    # rank 1's core ran 20% slower in every step, and it computed 20% longer: balanced work
    busy = [[1.0, 1.2], [1.1, 1.32], [0.9, 1.08]]
    probes = [[0.010, 0.012], [0.011, 0.0132], [0.009, 0.0108]]
    assert imbalance_at_equal_speed(busy, probes) == pytest.approx(1.0, abs=1e-12)


def test_at_equal_core_speed_the_imbalance_is_the_raw_one():
    busy = [[1.0, 1.2], [1.0, 1.2], [1.0, 1.2]]
    probes = [[0.01, 0.01]] * 3
    assert imbalance_at_equal_speed(busy, probes) == pytest.approx(1.2 / 1.1)  # slowest / mean


def test_the_correction_is_per_step():
    # rank 0's core was slow in step 0 only, rank 1's in step 1 only: its work, equal to rank
    # 0's, measured long when its core was slow
    busy = [[1.5, 1.0], [1.0, 1.5], [1.0, 1.0]]
    probes = [[0.015, 0.010], [0.010, 0.015], [0.010, 0.010]]
    assert imbalance_at_equal_speed(busy, probes) == pytest.approx(1.0, abs=1e-12)
    # the same compute at equal core speed is 20% above the mean
    assert imbalance_at_equal_speed([[1.5, 1.0]], [[0.010, 0.010]]) == pytest.approx(1.5 / 1.25)


def test_the_probe_does_the_same_work_every_time():
    probe = CoreProbe(width=32, rows=16, repeats=2)
    first, second = probe._work(), probe._work()
    assert torch.equal(first, second) and torch.isfinite(first).all()
    assert torch.equal(first, CoreProbe(width=32, rows=16)._work())  # same on every rank
    assert 0 < probe.seconds() < 10
