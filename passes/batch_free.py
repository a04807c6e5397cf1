"""Find the outputs that no batched input reaches: the same on every micro-batch.

Reads:  CAPTURE (the signature: each input's batch dimension, each output's), COST (random)
Writes: CAPTURE's signature.out_batch_free
Graph:  unchanged

A model may return, beside its per-example outputs, a tensor computed from its weights alone: a
learned temperature (`self.logit_scale.exp()`), a penalty on its weights for the loss to add, the
weights of a multi-task loss. Such an output has no batch dimension, yet unlike a loss the model
computes over the batch, every micro-batch computes the same value, so the batch's value is any
one of them (Signature.join_outputs) and a loss over micro-batches sees what the plain model's
loss sees. An output counts only where no batched input and no operation that draws random
numbers lies upstream of it (a dropout on a weight would draw one mask per micro-batch where the
plain model draws one); the others without a batch dimension stay refused for more than one
micro-batch (pipeline._check_joinable).
"""
from __future__ import annotations

from torch.fx import GraphModule, Node

from fxpipe import ir
from fxpipe.signature import Signature

__all__ = ["mark_batch_free_outputs"]


def mark_batch_free_outputs(gm: GraphModule) -> tuple[bool, ...]:
    """Marks and returns, per output leaf, whether it is batch-free (module docstring). Only
    outputs without a batch dimension are looked at; a model without them costs one scan of
    the output's arguments."""
    signature: Signature = gm.meta[ir.CAPTURE].signature
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    candidates = [i for i, (value, is_tensor, dim) in enumerate(zip(
        values, signature.out_is_tensor, signature.out_batch_dims))
        if is_tensor and dim is None and isinstance(value, Node)]
    free = [False] * len(signature.out_is_tensor)
    if candidates:
        batched = _batch_reached(gm, signature.input_batch_dims)
        for i in candidates:
            free[i] = values[i] not in batched
    signature.out_batch_free = marked = tuple(free)
    return marked


def _batch_reached(gm: GraphModule, input_dims: tuple[int | None, ...]) -> set[Node]:
    """The nodes that a batched input or a random draw reaches (each node's inputs come
    before it in the graph's order)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(input_dims):  # not the signature's inputs: assume all batched
        input_dims = (0,) * len(placeholders)
    reached = {n for n, dim in zip(placeholders, input_dims) if dim is not None}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if (ir.COST in node.meta and ir.cost(node).random) or \
                any(a in reached for a in node.all_input_nodes):
            reached.add(node)
    return reached
