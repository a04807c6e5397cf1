"""The optimizer under each shard mode, and its state as checkpoints hold it: whole.

shard="optimizer" is ZeRO-1 on torch's own engine: a stage's data-parallel replicas run one
`torch.distributed.optim.ZeroRedundancyOptimizer` over their group, each holding the state of
about 1/R of the stage's parameters and broadcasting what it updated after each step. The
gradients stay whole (the replicas average them as without sharding), so a step is the plain
optimizer's step. A checkpoint gathers the state (`consolidate_state_dict`) onto the first
replica, which saves it under the wrapped optimizer's class in the unsharded format: it
resumes into any replica count and either shard mode, and `load_state_dict` gives each replica
its own part.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from fxpipe.errors import ConfigError

__all__ = ["make_optimizer", "optimizer_kind", "whole_state_dict", "current_state", "is_sharded"]


def make_optimizer(params: Iterable[torch.nn.Parameter], optimizer_class: type[Any], *,
                   shard: str = "none", group: Any = None, replicas: int = 1,
                   **kwargs: Any) -> torch.optim.Optimizer | None:
    """`optimizer_class(params, **kwargs)`, or under shard="optimizer" with several replicas a
    ZeroRedundancyOptimizer of it over `group` (the stage's replicas); None when `params` is
    empty (a rank whose stages hold no parameters has nothing to update)."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class,
                                                             torch.optim.Optimizer)):
        raise ConfigError(f"the optimizer must be a torch.optim.Optimizer class (got "
                          f"{optimizer_class!r})",
                          hint="e.g. program.optimizer(torch.optim.AdamW, lr=1e-3)")
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return None
    if shard == "none" or replicas == 1:
        optimizer: torch.optim.Optimizer = optimizer_class(trainable, **kwargs)
        return optimizer
    if shard != "optimizer":
        raise ConfigError(f"shard={shard!r} has no optimizer of its own",
                          hint="use shard='optimizer' or 'none'")
    if group is None:
        raise ConfigError(f"shard='optimizer' over {replicas} replicas needs their process "
                          "group", hint="make the optimizer after the program is built "
                                        "under torchrun (program.optimizer(...))")
    return ZeroRedundancyOptimizer(trainable, optimizer_class=optimizer_class,
                                   process_group=group, **kwargs)


def is_sharded(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The class checkpoints record: a sharded optimizer's is the one it wraps."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return type(optimizer.optim).__name__
    return type(optimizer).__name__


def whole_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The optimizer's state_dict over all its parameters. For a sharded one this is
    collective over its group (every replica calls it) and only the first replica gets the
    state; the others get None."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.state_dict()
    optimizer.consolidate_state_dict(to=0)
    if dist.get_rank(optimizer.process_group) != 0:
        return None
    state: dict[str, Any] = optimizer.state_dict()
    return state


def current_state(optimizer: torch.optim.Optimizer) -> dict[int, Any]:
    """The state this process holds, by the optimizer's parameter index (a sharded one's own
    part; no collective)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return {}  # its own part stays in optimizer.optim for what a load does not restore
    state: dict[int, Any] = optimizer.state_dict()["state"]
    return state
