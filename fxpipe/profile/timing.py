"""How the profile and its checks time what they measure: runs taking turns, the fastest kept
(a burst of load on a shared machine slows all alike and a lucky run shows what the code
costs), and the training step they time."""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
import torch.utils.checkpoint
from torch import nn

from fxpipe.remat_policy import CHECKPOINT_OPTIONS

__all__ = ["fastest", "interleaved", "remat_step", "train_step"]

_Key = TypeVar("_Key")


def fastest(fn: Callable[[], object], repeat: int = 25, budget: float = 1.0) -> float:
    """The fastest of `repeat` runs of `fn` after one untimed, or of fewer (at least 6) once
    `budget` seconds have passed."""
    return interleaved({None: fn}, rounds=repeat, budget=budget, least=6)[None]


def interleaved(runs: Mapping[_Key, Callable[[], object]], rounds: int = 60,
                budget: float = 2.0, least: int = 11, burst: int = 1) -> dict[_Key, float]:
    """The fastest run of each, their runs taking turns: `rounds` rounds, or fewer (at least
    `least`) once `budget` seconds have passed. With `burst` > 1 each turn runs one `burst`
    times and times all but the first, which warms the caches the other runs left cold, as a
    training loop's steps follow one another."""
    best = {key: float("inf") for key in runs}
    for run in runs.values():
        run()
    start = time.perf_counter()
    for i in range(rounds):
        for key, run in runs.items():
            for j in range(burst):
                t0 = time.perf_counter()
                run()
                if j or burst == 1:
                    best[key] = min(best[key], time.perf_counter() - t0)
        if i + 1 >= least and time.perf_counter() - start > budget:
            break
    return best


def train_step(model: nn.Module, x: torch.Tensor) -> None:
    """A training step of `model` on `x` without an optimizer: zero_grad, forward, backward."""
    model.zero_grad(set_to_none=True)
    torch.autograd.backward(model(x).sum())


def remat_step(model: nn.Module, x: torch.Tensor) -> None:
    """train_step with the model under the checkpoint the stages' remat regions run with
    (fxpipe.remat_policy.CHECKPOINT_OPTIONS)."""
    model.zero_grad(set_to_none=True)
    out: torch.Tensor = torch.utils.checkpoint.checkpoint(model, x, **CHECKPOINT_OPTIONS)
    torch.autograd.backward(out.sum())
