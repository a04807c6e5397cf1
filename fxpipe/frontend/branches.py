"""Branches on a tensor's value that torch.export cannot decide, decided as the example batch
decides them, with a check in the graph.

`if not torch.isfinite(x).all(): x = x.clamp(...)` (DETR's encoder in training) asks for a
value while export traces shapes only, so export refuses the whole model. Most such branches
guard against rare data and go the same way on every batch: the model runs once on the example
batch and records, per line, which way each branch went; export then follows those answers,
and the graph checks each one on every micro-batch (`torch._assert_async`), so a batch that
would go the other way stops with the line named instead of computing something else.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fxpipe import source
from fxpipe.frontend.mutation import restore_values, snapshot_state
from fxpipe.untouched import seeded

__all__ = ["Decisions", "record", "following"]

Site = tuple[str, int]  # file and line of the `if`
Decisions = dict[Site, list[bool]]


def _site() -> Site:
    frame = sys._getframe(2)  # the caller of Tensor.__bool__
    return frame.f_code.co_filename, frame.f_lineno


@contextlib.contextmanager
def _bool_as(replacement: Callable[[torch.Tensor], bool]) -> Iterator[None]:
    original = torch.Tensor.__bool__
    torch.Tensor.__bool__ = replacement  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.Tensor.__bool__ = original  # type: ignore[method-assign]


def record(run: Callable[..., Any], model: torch.nn.Module,
           tensors: Sequence[torch.Tensor]) -> Decisions:
    """Which way every branch on a tensor's value goes when `run(*tensors)` runs, by line in
    order; the model's state is put back afterwards."""
    decisions: Decisions = {}
    original = torch.Tensor.__bool__

    def recorded(self: torch.Tensor) -> bool:
        value = original(self)
        decisions.setdefault(_site(), []).append(value)
        return value

    before = snapshot_state(model, [])
    try:
        with torch.no_grad(), seeded(0), _bool_as(recorded):
            run(*tensors)
    finally:
        restore_values(before)
    return decisions


@contextlib.contextmanager
def following(decisions: Decisions | None) -> Iterator[None]:
    """While exporting: a branch on a traced tensor goes the way it went on the example batch,
    and the graph asserts that it does on every batch. A line the example did not reach (or
    reached fewer times) is left to export, which refuses it as before."""
    if decisions is None:
        yield
        return
    original = torch.Tensor.__bool__
    left = {site: list(values) for site, values in decisions.items()}

    def follow(self: torch.Tensor) -> bool:
        site = _site()
        if not isinstance(self, FakeTensor) or not left.get(site):
            return original(self)
        value = left[site].pop(0)
        line = f"{source.display_path(site[0])}:{site[1]}"
        condition = self.bool() if value else self.logical_not()
        torch._assert_async(condition, f"the branch at {line} went the other way than on the "
                            "example batch, whose way the pipeline's graph follows")
        return value

    with _bool_as(follow):
        yield
