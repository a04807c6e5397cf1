"""Defer BatchNorm running statistics to the end of the batch.

Reads:  TENSOR (fxpipe.capture)
Writes: nothing new; rewrites the graph in place
Graph:  train-mode batch_norm calls that update running statistics become
        fxpipe.runtime.execution.batchnorm.deferred_batch_norm; their num_batches_tracked += 1 is
        dropped (the commit does it once per batch)

Run on the captured graph before partitioning (the rewritten op costs what batch_norm costs).
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from fxpipe.errors import ConfigError
from fxpipe.runtime.execution.batchnorm import cumulative_batch_norm, deferred_batch_norm

__all__ = ["defer_batch_norm"]

_ATEN_BN = torch.ops.aten.batch_norm.default


def _is_counter_increment(node: Node) -> bool:
    """num_batches_tracked.add_(1) as fx (call_method add_) or export (aten.add_) spells it."""
    target = node.args[0] if node.args else None
    if not isinstance(target, Node) or target.op != "get_attr":
        return False
    if not str(target.target).endswith("num_batches_tracked"):
        return False
    return (node.op == "call_method" and node.target == "add_") or \
        node.target in (torch.ops.aten.add_.Tensor, operator.iadd)


def _counter_for(gm: GraphModule, running_mean: Node) -> Node | None:
    owner = str(running_mean.target).rpartition(".")[0]
    name = f"{owner}.num_batches_tracked" if owner else "num_batches_tracked"
    node: Node
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target == name:
            return node
    return None


def defer_batch_norm(gm: GraphModule) -> int:
    """Rewrites train-mode BatchNorm calls; returns how many were deferred."""
    rewritten = 0
    counters: set[str] = set()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is cumulative_batch_norm:
            raise ConfigError(f"{node.name}: BatchNorm with momentum=None (cumulative average) "
                              "cannot be deferred",
                              hint="set a momentum, or deferred_batch_norm=False")
        if node.op != "call_function" or node.target not in (F.batch_norm, _ATEN_BN):
            continue
        if node.target is F.batch_norm:
            names = ["input", "running_mean", "running_var", "weight", "bias", "training",
                     "momentum", "eps"]
            defaults = {"weight": None, "bias": None, "training": False, "momentum": 0.1,
                        "eps": 1e-5}
        else:
            names = ["input", "weight", "bias", "running_mean", "running_var", "training",
                     "momentum", "eps", "cudnn_enabled"]
            defaults = {}
        bound = dict(zip(names, node.args))
        bound.update(node.kwargs)
        for key, value in defaults.items():
            bound.setdefault(key, value)
        if not bound.get("training") or bound.get("running_mean") is None:
            continue
        if bound.get("momentum") is None:
            raise ConfigError(f"{node.name}: BatchNorm with momentum=None (cumulative average) "
                              "cannot be deferred",
                              hint="set a momentum, or deferred_batch_norm=False")
        counter = _counter_for(gm, bound["running_mean"])
        if counter is not None:
            counters.add(str(counter.target))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(deferred_batch_norm, (
                bound["input"], bound["running_mean"], bound["running_var"], bound["weight"],
                bound["bias"], counter, float(bound["momentum"]), float(bound["eps"])))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        rewritten += 1
    for node in list(gm.graph.nodes):
        if (node.op in ("call_method", "call_function") and _is_counter_increment(node)
                and str(node.args[0].target) in counters and not node.users):
            gm.graph.erase_node(node)
    gm.recompile()
    return rewritten
