"""Clipping gradients by the norm of the whole model's gradient when each rank holds a part.

`torch.nn.utils.clip_grad_norm_(program.parameters(), ...)` on one rank of a pipeline clips by
that rank's norm: another number on every rank, and not the plain model's. The pipeline's norm
adds up each rank's share over the ranks of one pipeline, a tied weight counted once (by the
first stage that holds it). Data-parallel replicas hold the same averaged gradients and are not
added, except under shard="full", where each holds a shard of them.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.sharding import local_part

__all__ = ["counted_gradients", "total_norm", "clip_by", "clip_rank_gradients"]


def counted_gradients(named: dict[str, torch.Tensor], shared: dict[str, list[int]],
                      own_stages: Iterable[int]) -> list[torch.Tensor]:
    """The gradients this rank adds to the pipeline's norm, each parameter once: a tied
    parameter only on the rank of the first stage that holds it."""
    own = set(own_stages)
    counted: dict[int, torch.Tensor] = {}
    skipped: set[int] = set()
    for name, tensor in named.items():
        if not isinstance(tensor, nn.Parameter) or tensor.grad is None:
            continue
        if name in shared and min(shared[name]) not in own:
            skipped.add(id(tensor))
        else:
            counted[id(tensor)] = tensor.grad
    return [g for key, g in counted.items() if key not in skipped]


def total_norm(grads: Sequence[torch.Tensor], norm_type: float, groups: Sequence[Any],
               device: torch.device) -> torch.Tensor:
    """The norm of all the ranks' `grads` together, in float32 on `device`: this rank's sum of
    |g|^p (its maximum for p = inf) reduced over each group in turn."""
    p = float(norm_type)
    parts = [local_part(g).detach() for g in grads]
    if math.isinf(p):
        local = torch.zeros((), dtype=torch.float32, device=device)
        for t in parts:
            if t.numel():
                local = torch.maximum(local, t.abs().max().float().to(device))
        for group in groups:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    local = torch.zeros((), dtype=torch.float32, device=device)
    for t in parts:
        local += torch.linalg.vector_norm(t, p, dtype=torch.float32).to(device) ** p
    for group in groups:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    return local ** (1.0 / p)


def clip_by(grads: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scales `grads` in place by max_norm / norm where that is below 1, as
    torch.nn.utils.clip_grad_norm_ does (the same 1e-6 guard, no host sync)."""
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in {id(g): g for g in grads}.values():
        local_part(g).mul_(factor.to(device=g.device, dtype=g.dtype))


def clip_rank_gradients(executor: Any, max_norm: float, norm_type: float,
                        error_if_nonfinite: bool) -> torch.Tensor:
    """Clips the gradients of a DistributedExecutor's stages by the pipeline's norm (every
    rank of the pipeline calls it) and returns that norm."""
    named = executor.named_tensors()
    counted = counted_gradients(named, executor.shared, executor.units)
    groups = [executor.pp_group]
    if executor.full_shard is not None and executor.mesh.replicas > 1:
        groups.append(executor.dp_group)  # each replica holds a shard of every gradient
    norm = total_norm(counted, norm_type, groups, executor.device)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(f"the total norm of order {float(norm_type)} of the pipeline's "
                           f"gradients is {float(norm)}, so they cannot be clipped "
                           "(error_if_nonfinite=False clips them anyway)")
    clip_by([p.grad for p in executor.parameters() if p.grad is not None], max_norm, norm)
    return norm
