"""A backward split into an input pass and a later weight pass that walks only the weights' part.

Zero-bubble schedules send the input gradients of a micro-batch back at once (I) and compute the
weight gradients later (W). A second full backward for W would redo I's work. This module reads
the autograd graph instead, so that W runs only the nodes that lead to weights:

    outputs ─┐                        C, the input closure: every node from which a received
             ▼                          leaf is reachable (what I runs anyway)
      [ C  C  C ]──▶ R ──▶ AccumulateGrad(w)
      [ C  C  C ]                     R: nodes outside C on a path to a weight
             ▼                        intermediate: a node of C with an edge into R or into a
       received leaves                  weight's AccumulateGrad (it computes both gradients)

Every path from an output in C to a weight leaves C for the last time at an intermediate, so
the weight's gradient is what flows out of the intermediates. I runs with prehooks on them that
keep their incoming gradients (complete: all their parents are in C and ran in I); W starts from
`GradientEdge(intermediate, i)` with those gradients and reaches only R and the weights.

W runs one autograd call per group of weights that share intermediates (a Linear's weight and
bias), so that no call needs the input-gradient edges of another group's intermediates: from a
lone group's intermediates the edges back into C lead to none of its weights, and autograd skips
them. A group whose intermediates are joined by a path through C (a weight used twice, one use
above the other) would run that path; such groups, and every group with an intermediate on such
a path, become one call. W clamps every intermediate to its kept gradient (a node prehook, which
runs last), so neither what flows into it down such a path nor a tensor hook on its output, run
again, is counted twice. The calls run disjoint sets of nodes, which lets them share one
`torch.utils.checkpoint.GraphExecGroup`: a remat region is recomputed once in W, not once per
call.

Exactness needs every output to lie in C or to reach no weight. An output outside C reaches no
received leaf, so its paths never meet an intermediate (the first stage, whose outputs depend on
no received leaf; `w * x_model_input` sent beside `f(received)`). Then the whole micro-batch
falls back: I takes the leaves' gradients with the graph retained, and W runs a full backward
from the outputs, as an unsplit backward would.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from fxpipe.errors import PipelineRuntimeError

__all__ = ["input_backward", "WeightPass"]

Grads = tuple[torch.Tensor | None, ...]
_ACCUMULATE = "torch::autograd::AccumulateGrad"


def input_backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   leaves: Sequence[torch.Tensor],
                   weights: Sequence[torch.Tensor] | None = None
                   ) -> tuple[list[torch.Tensor | None], WeightPass]:
    """The input half of a backward: the gradients of `leaves`, and the pass for the weights.

    Args:
        outputs: where the backward starts (sent values, a loss); those that do not require
            grad are skipped.
        grads: their gradients (None for a scalar loss).
        leaves: the received leaf tensors whose gradients are wanted now.
        weights: the tensors W may accumulate into; by default every other leaf of the graph
            that requires grad.

    Returns:
        The gradient of each leaf (None where it has none), and a WeightPass to run later. Where
        W does not fall back, outputs that nothing else holds are detached in place, so that the
        graph above what W needs is freed.
    """
    for t in [*leaves, *(weights or ())]:
        if t.grad_fn is not None:
            raise PipelineRuntimeError(f"input_backward takes leaf tensors as leaves and weights, "
                                       f"got one computed by {t.grad_fn.name()}",
                                       hint="pass the received tensors and the parameters")
    pairs = [(t, g) for t, g in zip(outputs, grads) if t.requires_grad]
    wanted = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
    served = None if weights is None else {id(w) for w in weights}
    got: list[torch.Tensor | None] = [None] * len(leaves)
    if not pairs:
        return got, WeightPass([], {}, [], served)
    tensors, gradients = [t for t, _ in pairs], [g for _, g in pairs]
    roots = [get_gradient_edge(t).node for t in tensors]
    graph = _Graph(roots)
    leaf_nodes = {get_gradient_edge(leaves[i]).node for i in wanted}
    closure = graph.reaching(leaf_nodes & graph.nodes)
    targets = _weight_nodes(graph, leaf_nodes, weights)
    calls = _plan(set(roots), graph, closure, targets) if targets else []
    kept: dict[Node, Grads] = {}
    handles = [] if calls is None else [
        node.register_prehook(_keeper(kept, node)) for call in calls for node in call.intermediates]
    try:
        if wanted:
            found = torch.autograd.grad(tensors, [leaves[i] for i in wanted], gradients,
                                        retain_graph=bool(targets), allow_unused=True)
            for i, grad in zip(wanted, found):
                got[i] = grad
    finally:
        for handle in handles:
            handle.remove()
    if calls is None:
        return got, WeightPass([], kept, targets, served, full=(tensors, gradients))
    _release(tensors)
    return got, WeightPass(calls, kept, targets, served)


def _release(outputs: list[torch.Tensor]) -> None:
    """Detaches in place the outputs that only their Python objects hold, so that the graph above
    the intermediates is freed even while the caller keeps them. An output that a node saved
    for backward is held by that node too (it keeps the graph below it anyway), and detaching
    a saved tensor in place would break its unpacking in W; a view cannot be detached in place.
    """
    for t in outputs:
        holders = getattr(t, "_use_count", None)  # untyped; C++ references to the tensor
        if t.grad_fn is not None and not t._is_view() and holders is not None and holders() == 1:
            t.detach_()


class WeightPass:
    """The weight half of a split backward, ready to run once.

    `fallback` says whether it is a full backward from the outputs (see the module docstring).
    """

    def __init__(self, calls: list[_Call], kept: dict[Node, Grads], weights: list[Node],
                 served: set[int] | None,
                 full: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None
                 ) -> None:
        self.fallback = full is not None
        self._calls = calls
        self._kept = kept
        self._weights = weights  # AccumulateGrad nodes
        self._served = served  # ids of the weights input_backward was given, if any
        self._full = full
        self._done = False

    def run(self, weights: Sequence[torch.Tensor] | None = None) -> None:
        """Accumulates into the .grad of `weights` (default: every weight the input pass served)
        and frees what the pass kept."""
        if self._done:
            raise PipelineRuntimeError("this weight pass has already run",
                                       hint="run each split backward's W exactly once")
        self._done = True
        if weights is not None and self._served is not None and \
                any(id(w) not in self._served for w in weights):
            raise PipelineRuntimeError("the weight pass was asked for a weight that "
                                       "input_backward was not given",
                                       hint="give input_backward every weight, or none")
        chosen = [w for w in (map(_variable, self._weights) if weights is None else weights)
                  if w.requires_grad]
        try:
            if self._full is not None:
                outputs, grads = self._full
                if chosen:
                    torch.autograd.backward(outputs, grads, inputs=chosen)
            else:
                ids = {id(w) for w in chosen}
                with _one_recompute(len(self._calls)):
                    for call in self._calls:
                        call.run(self._kept, ids)
        finally:
            self._calls, self._kept, self._weights, self._full = [], {}, [], None


@dataclass
class _Call:
    """One autograd call of W: from `intermediates` to the AccumulateGrad nodes `weights`."""

    intermediates: list[Node]
    weights: list[Node]

    def run(self, kept: dict[Node, Grads], chosen: set[int]) -> None:
        inputs = [w for w in map(_variable, self.weights) if id(w) in chosen]
        edges, grads = [], []
        for node in self.intermediates:
            for i, grad in enumerate(kept.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(grad)
        if not inputs or not edges:
            return
        handles = [node.register_prehook(_clamp(kept[node])) for node in self.intermediates
                   if node in kept]
        try:
            torch.autograd.backward(edges, grads, inputs=inputs)
        finally:
            for handle in handles:
                handle.remove()


@dataclass
class _Graph:
    """The autograd graph below `roots`: children as autograd lists them, and parents."""

    roots: list[Node]
    children: dict[Node, list[Node]] = field(default_factory=dict)
    parents: dict[Node, list[Node]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        todo = list(dict.fromkeys(self.roots))
        for node in todo:
            self.children[node] = []
        while todo:
            node = todo.pop()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                if child not in self.children:
                    self.children[child] = []
                    todo.append(child)
                self.children[node].append(child)
                self.parents.setdefault(child, []).append(node)

    @property
    def nodes(self) -> set[Node]:
        return set(self.children)

    def reaching(self, targets: Iterable[Node], within: set[Node] | None = None) -> set[Node]:
        """The nodes (of `within`) from which one of `targets` is reachable, targets included."""
        return _closure(targets, self.parents, within)

    def reached(self, starts: Iterable[Node], within: set[Node]) -> set[Node]:
        """The nodes of `within` reachable from `starts`, starts included."""
        return _closure(starts, self.children, within)


def _closure(starts: Iterable[Node], edges: dict[Node, list[Node]],
             within: set[Node] | None) -> set[Node]:
    seen = set(starts)
    todo = list(seen)
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen and (within is None or nxt in within):
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _weight_nodes(graph: _Graph, leaf_nodes: set[Node],
                  weights: Sequence[torch.Tensor] | None) -> list[Node]:
    """The AccumulateGrad nodes of the graph that W serves."""
    if weights is not None:
        nodes = [get_gradient_edge(w).node for w in weights if w.requires_grad]
        return [n for n in dict.fromkeys(nodes) if n in graph.children and n not in leaf_nodes]
    return [n for n, kids in graph.children.items()
            if not kids and n not in leaf_nodes and n.name() == _ACCUMULATE]


def _plan(roots: set[Node], graph: _Graph, closure: set[Node],
          weights: list[Node]) -> list[_Call] | None:
    """W's autograd calls, or None when an output outside the closure reaches a weight."""
    groups = _UnionFind(weights)
    region: dict[Node, Node] = {}  # node of R -> a weight it leads to
    first: dict[Node, Node] = {}  # intermediate -> a weight it leads to
    for weight in weights:
        region[weight] = weight
        todo = [weight]
        while todo:
            node = todo.pop()
            if node in roots:
                return None
            for parent in graph.parents.get(node, ()):
                if parent in closure:
                    groups.union(first.setdefault(parent, weight), weight)
                elif parent in region:
                    groups.union(region[parent], weight)
                else:
                    region[parent] = weight
                    todo.append(parent)
    members: dict[Node, _Call] = {}
    for weight in weights:
        members.setdefault(groups.find(weight), _Call([], [])).weights.append(weight)
    for node, weight in first.items():
        members[groups.find(weight)].intermediates.append(node)
    calls = list(members.values())
    return _join_crossed(calls, graph, closure)


