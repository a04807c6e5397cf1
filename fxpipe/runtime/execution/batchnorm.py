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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["deferred_batch_norm", "commit_batch_norms", "discard_batch_norms",
           "cumulative_batch_norm", "average_statistics", "RUNNING_STATISTICS",
           "too_few_values_hint"]

RUNNING_STATISTICS = ("running_mean", "running_var")  # what replicas average after a step

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


def commit_batch_norms(group: Any = None) -> set[int]:
    """Updates every deferred BatchNorm's running statistics once, from all its micro-batches,
    and with `group` (the data-parallel replicas of these stages) from every replica's: their
    sums are added first, so the statistics are the global batch's. Returns the ids of the
    running statistics it updated."""
    with _LOCK, torch.no_grad():
        pending = list(_PENDING.values())  # the order the stages ran: the same on every replica
        if group is not None and pending:
            _add_over(group, pending)
        for stats in pending:
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
    return {id(t) for stats in pending for t in (stats.running_mean, stats.running_var)}


def _add_over(group: Any, pending: list[_Stats]) -> None:
    """Each statistic's sums and count added over the group, in one all-reduce."""
    device = pending[0].total.device
    flat = torch.cat([torch.cat([s.total.to(device), s.squares.to(device),
                                 torch.tensor([float(s.count)], dtype=s.total.dtype,
                                              device=device)])
                      for s in pending])
    dist.all_reduce(flat, group=group)
    at = 0
    for s in pending:
        width = s.total.numel()
        s.total.copy_(flat[at:at + width])
        s.squares.copy_(flat[at + width:at + 2 * width])
        s.count = int(flat[at + 2 * width].item())
        at += 2 * width + 1


def average_statistics(tensors: Sequence[torch.Tensor], group: Any, replicas: int) -> None:
    """The replicas' running statistics made one: each replica updated its own from its share
    of the batch, and they are averaged in place (the means are then those of the global
    batch's micro-batch statistics; the variances the replicas' mean, without the spread
    between their means). One all-reduce per device, in float64: statistics the replicas hold
    alike (a program compiled in eval mode updates none) stay exactly as they are."""
    buckets: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault(t.device, []).append(t)
    with torch.no_grad():
        for same in buckets.values():
            flat = torch.cat([t.reshape(-1).double() for t in same])
            dist.all_reduce(flat, group=group)
            flat /= replicas
            at = 0
            for t in same:
                t.copy_(flat[at:at + t.numel()].view_as(t))
                at += t.numel()


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


def too_few_values_hint(error: BaseException, microbatch: int) -> str | None:
    """The hint for BatchNorm's refusal of a training micro-batch with one value per channel
    (a micro-batch of one example without spatial dimensions), else None: the plain model
    normalises over the whole batch, a pipeline over each micro-batch."""
    if "Expected more than 1 value per channel when training" not in str(error):
        return None
    return (f"BatchNorm in train mode normalises each micro-batch by its own statistics (as "
            f"GPipe does), which needs more than one value per channel, and these micro-batches "
            f"hold {microbatch} example{'s' if microbatch != 1 else ''}: use fewer chunks, so "
            f"that each micro-batch has 2 or more examples")
