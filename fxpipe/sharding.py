"""The optimizer under each shard mode, and its state as checkpoints hold it: whole.

shard="optimizer" is ZeRO-1 on torch's own engine: a stage's data-parallel replicas run one
`torch.distributed.optim.ZeroRedundancyOptimizer` over their group, each holding the state of
about 1/R of the stage's parameters and broadcasting what it updated after each step. The
gradients stay whole (the replicas average them as without sharding), so a step is the plain
optimizer's step. A checkpoint gathers the state (`consolidate_state_dict`) onto the first
replica, which saves it under the wrapped optimizer's class in the unsharded format: it
resumes into any replica count and either shard mode, and `load_state_dict` gives each replica
its own part.

shard="full" shards the parameters and gradients too, with FSDP2 (fxpipe.runtime.execution.fsdp):
the parameters are DTensors, and the plain optimizer over them holds DTensor state, 1/R of it on
each replica. A checkpoint holds them whole (`whole`, gathered on every replica), so it too
resumes into any replica count and shard mode, and a load gives each replica its shard of what
it reads (`shard_like`, `shard_state`).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

try:  # public from torch 2.5
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - torch 2.4
    from torch.distributed._tensor import (  # type: ignore[attr-defined]
        DTensor,
        distribute_tensor,
    )

from fxpipe.errors import ConfigError

__all__ = ["make_optimizer", "optimizer_kind", "whole_state_dict", "current_state", "is_sharded",
           "whole", "local_part", "shard_like", "shard_state"]


def make_optimizer(params: Iterable[torch.nn.Parameter], optimizer_class: type[Any], *,
                   shard: str = "none", group: Any = None, replicas: int = 1,
                   **kwargs: Any) -> torch.optim.Optimizer | None:
    """`optimizer_class(params, **kwargs)`, or under shard="optimizer" with several replicas a
    ZeroRedundancyOptimizer of it over `group` (the stage's replicas); None when `params` is
    empty (a rank whose stages hold no parameters has nothing to update). Under shard="full"
    the parameters are FSDP2's DTensor shards, which the plain optimizer steps."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class,
                                                             torch.optim.Optimizer)):
        raise ConfigError(f"the optimizer must be a torch.optim.Optimizer class (got "
                          f"{optimizer_class!r})",
                          hint="e.g. program.optimizer(torch.optim.AdamW, lr=1e-3)")
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return None
    if shard in ("none", "full") or replicas == 1:
        optimizer: torch.optim.Optimizer = optimizer_class(trainable, **kwargs)
        return optimizer
    if shard != "optimizer":
        raise ConfigError(f"unknown shard mode {shard!r}",
                          hint="use shard='none', 'optimizer' or 'full'")
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
        plain: dict[str, Any] = optimizer.state_dict()
        mesh = _mesh_of(optimizer)
        if mesh is None:
            return plain
        # shard="full": every replica gathers each DTensor (in the same order); the first keeps
        plain["state"] = {i: {k: whole(v) for k, v in s.items()}
                          for i, s in sorted(plain["state"].items())}
        return plain if mesh.get_local_rank() == 0 else None
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


def _mesh_of(optimizer: torch.optim.Optimizer) -> Any:
    """The DeviceMesh of the optimizer's DTensor parameters (shard="full"), else None."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, DTensor):
                return p.device_mesh
    return None


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (collective over its mesh: every replica calls it in the
    same order), any other tensor as it is."""
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a DTensor this process holds (writing into it writes the DTensor), any other
    tensor as it is."""
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`value` (whole, the same on every replica) as a DTensor laid out as `like`, each replica
    taking its own part without communicating; `value` itself when `like` is no DTensor."""
    if not isinstance(like, DTensor) or isinstance(value, DTensor):
        return value
    value = value.to(device=like.device)
    try:
        return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
    except TypeError:  # torch before src_data_rank: replica 0's value, scattered (collective)
        return distribute_tensor(value, like.device_mesh, like.placements)


def shard_state(optimizer: torch.optim.Optimizer) -> None:
    """After a load of whole state into an optimizer over DTensors (shard="full"): each state
    tensor of its parameter's shape becomes that parameter's shard; 0-dim counters stay."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not isinstance(p, DTensor) or not state:
                continue
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                        and value.shape == p.shape and value.dim() > 0:
                    state[key] = shard_like(value, p)
