"""Deferred BatchNorm: per-micro-batch normalisation, running statistics over the whole batch.

In train mode BatchNorm normalises each micro-batch with its own statistics, as GPipe does. By
default the running statistics are then updated once per micro-batch; with
`fxpipe.compile(..., deferred_batch_norm=True)` the statistics of all micro-batches of a batch are
accumulated and committed once per batch, so the running mean and variance equal those of the
plain model on the full batch (as torchgpipe's DeferredBatchNorm). Recomputation in the backward
pass does not accumulate twice.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["deferred_batch_norm", "commit_batch_norms", "discard_batch_norms",
           "cumulative_batch_norm"]

_LOCK = threading.Lock()


@dataclass
class _Stats:
    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor | None
    momentum: float
    total: torch.Tensor
    squares: torch.Tensor
    count: int = 0


_PENDING: dict[int, _Stats] = {}


def _recomputing() -> bool:
    return torch._C._current_graph_task_id() != -1  # inside a backward pass: a recomputation


def deferred_batch_norm(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                        weight: torch.Tensor | None, bias: torch.Tensor | None,
                        num_batches_tracked: torch.Tensor | None, momentum: float,
                        eps: float) -> torch.Tensor:
    """Normalises `x` with its own statistics and records them for commit_batch_norms()."""
    if not _recomputing() and not isinstance(x, torch._subclasses.FakeTensor):
        dims = [d for d in range(x.dim()) if d != 1]
        with torch.no_grad():
            data = x.detach().double()  # E[x^2] - E[x]^2 loses digits in float32
            total = data.sum(dims)
            squares = data.square().sum(dims)
            count = x.numel() // x.shape[1]
        with _LOCK:
            stats = _PENDING.get(id(running_mean))
            if stats is None:
                stats = _PENDING[id(running_mean)] = _Stats(
                    running_mean, running_var, num_batches_tracked, momentum,
                    torch.zeros_like(total), torch.zeros_like(squares))
            stats.total += total
            stats.squares += squares
            stats.count += count
    return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)


def discard_batch_norms() -> None:
    """Forgets statistics recorded outside a training step (e.g. by profiling)."""
    with _LOCK:
        _PENDING.clear()


def commit_batch_norms() -> None:
    """Updates every deferred BatchNorm's running statistics once, from all its micro-batches."""
    with _LOCK, torch.no_grad():
        for stats in _PENDING.values():
            n = stats.count
            mean = stats.total / n
            var = (stats.squares / n - mean.square()).clamp_min(0)
            unbiased = var * n / max(n - 1, 1)
            m = stats.momentum
            stats.running_mean.mul_(1 - m).add_(mean.to(stats.running_mean.dtype), alpha=m)
            stats.running_var.mul_(1 - m).add_(unbiased.to(stats.running_var.dtype), alpha=m)
            if stats.num_batches_tracked is not None:
                stats.num_batches_tracked.add_(1)
        _PENDING.clear()


def cumulative_batch_norm(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                          weight: torch.Tensor | None, bias: torch.Tensor | None,
                          num_batches_tracked: torch.Tensor, eps: float) -> torch.Tensor:
    """BatchNorm in training with momentum=None: normalises with the batch's statistics and
    keeps the running ones as the average over every batch seen (factor 1 / batches counted),
    as _BatchNorm.forward does, with the factor a tensor rather than a Python float."""
    num_batches_tracked.add_(1)
    out = F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)
    with torch.no_grad():
        per_channel = x.detach().transpose(0, 1).flatten(1)
        factor = 1.0 / num_batches_tracked
        running_mean.mul_(1 - factor).add_(per_channel.mean(1) * factor)
        running_var.mul_(1 - factor).add_(per_channel.var(1) * factor)
    return out
