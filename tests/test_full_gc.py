"""Tests for fxpipe.full_gc: Python's full collections deferred while the compiler runs."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

import fxpipe
from fxpipe.full_gc import full_collections_deferred


def test_thresholds_come_back_when_the_last_nested_or_concurrent_use_leaves():
    before = gc.get_threshold()
    inside, entered, leave = [], threading.Event(), threading.Event()

    def other_thread() -> None:
        with full_collections_deferred():
            entered.set()
            leave.wait(10)

    with full_collections_deferred():
        deferred = gc.get_threshold()
        assert deferred[:2] == before[:2] and deferred[2] > 10**6
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert entered.wait(10)
        with full_collections_deferred():
            inside.append(gc.get_threshold())
        inside.append(gc.get_threshold())  # the inner use left, the others still hold
    inside.append(gc.get_threshold())  # this thread left, the other holds
    leave.set()
    thread.join(10)
    assert inside == [deferred] * 3
    assert gc.get_threshold() == before


def test_thresholds_come_back_when_the_deferred_work_raises():
    before = gc.get_threshold()
    with pytest.raises(RuntimeError, match="boom"), full_collections_deferred():
        raise RuntimeError("boom")
    assert gc.get_threshold() == before


SEEN: list[tuple[int, ...]] = []  # module-level: the compile may run a copy of the model


class _Recording(torch.nn.Module):
    """Records the collector's thresholds whenever it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append(gc.get_threshold())
        return self.second(self.first(x).relu())


def test_compile_and_write_run_without_full_collections_and_leave_the_thresholds(tmp_path):
    before = gc.get_threshold()
    SEEN.clear()
    program = fxpipe.compile(_Recording(), (torch.randn(8, 4),), stages=2, chunks=2)
    assert SEEN and all(t[2] > 10**6 for t in SEEN)  # the capture's runs of the model
    assert gc.get_threshold() == before
    SEEN.clear()
    program.write(str(tmp_path / "program"), reference_steps=1)
    assert SEEN and all(t[2] > 10**6 for t in SEEN)  # the reference losses' runs
    assert gc.get_threshold() == before
