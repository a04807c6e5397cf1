"""What a built program's stages compute, hold and exchange, as the report and the stage
headers state it: per stage its forward FLOPs, weights, saved and kept activations and the
bytes it receives and sends; per step the activations held at the peak and the bytes moved."""
from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from fxpipe import ir
from fxpipe.built import Built
from fxpipe.passes.remat import RematRegion, kept_bytes
from fxpipe.passes.split import StageGraph

__all__ = ["communication", "predicted_kept", "stage_figures", "value_bytes", "weight_pass_kept"]


def _at(expr: ir.Expr, b: int) -> float:
    return float(ir.evaluate(expr, b))


def value_bytes(info: ir.ValueInfo, b: int) -> float:
    if isinstance(info, ir.TensorInfo):
        return _at(info.nbytes, b)
    if isinstance(info, tuple):
        return sum(value_bytes(i, b) for i in info)
    return 8.0


def _stage_nodes(graph: StageGraph) -> list[Node]:
    return [n for n in ir.compute_nodes(graph.graph_module.graph) if ir.COST in n.meta]


def stage_figures(graph: StageGraph, regions: Sequence[RematRegion], b: int) -> dict[str, float]:
    """A stage's figures at micro-batch size b (bytes and FLOPs): its forward FLOPs, weights,
    saved activations and what remat keeps of them, and the bytes it receives and sends."""
    nodes = _stage_nodes(graph)
    saved = kept_bytes(nodes, b)
    in_region = {name for r in regions for name in r.nodes}
    outside = kept_bytes([n for n in nodes if n.name not in in_region], b)
    kept = outside + sum(r.kept_bytes for r in regions)
    params = sum(p.numel() * p.element_size() for p in graph.graph_module.parameters())
    return {
        "fwd_flops": sum(_at(ir.cost(n).fwd_flops, b) for n in nodes),
        "params": float(params),
        "param_count": float(sum(p.numel() for p in graph.graph_module.parameters())),
        "saved": saved,
        "kept_with_remat": min(kept, saved) if regions else saved,
        "recv_bytes": sum(value_bytes(c.value, b) for c in graph.recvs),
        "send_bytes": sum(value_bytes(c.value, b) for c in graph.sends),
    }


# the layers whose weights a split backward's W computes itself (or asks of I: a norm's), by
# the positions of their weight and bias among the call's arguments
# (fxpipe/runtime/execution/weight_recipes.py)
_WEIGHT_LAYERS: dict[Any, tuple[int, int]] = {
    F.linear: (1, 2), F.conv1d: (1, 2), F.conv2d: (1, 2), F.conv3d: (1, 2),
    F.layer_norm: (2, 3)}
_LAYERS_READ_BY_W = set(_WEIGHT_LAYERS) - {F.layer_norm}  # their inputs stay for W


def weight_pass_kept(graph: StageGraph, b: int) -> float | None:
    """Bytes a micro-batch of this stage keeps from a split backward's I to its W where I frees
    the graph (fxpipe/runtime/execution/split_backward.py: no remat recompute, every weight's
    gradient computed by W itself): the inputs its linears and convolutions saved. None where
    W needs the graph: a stage that receives no gradient-carrying value (its W is a whole
    backward), or a trainable weight used other than once by one such layer."""
    if not any(ir.carries_grad(leaf) for c in graph.recvs for leaf in ir.leaves(c.value)):
        return None
    gm = graph.graph_module
    users: dict[int, list[tuple[Node, Node]]] = {}  # weight -> (reading node, user)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(str(node.target))(gm)
            if isinstance(value, nn.Parameter) and value.requires_grad:
                users.setdefault(id(value), []).extend((node, u) for u in node.users)
    layers = set()
    for uses in users.values():
        if len(uses) != 1:
            return None
        read, user = uses[0]
        positions = _WEIGHT_LAYERS.get(user.target) if user.op == "call_function" else None
        if positions is None or _argument_position(user, read) not in positions:
            return None
        layers.add(user)
    inputs: dict[str, float] = {}  # producer -> bytes, each value once
    for node in _stage_nodes(graph):
        if node in layers and node.target in _LAYERS_READ_BY_W:  # (a frozen layer has no W)
            for producer, nbytes in ir.cost(node).saves:
                inputs[producer] = _at(nbytes, b)
    return sum(inputs.values())


def _argument_position(node: Node, arg: Node) -> int | None:
    """Where `arg` sits among the arguments of `node`, a layer of _WEIGHT_LAYERS (a keyword
    `weight` or `bias` by its place there), if once."""
    weight, bias = _WEIGHT_LAYERS[node.target]
    names = {"weight": weight, "bias": bias}
    found = [i for i, a in enumerate(node.args) if a is arg] + \
        [names.get(k, -1) for k, a in node.kwargs.items() if a is arg]
    return found[0] if len(found) == 1 else None


def predicted_kept(built: Built) -> list[float]:
    """Activation bytes each stage's forwards hold after all forwards of a GPipe step (its
    peak; what program.measure_activations measures, which runs no loss), as the remat policy
    counts them."""
    plan = built.plan
    m, b = built.spec.chunks, plan.microbatch_size
    out = []
    for st in built.stages:
        figures = stage_figures(st.graph, st.regions, b)
        out.append(built.config.remat_policy.kept_at_peak(figures["saved"],
                                                          figures["kept_with_remat"], m, m))
    return out


def communication(built: Built, replicas: int = 1) -> dict[str, float]:
    """Bytes moved per training step: point-to-point (activations forward, gradients back) in
    one pipeline, the data-parallel gradient all-reduce per replica (ring: 2(R-1)/R of each
    stage's gradients) and the tied-weight gradient all-reduce."""
    plan = built.plan
    m = built.spec.chunks
    b = max(1, plan.microbatch_size // replicas)  # each replica pipelines its share of the batch
    rank_of = built.spec.placement
    p2p = 0.0
    for st in built.stages:
        for c in st.graph.sends:
            if rank_of[st.index] == rank_of[c.peer]:
                continue  # two stages of one rank: handed over in the process
            size = value_bytes(c.value, b)
            grads = size if isinstance(c.value, ir.TensorInfo) and c.value.is_float \
                and c.value.requires_grad else 0.0
            p2p += m * (size + grads)
    grads = sum(float(p.numel() * p.element_size()) for st in built.stages
                for p in st.graph_module.parameters() if p.requires_grad)
    tied = sum(float(p.numel() * p.element_size()) * (len({rank_of[s] for s in stages}) - 1)
               for name, stages in built.shared.items()
               for p in [_tied_param(built, name)] if p is not None)
    out = {"point-to-point": p2p, "tied-weight all-reduce": tied}
    if replicas > 1:
        out["data-parallel all-reduce"] = 2 * (replicas - 1) / replicas * grads
    return out


def _tied_param(built: Built, name: str) -> nn.Parameter | None:
    for st in built.stages:
        for target, value in st.graph_module.named_parameters(remove_duplicate=False):
            if target == name:
                return value
    return None
