"""shard="full": each stage's parameters and gradients sharded over its data-parallel replicas
with torch's FSDP2 (`fully_shard`), composed with the pipeline as torch.distributed.pipelining
composes them.

Each stage module on this rank becomes one FSDP unit over the replica dimension of the
("dp", "pp") DeviceMesh: between steps a replica holds about 1/R of the stage's parameters
(DTensors sharded on their first dimension), of their gradients and, since an ordinary torch
optimizer then steps DTensors, of the optimizer's state. In a step the first forward gathers the
stage's parameters (the root unit keeps them gathered through the step, so the micro-batches'
forwards and backwards and any recomputation read them without gathering again), each backward
accumulates into the whole gradients without communicating, and after the step's last backward
one reduce-scatter averages them over the replicas and leaves each replica its shard, the
parameters going back to their shards (`FullShard.reduce`, as torch's pipelining stage's
`perform_reduce_grad`; the executor's backward runs outside the module's forward outputs, so
FSDP's own post-backward hooks cannot be relied on to fire).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from fxpipe.errors import ConfigError

__all__ = ["FullShard", "fully_shard_function"]


def fully_shard_function() -> Callable[..., Any]:
    """torch's `fully_shard` (FSDP2): public in torch.distributed.fsdp from torch 2.6, in
    torch.distributed._composable.fsdp before."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import (  # type: ignore[attr-defined]
                fully_shard,
            )
        except ImportError as e:
            import torch
            raise ConfigError(f"shard='full' needs FSDP2's fully_shard, which torch "
                              f"{torch.__version__} does not have ({e})",
                              hint="install torch >= 2.4 (2.6 or later recommended), or use "
                                   "shard='optimizer'") from e
    return fully_shard


class FullShard:
    """This rank's stage modules under FSDP2 over the data-parallel `mesh` (a 1-D DeviceMesh of
    the stage's replicas)."""

    def __init__(self, modules: Sequence[nn.Module], mesh: Any) -> None:
        seen: dict[int, int] = {}
        for i, module in enumerate(modules):
            for param in module.parameters():
                if id(param) in seen and seen[id(param)] != i:
                    raise ConfigError(
                        f"shard='full': stages {seen[id(param)]} and {i} of this rank share a "
                        "parameter (a tied weight), which one FSDP unit per stage cannot "
                        "shard once", hint="use one stage per rank (stages_per_rank=1), "
                                           "shard='optimizer', or untie the weights")
                seen[id(param)] = i
        fully_shard = fully_shard_function()
        self.modules = [fully_shard(m, mesh=mesh) for m in modules
                        if any(True for _ in m.parameters())]

    def accumulate(self) -> None:
        """Every backward until `reduce` accumulates whole gradients, without communicating
        or letting go of the gathered parameters."""
        for module in self.modules:
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)

    def reduce(self) -> None:
        """After the step's last backward: reduce-scatters the accumulated gradients (averaged
        over the replicas) into each replica's shard and reshards the parameters."""
        fully_shard = fully_shard_function()
        for module in self.modules:
            module.set_is_last_backward(True)
            module.set_reshard_after_backward(True)
            module.set_requires_gradient_sync(True)
            state = fully_shard.state(module)  # type: ignore[attr-defined]
            for each in state._state_ctx.all_states:
                for group in each._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()
