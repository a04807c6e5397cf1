"""Readable node names: a captured graph's nodes named after the modules they come from."""
from __future__ import annotations

import operator
import re

import torch.fx as fx

from fxpipe import ir
from fxpipe.frontend.lazy_code import recompile_lazily

__all__ = ["name_nodes_after_modules"]


def name_nodes_after_modules(gm: fx.GraphModule) -> None:
    """Renames call nodes after the module they come from: `blocks_1_fc1` rather than `linear_3`.

    A module with a single call node lends it its name; a module with several gives them its name
    as a prefix (`blocks_1_attn_view`). fx numbers the nodes of an op across the whole graph
    (`gelu_3`); those counters are dropped, so a number in a name counts only within its module,
    and a few nodes are named after what they read: `idx_device` for `idx.device`,
    `attn_split_0` for `attn_split[0]`, `idx_size_1` for `idx.size(1)`. Placeholders and
    attributes keep their names.
    """
    groups: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            path = ir.module_path(node)
            if path:
                groups.setdefault(path, []).append(node)
    module_named: set[fx.Node] = set()  # named after their module alone: keep
    prefixed: set[fx.Node] = set()  # counters already dropped, numbered within the module
    for path, nodes in groups.items():
        base = re.sub(r"\W", "_", path)
        if base[0].isdigit():  # children of a top-level Sequential: "linear_0", not "_0"
            base = f"{_module_kind(gm, nodes[0], path)}_{base}"
        if len(nodes) == 1:
            nodes[0]._rename(base)
            module_named.add(nodes[0])
            continue
        for node in nodes:
            if not node.name.startswith(base):
                node._rename(f"{base}_{_without_counter(node)}")
                prefixed.add(node)
    for node in gm.graph.nodes:
        if node not in module_named:
            better = _derived_name(node, node in prefixed)
            if better is not None and better != node.name:
                node._rename(better)
    recompile_lazily(gm)  # the code is generated where it is used (fxpipe.frontend.lazy_code)


_COUNTER = re.compile(r"_\d+$")


def _without_counter(node: fx.Node) -> str:
    """The node's name without the number fx appended to tell repeated ops apart."""
    return _COUNTER.sub("", node.name) if node.op in ("call_function", "call_method") \
        else node.name


def _derived_name(node: fx.Node, prefixed: bool) -> str | None:
    """A name saying what the node reads, or (unless `prefixed` by its module already) its name
    without fx's counter."""
    source, key = (node.args[0], node.args[1]) if len(node.args) == 2 else (None, None)
    if node.op == "call_function" and node.target in (operator.getitem, getattr) \
            and isinstance(source, fx.Node):
        if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            return f"{source.name}_{key}"
        if isinstance(key, str) and key.isidentifier():
            return f"{source.name}_{key}"
    if node.op == "call_method" and node.target == "size" and isinstance(source, fx.Node) \
            and isinstance(key, int) and key >= 0:
        owner = _COUNTER.sub("", node.name) if prefixed else f"{source.name}_size"
        return f"{owner}_{key}"
    if node.op in ("call_function", "call_method") and not prefixed:
        return _without_counter(node)
    return None


def _module_kind(gm: fx.GraphModule, node: fx.Node, path: str) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    for value in stack.values():
        if isinstance(value, tuple) and ir.clean_module_path(str(value[0])) == path:
            kind = value[1]
            name = kind.__name__ if isinstance(kind, type) else str(kind).rpartition(".")[2]
            return re.sub(r"\W", "_", name).lower() or "module"
    try:
        return type(gm.get_submodule(path)).__name__.lower()
    except AttributeError:
        return "module"