def _join_crossed(calls: list[_Call], graph: _Graph, closure: set[Node]) -> list[_Call]:
    """Merges the calls whose intermediates a path through the closure joins (see the module
    docstring), so that no two calls run the same node."""
    index = {node: k for k, call in enumerate(calls) for node in call.intermediates}
    below: dict[Node, int] = {}  # bit k: an intermediate of call k lies strictly below
    crossed: set[int] = set()
    for node in _children_first(graph, closure):
        bits = 0
        for child in graph.children[node]:
            if child in closure:
                bits |= below[child] | (1 << index[child] if child in index else 0)
        below[node] = bits
        if node in index and bits >> index[node] & 1:
            crossed.add(index[node])
    if not crossed:
        return calls
    joined = [node for k in crossed for node in calls[k].intermediates]
    path = graph.reached(joined, closure) & graph.reaching(joined, closure)
    merged = crossed | {index[node] for node in path if node in index}
    call = _Call([n for k in sorted(merged) for n in calls[k].intermediates],
                 [w for k in sorted(merged) for w in calls[k].weights])
    return [call] + [c for k, c in enumerate(calls) if k not in merged]


def _children_first(graph: _Graph, within: set[Node]) -> list[Node]:
    """The nodes of `within` in an order that puts every node after its children."""
    order: list[Node] = []
    done: set[Node] = set()
    for start in within:
        if start in done:
            continue
        done.add(start)
        stack = [(start, iter(graph.children[start]))]
        while stack:
            node, rest = stack[-1]
            for child in rest:
                if child in within and child not in done:
                    done.add(child)
                    stack.append((child, iter(graph.children[child])))
                    break
            else:
                stack.pop()
                order.append(node)
    return order


