"""Cut a partitioned graph into one GraphModule per stage, joined by explicit send/recv nodes.

Reads:  STAGE (passes.partition), TENSOR (fxpipe.capture), COST (which nodes draw random numbers)
Writes: COMM on the send and recv nodes of each stage graph
Graph:  returns new GraphModules; the input graph is left untouched

Each stage graph is `forward(comm, *model_inputs_it_uses)`:

    comm, x            placeholders: the communicator, then model inputs the stage reads
    h = recv(comm, "h", src=0)          values from earlier stages, at the top
    ... the stage's compute nodes, in program order ...
    send(comm, y, "y", dst=2)           values later stages need, at the bottom, one per peer
    return (out0, out1)                 the model's flat outputs (last stage), else None

A value used by several later stages is sent directly to each (no relaying). Model inputs are
read where they are needed (every rank is given the batch). Non-tensor values that cross are
folded into the consumer when they are constants or computed from model inputs alone (sizes of
inputs); others are sent. Parameters and buffers keep their qualified names; one that several
stages use (tied weights) appears in each, and `StageGraph.shared` says which. When a stage
after the first draws random numbers, each stage up to it hands its micro-batch's generator state
to the next (see NOTE [Random streams across stages] in fxpipe.runtime.ops).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import sympy  # type: ignore[import-untyped]  # sympy ships no type annotations
import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx._lazy_graph_module import _LazyGraphModule

from fxpipe import ir
from fxpipe.errors import SplitError
from fxpipe.passes.aliasing import storage_roots, written_by
from fxpipe.runtime.ops import RNG_STATE_BYTES, RNG_TAG, continue_rng, hand_over_rng, recv, send

__all__ = ["split_stages", "StageGraph", "shared_parameters"]


@dataclass(frozen=True)
class StageGraph:
    index: int
    graph_module: GraphModule
    inputs: tuple[str, ...]  # model inputs (placeholder names) this stage reads
    recvs: tuple[ir.CommInfo, ...]
    sends: tuple[ir.CommInfo, ...]
    attrs: tuple[str, ...]  # parameter / buffer targets
    is_last: bool
    carries_rng: bool = False  # continues or hands over a micro-batch's random stream


def _stage_of(node: Node) -> int | None:
    return node.meta.get(ir.STAGE)


def _is_constant(info: ir.ValueInfo | None) -> bool:
    if isinstance(info, ir.ScalarInfo):
        v = info.value
        return not hasattr(v, "free_symbols") or not v.free_symbols
    if isinstance(info, tuple):
        return all(_is_constant(i) for i in info)
    return False


def _constant(info: ir.ValueInfo | None) -> Any:
    """The Python value of a ValueInfo that _is_constant accepts."""
    if isinstance(info, tuple):
        return tuple(_constant(i) for i in info)
    if not isinstance(info, ir.ScalarInfo):
        raise TypeError(f"{info!r} is not a constant")
    v = info.value
    if hasattr(v, "is_Integer") and v.is_Integer:
        return int(v)
    if hasattr(v, "is_Float") and (v.is_Float or v.is_Rational):
        return float(v)
    if hasattr(v, "is_Boolean") and v in (sympy.true, sympy.false):
        return bool(v)
    return v


def _duplicable(node: Node, memo: dict[Node, bool]) -> bool:
    """A non-tensor value computed from model inputs and constants only (e.g. x.size(0))."""
    if node in memo:
        return memo[node]
    if node.op in ("placeholder", "get_attr"):
        result = True
    elif node.op in ("call_function", "call_method"):
        info = node.meta.get(ir.TENSOR)
        result = not isinstance(info, ir.TensorInfo) and not (
            isinstance(info, tuple) and any(isinstance(i, ir.TensorInfo) for i in info)
        ) and all(_duplicable(a, memo) for a in node.all_input_nodes)
    else:
        result = False
    memo[node] = result
    return result


class _StageBuilder:
    def __init__(self, gm: GraphModule, index: int, num_stages: int) -> None:
        self.gm = gm
        self.index = index
        self.last = index == num_stages - 1
        self.graph = Graph()
        self.env: dict[Node, Any] = {}
        self.comm = self.graph.placeholder("comm")
        # the communicator itself: no value crosses, so it is recorded as a non-tensor None
        self.comm.meta[ir.COMM] = ir.CommInfo("channel", -1, "comm", ir.ScalarInfo(None))
        self.inputs: list[str] = []
        self.attrs: list[str] = []
        self.recvs: list[ir.CommInfo] = []
        self.dup_memo: dict[Node, bool] = {}

    def value(self, node: Node) -> Any:
        """The stage-local stand-in for `node`'s value (materialised on first use)."""
        if node in self.env:
            return self.env[node]
        if node.op == "placeholder":
            raise SplitError(f"model input {node.name} is not declared in stage {self.index}",
                             hint="this is a bug in split_stages")
        if node.op == "get_attr":
            target = str(node.target)
            new = self.graph.get_attr(target)
            new.meta = dict(node.meta)
            self.attrs.append(target)
            self.env[node] = new
            return new
        info = node.meta.get(ir.TENSOR)
        if _is_constant(info):
            self.env[node] = _constant(info)
        elif _duplicable(node, self.dup_memo):
            new = self.graph.node_copy(node, self.value)
            new.meta = {k: v for k, v in node.meta.items() if k != ir.STAGE}
            self.env[node] = new
        else:
            raise SplitError(f"{node.name} from stage {_stage_of(node)} has no recv in stage "
                             f"{self.index}", hint="this is a bug in split_stages")
        return self.env[node]

    def add_inputs(self, placeholders: Sequence[Node], needed: set[Node]) -> None:
        for node in placeholders:
            if node in needed:
                new = self.graph.placeholder(node.name)
                new.meta = dict(node.meta)
                self.env[node] = new
                self.inputs.append(node.name)

    def add_recv(self, node: Node) -> None:
        src = _stage_of(node)
        if src is None:
            raise SplitError(f"{node.name} is received but has no stage",
                             hint="this is a bug in split_stages")
        info = ir.CommInfo("recv", src, node.name, node.meta[ir.TENSOR])
        new = self.graph.call_function(recv, (self.comm, node.name), {"src": info.peer})
        new._rename(node.name)
        new.meta = {ir.TENSOR: node.meta[ir.TENSOR], ir.COMM: info}
        self.env[node] = new
        self.recvs.append(info)

    def add_compute(self, node: Node) -> None:
        self.env[node] = self.graph.node_copy(node, self.value)  # its meta a copy of node's
        if node.op == "call_module" and str(node.target) not in self.attrs:
            self.attrs.append(str(node.target))  # a leaf module the stage calls whole

    def add_rng_recv(self, src: int) -> None:
        info = ir.CommInfo("recv", src, RNG_TAG, _RNG_STATE)
        new = self.graph.call_function(continue_rng, (self.comm,), {"src": src})
        new.meta = {ir.COMM: info}
        self.recvs.append(info)

    def add_rng_send(self, dst: int) -> ir.CommInfo:
        info = ir.CommInfo("send", dst, RNG_TAG, _RNG_STATE)
        new = self.graph.call_function(hand_over_rng, (self.comm,), {"dst": dst})
        new.meta = {ir.COMM: info}
        return info

    def add_send(self, node: Node, dst: int) -> ir.CommInfo:
        info = ir.CommInfo("send", dst, node.name, node.meta[ir.TENSOR])
        new = self.graph.call_function(send, (self.comm, self.value(node), node.name), {"dst": dst})
        new._rename(f"send_{node.name}_to_{dst}")
        new.meta = {ir.COMM: info}
        return info


