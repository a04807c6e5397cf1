"""Random draws as zeros, for the batch-dimension search of a model that draws noise in eval mode.

The search (fxpipe.frontend.batching) runs the model on the batch and on two halves of it and
compares. A draw of noise over the batch (a VAE's `mu + std * torch.randn_like(std)`, a
diffusion model's noise and timesteps) gives other numbers on a half than on the same rows of the
whole batch, although no example reads another: micro-batches are then as right as the batch,
but no dimension looked separable. Under `NoiseAsZeros()` every random operation (those torch
tags `nondeterministic_seeded`) returns zeros, so the model computes the same deterministic
function of each example on any batch. Zeros keep mixing visible: a random index into the
batch (`randperm`, `randint`) becomes index 0, the first example of each half, which is not the
first of the whole batch.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NoiseAsZeros"]


class NoiseAsZeros(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch unannotated
    """Runs every random operation, then hands back zeros of its result's shape and dtype (an
    in-place one zeroes its tensor). `drew` tells whether any ran."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.drew = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return result
        self.drew = True
        if func._schema.is_mutable:  # normal_, uniform_, bernoulli_: the tensor written
            return pytree.tree_map_only(torch.Tensor, lambda t: t.zero_(), result)
        return pytree.tree_map_only(torch.Tensor, torch.zeros_like, result)
