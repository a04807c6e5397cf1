"""A step's target: one tensor, or several in a tuple, list or dict (a multi-task loss's class
labels and boxes), each split along the batch dimension as the inputs are. The loss function
gets each micro-batch's part in the same structure; a leaf that is not a tensor (a Python
number) goes to every micro-batch as it is. None: a loss of the outputs alone."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxpipe.errors import RuntimeInputError

__all__ = ["Target", "check_target", "check_tensor", "split_target", "narrow_target", "map_target",
           "target_tensors", "is_structured"]

Target = Any  # torch.Tensor, a tuple, list or dict of them, or None


def is_structured(target: Target) -> bool:
    """Whether the target is not one tensor (nor None)."""
    return target is not None and not isinstance(target, torch.Tensor)


def target_tensors(target: Target) -> list[tuple[str, torch.Tensor]]:
    """Each tensor of the target with its name as the loss reads it: "target", "target[0]",
    "target['boxes']"."""
    if target is None or isinstance(target, torch.Tensor):
        return [] if target is None else [("target", target)]
    paths, _ = pytree.tree_flatten_with_path(target)
    return [(f"target{pytree.keystr(path)}", leaf) for path, leaf in paths
            if isinstance(leaf, torch.Tensor)]


def check_target(target: Target, batch_dim: int, batch: int, *,
                 only_batched: bool = False) -> None:
    """Refuses a target with a tensor whose batch is not the inputs' (a step splits both
    alike); with `only_batched`, tensors with no dimension `batch_dim` at all are left out."""
    for name, t in target_tensors(target):
        if not (only_batched and t.dim() <= batch_dim):
            check_tensor(name, t, batch_dim, batch, structured=is_structured(target))


def check_tensor(name: str, t: torch.Tensor, batch_dim: int, batch: int, *,
                 structured: bool = False) -> None:
    """Refuses one tensor of a target (named `name`) whose batch is not the inputs'."""
    if t.dim() <= batch_dim or t.shape[batch_dim] != batch:
        raise RuntimeInputError(
            f"{name} shape {tuple(t.shape)} has no batch dimension {batch_dim} of size "
            f"{batch}, the inputs' batch",
            hint="give the target the same batch size as the inputs, along the batch "
                 "dimension of the model's first output"
                 + (" (each tensor of a structured target)" if structured else ""))


def split_target(target: Target, chunks: int, batch_dim: int, batch: int) -> list[Target]:
    """The target's micro-batches along the outputs' batch dimension, as the inputs split."""
    if target is None:
        return [None] * chunks
    if isinstance(target, torch.Tensor):  # a step's: as few calls as the check needs
        check_tensor("target", target, batch_dim, batch)
        return list(target.tensor_split(chunks, dim=batch_dim))
    check_target(target, batch_dim, batch)
    leaves, spec = pytree.tree_flatten(target)
    parts = [t.tensor_split(chunks, dim=batch_dim) if isinstance(t, torch.Tensor)
             else (t,) * chunks for t in leaves]
    return [pytree.tree_unflatten([p[mb] for p in parts], spec) for mb in range(chunks)]


def narrow_target(target: Target, batch_dim: int, start: int, size: int) -> Target:
    """Examples start .. start + size of every tensor of the target (a replica's share)."""
    return map_target(lambda t: t.narrow(batch_dim, start, size), target)


def map_target(fn: Callable[[torch.Tensor], torch.Tensor], target: Target) -> Target:
    """`fn` on each tensor of the target, in its structure."""
    if target is None or isinstance(target, torch.Tensor):
        return fn(target) if target is not None else None
    return pytree.tree_map_only(torch.Tensor, fn, target)