class _UnionFind:
    def __init__(self, items: Iterable[Node]) -> None:
        self.parent = {item: item for item in items}

    def find(self, item: Node) -> Node:
        root = item
        while self.parent[root] is not root:
            root = self.parent[root]
        while self.parent[item] is not root:
            self.parent[item], item = root, self.parent[item]
        return root

    def union(self, a: Node, b: Node) -> None:
        self.parent[self.find(a)] = self.find(b)


def _variable(node: Node) -> torch.Tensor:
    variable: torch.Tensor = getattr(node, "variable")  # noqa: B009 (untyped attribute)
    return variable


def _keeper(kept: dict[Node, Grads], node: Node) -> Callable[[Grads], None]:
    def keep(grads: Grads) -> None:
        kept[node] = grads

    return keep


def _clamp(grads: Grads) -> Callable[[Grads], Grads]:
    return lambda _flowing: grads


def _one_recompute(calls: int) -> contextlib.AbstractContextManager[object]:
    """Makes a remat region recompute once across W's calls (they run disjoint nodes)."""
    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    current = getattr(torch._C, "_get_graph_exec_group", None)
    if calls < 2 or group is None or current is None or current() is not None:
        return contextlib.nullcontext()
    context: contextlib.AbstractContextManager[object] = group()
    return context