_RNG_STATE = ir.TensorInfo((sympy.Integer(RNG_STATE_BYTES),), torch.uint8, None, False)


def _last_random_stage(compute: Sequence[Node]) -> int:
    """The last stage with a node that draws random numbers (-1 when none does)."""
    stages = [_stage_of(n) for n in compute
              if ir.COST in n.meta and ir.cost(n).random]
    return max((s for s in stages if s is not None), default=-1)


def _needs_recv(node: Node, stage: int, memo: dict[Node, bool]) -> bool:
    src = _stage_of(node)
    if node.op in ("placeholder", "get_attr") or src is None or src == stage:
        return False
    info = node.meta.get(ir.TENSOR)
    return not (_is_constant(info) or _duplicable(node, memo))


def _consumers(gm: GraphModule, num_stages: int) -> dict[Node, set[int]]:
    """For every node: the stages that read its value (the output node is the last stage)."""
    used: dict[Node, set[int]] = {}
    for node in gm.graph.nodes:
        stage = num_stages - 1 if node.op == "output" else _stage_of(node)
        if stage is None:
            continue
        for arg in node.all_input_nodes:
            used.setdefault(arg, set()).add(stage)
    return used


def _closure_inputs(nodes: Sequence[Node], memo: dict[Node, bool]) -> set[Node]:
    """Model inputs reached through duplicated non-tensor chains."""
    found: set[Node] = set()
    stack = list(nodes)
    seen: set[Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            found.add(node)
        elif _duplicable(node, memo) or node.op == "get_attr":
            stack.extend(node.all_input_nodes)
    return found


def split_stages(gm: GraphModule, num_stages: int) -> list[StageGraph]:
    """One GraphModule per stage, with explicit send/recv nodes (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    compute = ir.compute_nodes(gm.graph)
    missing = [n.name for n in compute if _stage_of(n) is None]
    if missing:
        raise SplitError(f"{len(missing)} compute nodes have no stage (e.g. {missing[:3]})",
                         hint="run passes.partition.partition first")
    consumers = _consumers(gm, num_stages)
    memo: dict[Node, bool] = {}
    last_random = _last_random_stage(compute)
    position = {n: i for i, n in enumerate(nodes)}
    by_stage: list[list[Node]] = [[] for _ in range(num_stages)]
    for n in compute:  # one pass, not one per stage: 50k nodes x 512 stages would be quadratic
        stage = _stage_of(n)
        if stage is None or not 0 <= stage < num_stages:
            raise SplitError(f"{n.name} is in stage {stage}, not one of 0..{num_stages - 1}",
                             hint="split with the number of stages the partition made")
        by_stage[stage].append(n)
    stages = []
    for s in range(num_stages):
        builder = _StageBuilder(gm, s, num_stages)
        own = by_stage[s]
        readers = own + ([output] if builder.last else [])
        direct = {a for n in readers for a in n.all_input_nodes}
        foreign = sorted((a for a in direct if _stage_of(a) not in (None, s)),
                         key=position.__getitem__)
        needed_inputs = {a for a in direct if a.op == "placeholder"}
        needed_inputs |= _closure_inputs([a for a in foreign if not _needs_recv(a, s, memo)], memo)
        builder.add_inputs(placeholders, needed_inputs)
        for value in foreign:
            if _needs_recv(value, s, memo):
                builder.add_recv(value)
        if 0 < s <= last_random:
            builder.add_rng_recv(s - 1)
        for node in own:
            builder.add_compute(node)
        sends = []
        for node in own:
            for dst in sorted(consumers.get(node, ())):
                if dst > s and _needs_recv(node, dst, memo):
                    sends.append(builder.add_send(node, dst))
        if s < last_random:
            sends.append(builder.add_rng_send(s + 1))
        if builder.last:
            builder.graph.output(torch.fx.node.map_arg(output.args[0], builder.value))
        else:
            builder.graph.output(None)
        recvs = _mark_written_recvs(builder.graph, builder.recvs)
        root = {t: _attr(gm, t) for t in builder.attrs}
        # its Python code is generated when first called or read (fxpipe.codegen writes the
        # stage's own): at 128 stages, generating and compiling each at once took seconds
        stage_gm = _LazyGraphModule(root, builder.graph, class_name=f"Stage{s}")
        names = gm.meta.get(ir.QUALNAMES, {})
        stage_gm.meta[ir.QUALNAMES] = {t: names[t] for t in builder.attrs if t in names}
        stages.append(StageGraph(s, stage_gm, tuple(builder.inputs), recvs,
                                 tuple(sends), tuple(builder.attrs), builder.last,
                                 s <= last_random and last_random > 0))
    _check_pairs(stages)
    return stages


def _mark_written_recvs(graph: Graph, recvs: list[ir.CommInfo]) -> tuple[ir.CommInfo, ...]:
    """The stage's receives, those whose value the stage writes into in place marked
    `written` (on the recv nodes too): see ir.CommInfo."""
    roots = storage_roots(graph)
    written = {roots[v] for node in graph.nodes for v in written_by(node)}
    marked: dict[str, ir.CommInfo] = {}
    for node in graph.nodes:
        info = node.meta.get(ir.COMM)
        if node.target is recv and isinstance(info, ir.CommInfo) and roots[node] in written:
            node.meta[ir.COMM] = marked[info.tag] = replace(info, written=True)
    return tuple(marked.get(info.tag, info) for info in recvs)


def _attr(gm: GraphModule, target: str) -> object:
    owner_path, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    return getattr(owner, name)


def _check_pairs(stages: list[StageGraph]) -> None:
    """Every send has exactly one matching recv in its peer, and the other way round."""
    sent = {(s.index, c.peer, c.tag) for s in stages for c in s.sends}
    received = {(c.peer, s.index, c.tag) for s in stages for c in s.recvs}
    problems = [f"send {t} from stage {a} to {b} has no recv"
                for a, b, t in sorted(sent - received)]
    problems += [f"recv {t} in stage {b} from {a} has no send"
                 for a, b, t in sorted(received - sent)]
    if problems:
        raise SplitError("unmatched communication:\n" + "\n".join(f"  - {p}" for p in problems),
                         hint="this is a bug in split_stages; please report it with the model")


def shared_parameters(stages: Sequence[StageGraph]) -> dict[str, list[int]]:
    """Parameters (by one of their names) that live in several stages, with those stages."""
    holders: dict[int, tuple[str, list[int]]] = {}
    for stage in stages:
        for target in stage.attrs:
            value = _attr(stage.graph_module, target)
            if isinstance(value, torch.nn.Parameter):
                name, where = holders.setdefault(id(value), (target, []))
                if stage.index not in where:
                    where.append(stage.index)
    return {name: where for name, where in holders.values() if len(where) > 1}
