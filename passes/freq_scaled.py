"""Find the embeddings whose gradient is scaled by how often each index occurs in the batch.

Reads:  the graph (embedding and embedding_bag calls, torch functions or aten operators)
Writes: nothing
Graph:  unchanged

`nn.Embedding(scale_grad_by_freq=True)` (and EmbeddingBag's) divides each row's gradient by the
number of times its index occurs in the batch. Its forward is per-example, so the capture's
check that the model is separable along the batch passes; only its backward couples the
examples. A pipeline runs the backward once per micro-batch, counting each micro-batch's
occurrences: the loss would be the plain model's and the embedding's gradient would not.
pipeline refuses such a model for more than one micro-batch, naming these modules.
"""
from __future__ import annotations

import inspect
from typing import Any

from torch.fx import GraphModule, Node

from fxpipe import ir

__all__ = ["freq_scaled_embeddings"]

_ARGUMENT = "scale_grad_by_freq"


def freq_scaled_embeddings(gm: GraphModule) -> list[str]:
    """The modules (or node names, outside any module) of the graph's embedding calls made
    with scale_grad_by_freq=True, in graph order, each once."""
    found = [ir.module_path(n) or n.name for n in gm.graph.nodes
             if n.op == "call_function" and "embedding" in _name(n.target)
             and _argument(n) is True]
    return list(dict.fromkeys(found))


def _name(target: Any) -> str:
    return str(getattr(target, "__name__", target))


def _argument(node: Node) -> Any:
    """scale_grad_by_freq as the call passes it (its default, False, when it does not)."""
    if _ARGUMENT in node.kwargs:
        return node.kwargs[_ARGUMENT]
    if not callable(node.target):
        return False
    schema = getattr(node.target, "_schema", None)  # an aten operator
    try:
        names = [a.name for a in schema.arguments] if schema is not None else \
            list(inspect.signature(node.target).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: not an embedding's
        return False
    if _ARGUMENT not in names:
        return False
    index = names.index(_ARGUMENT)
    return node.args[index] if index < len(node.args) else False
