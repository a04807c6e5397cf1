"""Weight gradients a split backward's W computes itself, from one node's saved tensors and the
gradient I captured entering it, instead of one autograd call per group of weights.

W (fxpipe/runtime/execution/split_backward.py) would otherwise enter autograd's engine once per
group of weights (a linear's weight and bias, a norm's): on the bench GPT's last stage 26 calls
per micro-batch, each paying the engine's set-up for one or two small products. For the nodes
that make most of a transformer's weights, the gradient is one kernel of what the node saved
and the gradient entering it, the kernel autograd would run:

    AddmmBackward0, MmBackward0 (a linear)   dW = g^T @ x        db = g summed to b's shape
    NativeLayerNormBackward0                 aten.native_layer_norm_backward, weights only
    ConvolutionBackward0                     aten.convolution_backward, weights only

A layer norm's weights are better served by I (IN_INPUT_PASS): their gradients are reductions
over the same input, statistics and incoming gradient as the norm's input gradient, and
native_layer_norm_backward computes all three in one call when asked; W then only accumulates
what I computed. Where one of those weights carries a hook, W serves them as before.

A recipe applies where the graph from the node to its weights is the layer's own: a transpose
(TBackward0) or nothing, a dtype cast (autocast's ToCopyBackward0) or none, then the weight's
AccumulateGrad, and no other weight on the way. The callers vouch that no tensor hook sits on
the node's output (generated stage code registers none); hooks on the weights themselves
(replica averaging's) make W take the engine, which runs them (`hooked`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import Node

__all__ = ["IN_INPUT_PASS", "Recipe", "accumulate", "add_weight_grads", "hooked", "recipe_for",
           "saved_for"]

_ACCUMULATE = "torch::autograd::AccumulateGrad"
_CAST = "ToCopyBackward0"
_TRANSPOSE = "TBackward0"

# node kind -> (input position of each weight role, and whether its path starts transposed)
_ROLES: dict[str, dict[str, tuple[int, bool]]] = {
    "AddmmBackward0": {"weight": (2, True), "bias": (0, False)},
    "MmBackward0": {"weight": (1, True)},
    "NativeLayerNormBackward0": {"weight": (1, False), "bias": (2, False)},
    "ConvolutionBackward0": {"weight": (1, False), "bias": (2, False)},
}

# the recipes whose weights I computes, in the kernel call that makes the node's input gradient
IN_INPUT_PASS = frozenset({"NativeLayerNormBackward0"})


@dataclass(frozen=True)
class Recipe:
    """How W computes the gradients of one group's weights from its node: the node's kind, and
    per weight of the group (in the group's order) its role and whether a cast lies between."""

    kind: str
    roles: tuple[str, ...]
    casts: tuple[bool, ...]


def recipe_for(node: Node, weights: list[Node], closure: set[Node]) -> Recipe | None:
    """The recipe of `node` for `weights` (AccumulateGrad nodes), or None where the graph
    between them is not one of the layers above, or where another of the node's inputs leads
    anywhere but into `closure` (the input gradient's part, which I runs: a path from there to
    a weight would add to its gradient)."""
    roles = _ROLES.get(node.name())
    if roles is None or len(weights) > len(roles):
        return None
    if node.name() == "AddmmBackward0" and (getattr(node, "_saved_alpha", None) != 1
                                            or getattr(node, "_saved_beta", None) != 1):
        return None
    found: dict[Node, tuple[str, bool]] = {}
    edges = node.next_functions
    positions = {position: (role, transposed) for role, (position, transposed) in roles.items()}
    for position, (start, _) in enumerate(edges):
        if start is None:
            continue
        end, cast = _weight_at(start, positions[position][1]) if position in positions \
            else (None, False)
        if end is None or end in found:
            if start not in closure:
                return None
            continue
        found[end] = (positions[position][0], cast)
    if set(found) != set(weights):
        return None
    return Recipe(node.name(), tuple(found[w][0] for w in weights),
                  tuple(found[w][1] for w in weights))


def _weight_at(start: Node, transposed: bool) -> tuple[Node | None, bool]:
    """The AccumulateGrad at the end of a layer's own path from `start` ([transpose,] [cast,]
    accumulate, each node with one input), and whether a cast lies on it."""
    node: Node | None = start
    cast = False
    if transposed:
        if start.name() != _TRANSPOSE:
            return None, False
        node = _only_child(start)
    if node is not None and node.name() == _CAST:
        node, cast = _only_child(node), True
    if node is None or node.name() != _ACCUMULATE:
        return None, False
    return node, cast


def _only_child(node: Node) -> Node | None:
    children = [c for c, _ in node.next_functions]
    return children[0] if len(children) == 1 else None


def saved_for(recipe: Recipe, node: Node) -> tuple[Any, ...]:
    """What `add_weight_grads` reads of `node` (its saved tensors and arguments), read now: a
    split backward that frees the graph in I reads them before. Reading a saved tensor of a
    remat region recomputes the region (once per graph-execution group, see
    split_backward._one_recompute)."""
    rows_at = _ROWS.get(recipe.kind)
    if rows_at is not None:
        return (getattr(node, rows_at),)  # a linear's input x, as saved
    return tuple(getattr(node, f"_saved_{name}") for name in _SAVED[recipe.kind])


def add_weight_grads(recipe: Recipe, saved: tuple[Any, ...], grad: torch.Tensor,
                     weights: tuple[torch.Tensor, ...], chosen: set[int] | None) -> None:
    """Adds the gradient of each of `weights` (the group's, in its order) that requires one
    (and is `chosen`, by id, where given) into its .grad, from what its node saved
    (`saved_for`) and the gradient that entered the node. A linear's weight that holds a
    gradient already (of an earlier micro-batch) takes the product in the same kernel (addmm_),
    without a temporary of its size and a separate addition."""
    linear = recipe.kind in _ROWS  # a linear's (most of W): the product and the bias's sum
    grads = None if linear else _kernel_grads(recipe, saved, grad, weights)
    for k, (role, cast, weight) in enumerate(zip(recipe.roles, recipe.casts, weights)):
        if not weight.requires_grad or (chosen is not None and id(weight) not in chosen):
            continue
        if grads is not None:
            accumulate(weight, grads[k])
        elif role == "weight" and not cast and weight.grad is not None:
            weight.grad.addmm_(grad.t(), saved[0])
        else:
            accumulate(weight, _linear_grad(role, cast, weight, grad, saved[0]))


def _kernel_grads(recipe: Recipe, saved: tuple[Any, ...], grad: torch.Tensor,
                  weights: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """A norm's or a convolution's weight gradients, from its backward kernel asked for them
    alone."""
    want = ["weight" in recipe.roles, "bias" in recipe.roles]
    kernel = torch.ops.aten.native_layer_norm_backward \
        if recipe.kind == "NativeLayerNormBackward0" else torch.ops.aten.convolution_backward
    _, dw, db = kernel(grad, *saved, [False, *want])
    by_role = {"weight": dw, "bias": db}
    return [by_role[role].to(weight.dtype) if cast else by_role[role]
            for role, cast, weight in zip(recipe.roles, recipe.casts, weights)]


def _linear_grad(role: str, cast: bool, weight: torch.Tensor, grad: torch.Tensor,
                 rows: torch.Tensor) -> torch.Tensor:
    """A linear's weight or bias gradient, from its input rows and the gradient entering it."""
    if role == "weight":
        g = grad.t().mm(rows)  # (x^T g)^T: mat2's gradient, transposed
    else:  # the engine sums the gradient of a broadcast bias so
        g = grad.sum_to_size(weight.shape)
        g = g.clone() if g is grad else g  # never .grad aliasing the gradient given
    return g.to(weight.dtype) if cast else g


_ROWS = {"AddmmBackward0": "_saved_mat1", "MmBackward0": "_saved_self"}
# the saved tensors and arguments of the norm's and the convolution's backward kernels
_SAVED = {"NativeLayerNormBackward0": ("input", "normalized_shape", "result1", "result2",
                                       "weight", "bias"),
          "ConvolutionBackward0": ("input", "weight", "bias_sym_sizes_opt", "stride", "padding",
                                   "dilation", "transposed", "output_padding", "groups")}


def hooked(weights: Sequence[torch.Tensor]) -> bool:
    """Whether accumulating into one of `weights` must run hooks (a tensor hook, or one after
    its gradient accumulates: replica averaging's), which only the engine runs."""
    for weight in weights:  # a loop, not any(): W checks every group of every micro-batch
        if weight._backward_hooks or weight._post_accumulate_grad_hooks:
            return True
    return False


def accumulate(weight: torch.Tensor, grad: torch.Tensor) -> None:
    """Adds `grad` into weight.grad as AccumulateGrad does outside a differentiable backward:
    the first gradient becomes .grad, later ones are added in place."""
    if weight.grad is None:
        weight.grad = grad if grad.stride() == weight.stride() else \
            torch.empty_like(weight).copy_(grad)
    else:
        weight.grad.add_(grad)
