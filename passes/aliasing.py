"""Which values of a graph share storage, and which operations write into them.

An in-place write (`x.add_(y)`, `out[:, t] = v`, `out=`) changes every value that shares the
written tensor's storage: the tensor itself and its views. Remat must know, so as not to
recompute from a value rewritten after it was read. Aten operations say what they alias and
write in their schema; torch-level ones (fx graphs) are known by name.
"""
from __future__ import annotations

import operator

from torch.fx import Graph, GraphModule, Node

from fxpipe import ir

__all__ = ["written_by", "aliased_by", "storage_roots", "rewritten_later"]


# torch-level operations whose output may share its input's storage (fx symbolic trace; aten
# operations say so in their schema)
_VIEWS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "narrow", "select",
          "unsqueeze", "squeeze", "expand", "expand_as", "flatten", "unflatten", "split",
          "chunk", "unbind", "t", "movedim", "swapaxes", "diagonal", "as_strided", "detach",
          "contiguous", "to", "type", "float", "real", "imag", "unfold", "getitem",
          "__getitem__", "view_as_real", "view_as_complex", "alias", "tensor_split"}
_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul,
                      operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
                      operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul}


def _name(node: Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def written_by(node: Node) -> list[Node]:
    """The values a node writes into."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is not None:
        by_name = dict(zip((a.name for a in schema.arguments), node.args))
        by_name.update(node.kwargs)
        return [v for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
                for v in [by_name.get(a.name)] if isinstance(v, Node)]
    written = [v for v in [node.kwargs.get("out")] if isinstance(v, Node)]
    if node.target in _INPLACE_OPERATORS or ir.is_inplace(node):
        first = node.args[0] if node.args else node.kwargs.get("input")
        written += [first] if isinstance(first, Node) else []
    return written


def aliased_by(node: Node) -> list[Node]:
    """The inputs whose storage the node's output may share."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is not None:
        if not any(r.alias_info is not None for r in schema.returns):
            return []
        return [v for a, v in zip(schema.arguments, node.args)
                if a.alias_info is not None and isinstance(v, Node)]
    if node.target in _INPLACE_OPERATORS or ir.is_inplace(node):
        return written_by(node)
    if node.op in ("call_method", "call_function") and _name(node) in _VIEWS and node.args:
        first = node.args[0]
        return [first] if isinstance(first, Node) else []
    return []


def rewritten_later(gm: GraphModule) -> set[Node]:
    """Operations that read a tensor which an operation after them writes in place (the tensor
    itself or a view sharing its storage): they must not be recomputed."""
    roots = storage_roots(gm.graph)
    order = list(gm.graph.nodes)
    last_write: dict[Node, int] = {}
    for i, node in enumerate(order):
        for value in written_by(node):
            last_write[roots[value]] = i
    return {node for i, node in enumerate(order)
            if any(last_write.get(roots[a], -1) > i for a in node.all_input_nodes)}


def storage_roots(graph: Graph) -> dict[Node, Node]:
    """Each node -> the first value whose storage it may share (itself when none)."""
    root: dict[Node, Node] = {}

    def find(n: Node) -> Node:
        while root.get(n, n) is not n:
            n = root[n]
        return n

    for node in graph.nodes:
        for source in aliased_by(node):
            root[find(node)] = find(source)
    return {node: find(node) for node in graph.nodes}
