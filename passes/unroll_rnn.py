"""Stacked recurrent layers become one operation per layer, so stages can be cut between them.

Reads:  TENSOR (fxpipe.capture)
Writes: TENSOR on the nodes it adds
Graph:  rewrites in place: aten.lstm / gru / rnn_tanh / rnn_relu with num_layers = L > 1 become
        L single-layer calls of the same op, chained (with the inter-layer dropout as its own
        node when training with p > 0), their final states concatenated as the stacked op
        returns them

The rewrite is exact: eager PyTorch runs a stacked RNN layer by layer with the same kernels, in
the same order, and draws the dropout masks between the layers in that order. A stacked nn.LSTM
is otherwise one node that no cut can enter, which can leave stages far apart. Run on the
captured graph before the costs.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy  # type: ignore[import-untyped]  # sympy ships no type annotations
import torch
from torch.fx import GraphModule, Node

from fxpipe import ir

__all__ = ["unroll_rnns", "has_stacked_rnns"]

_aten = torch.ops.aten
_RNNS = {_aten.lstm.input: 2, _aten.gru.input: 1, _aten.rnn_tanh.input: 1,
         _aten.rnn_relu.input: 1}  # op -> number of state tensors (LSTM: h and c)


@dataclass(frozen=True)
class _Stacked:
    """The arguments of one stacked RNN call."""

    x: Node
    states: list[Node]  # h0 (and c0), each (layers * directions, B, H)
    params: list[Node]
    has_biases: bool
    layers: int
    dropout: float
    train: bool
    bidirectional: bool
    batch_first: bool

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1


def _stacked(node: Node) -> _Stacked | None:
    """The call's arguments, when it is a stacked RNN this pass can unroll."""
    if node.op != "call_function" or node.target not in _RNNS or len(node.args) != 9:
        return None
    x, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = node.args
    states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    if not isinstance(x, Node) or not isinstance(params, (list, tuple)) \
            or not isinstance(layers, int) or layers < 2 \
            or not all(isinstance(n, Node) for n in [*states, *params]):
        return None
    call = _Stacked(x, states, list(params), bool(has_biases), layers,  # type: ignore[arg-type]
                    float(dropout), bool(train), bool(bidirectional),  # type: ignore[arg-type]
                    bool(batch_first))
    per_layer = (4 if call.has_biases else 2) * call.directions
    if len(call.params) != per_layer * layers:  # projections (proj_size) are left alone
        return None
    return call


def has_stacked_rnns(gm: GraphModule) -> bool:
    """Whether unroll_rnns may rewrite `gm` (it rewrites no other graph)."""
    return any(_stacked(node) is not None for node in gm.graph.nodes)


def unroll_rnns(gm: GraphModule) -> int:
    """Rewrites every stacked RNN call in `gm`; returns how many were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        call = _stacked(node)
        users = list(node.users)
        if call is None or not all(u.target is operator.getitem and isinstance(u.args[1], int)
                                   for u in users):
            continue
        outputs = _unroll(gm, node, call)
        for user in users:
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _unroll(gm: GraphModule, node: Node, call: _Stacked) -> list[Node]:
    """The layer-by-layer calls before `node`; returns what its outputs become."""
    graph = gm.graph
    infos = node.meta[ir.TENSOR]
    out_info, state_infos = infos[0], infos[1:]
    layer_state_infos = [_with_first_dim(i, call.directions) for i in state_infos]
    per_layer = len(call.params) // call.layers
    x = call.x
    finals: list[list[Node]] = [[] for _ in call.states]
    with graph.inserting_before(node):
        for layer in range(call.layers):
            if layer and call.dropout and call.train:
                x = _add(graph, node, _aten.dropout.default, (x, call.dropout, True), out_info,
                         f"{node.name}_dropout_{layer}")
            lo, hi = layer * call.directions, (layer + 1) * call.directions
            states = [_add(graph, node, _aten.slice.Tensor, (s, 0, lo, hi), info,
                           f"{node.name}_state_{layer}")
                      for s, info in zip(call.states, layer_state_infos)]
            hx = states if len(call.states) > 1 else states[0]
            params = call.params[layer * per_layer:(layer + 1) * per_layer]
            args = (x, hx, params, call.has_biases, 1, 0.0, call.train, call.bidirectional,
                    call.batch_first)
            step = _add(graph, node, node.target, args, (out_info, *layer_state_infos),
                        f"{node.name}_layer_{layer}")
            x = _add(graph, node, operator.getitem, (step, 0), out_info, f"{step.name}_out")
            for k in range(len(call.states)):
                finals[k].append(_add(graph, node, operator.getitem, (step, k + 1),
                                      layer_state_infos[k], f"{step.name}_state"))
        joined = [_add(graph, node, _aten.cat.default, (parts, 0), info, f"{node.name}_state")
                  for parts, info in zip(finals, state_infos)]
    return [x, *joined]


def _add(graph: torch.fx.Graph, like: Node, target: object, args: tuple[object, ...],
         info: ir.ValueInfo, name: str) -> Node:
    new = graph.call_function(target, args)  # type: ignore[arg-type]
    new.meta = {k: v for k, v in like.meta.items() if k not in (ir.TENSOR, "val")}
    new.meta[ir.TENSOR] = info
    new._rename(name)
    return new


def _with_first_dim(info: ir.TensorInfo, size: int) -> ir.TensorInfo:
    return ir.TensorInfo((sympy.Integer(size), *info.shape[1:]), info.dtype, info.batch_dim,
                         info.requires_grad)
