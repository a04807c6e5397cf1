"""The analysis a split backward runs once per stage: which nodes of the autograd graph the
weight pass starts from, in which calls, and how to find those nodes again in the graph of
another micro-batch (fxpipe/runtime/execution/split_backward.py).

    outputs ─┐                        C, the input closure: every node from which a received
             ▼                          leaf is reachable (what I runs anyway)
      [ C  C  C ]──▶ R ──▶ AccumulateGrad(w)
      [ C  C  C ]                     R: nodes outside C on a path to a weight
             ▼                        intermediate: a node of C with an edge into R or into a
       received leaves                  weight's AccumulateGrad (it computes both gradients)

Every path from an output in C to a weight leaves C for the last time at an intermediate, so
the weight's gradient is what flows out of the intermediates. W starts from the intermediates
with the gradients I saw enter them and reaches only R and the weights.

W needs one autograd call per group of weights that share intermediates (a Linear's weight and
bias): autograd runs every node on a path from where a call starts to a weight it is asked for,
so one call over all weights would run again, from each intermediate, the input-gradient edge
into C and every node of C down to the intermediates below it: the whole of I. From a lone
group's intermediates the edges back into C lead to none of its weights, and autograd skips
them. A group whose intermediates are joined by a path through C (a weight used twice, one use
above the other) would run that path; such groups, and every group with an intermediate on such
a path, become one call (`Call.crossed`), which clamps its intermediates to the gradients I
kept, so that what flows into them down that path is not counted twice.

Every micro-batch of a stage runs the same operations, so its graph has the same shape. A
`Route` finds the intermediates of another micro-batch's graph from its roots by the child
positions the first graph had, following only the edges on the way to an intermediate.
"""
from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch.autograd.graph import Node

__all__ = ["Call", "Graph", "Route", "plan_calls"]

ACCUMULATE = "torch::autograd::AccumulateGrad"


@dataclass
class Call:
    """One autograd call of W: from `intermediates` to the AccumulateGrad nodes `weights`;
    `crossed`: a path through C joins two of its intermediates (see the module docstring)."""

    intermediates: list[Node]
    weights: list[Node]
    crossed: bool = False


@dataclass
class Graph:
    """The autograd graph below `roots`: children as autograd lists them, parents, and where
    each node was first found (its parent and its position among the parent's children)."""

    roots: list[Node]
    children: dict[Node, list[Node]] = field(default_factory=dict)
    parents: dict[Node, list[Node]] = field(default_factory=dict)
    found_at: dict[Node, tuple[Node, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        todo = collections.deque(dict.fromkeys(self.roots))  # breadth first: short routes
        for node in todo:
            self.children[node] = []
        while todo:
            node = todo.popleft()
            for position, (child, _) in enumerate(node.next_functions):
                if child is None:
                    continue
                if child not in self.children:
                    self.children[child] = []
                    self.found_at[child] = (node, position)
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

    def weight_nodes(self, leaf_nodes: set[Node], weights: Sequence[Node] | None) -> list[Node]:
        """The AccumulateGrad nodes that W serves: those of `weights`, or every one in the graph
        but the received leaves'."""
        if weights is not None:
            return [n for n in dict.fromkeys(weights) if n in self.children and n not in leaf_nodes]
        return [n for n, kids in self.children.items()
                if not kids and n not in leaf_nodes and n.name() == ACCUMULATE]


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


@dataclass(frozen=True)
class Route:
    """How to find given nodes of a graph again in a graph of the same shape: from the distinct
    roots (slots 0..roots-1), each step (slot, position) adds the next slot, the child at that
    position; `names` checks the found nodes' kinds."""

    roots: int
    steps: tuple[tuple[int, int], ...]
    names: tuple[tuple[int, str], ...]

    @staticmethod
    def to(graph: Graph, targets: Iterable[Node]) -> tuple[Route, dict[Node, int]]:
        """The route from the graph's roots to `targets`, and the slot of each target."""
        roots = list(dict.fromkeys(graph.roots))
        slot = {node: k for k, node in enumerate(roots)}
        wanted = list(dict.fromkeys(targets))
        steps = []
        for target in wanted:
            path, node = [], target
            while node not in slot:  # up to a root or a node already on the route
                path.append(node)
                node = graph.found_at[node][0]
            for node in reversed(path):
                parent, position = graph.found_at[node]
                steps.append((slot[parent], position))
                slot[node] = len(slot)
        names = tuple((slot[n], n.name()) for n in wanted)
        return Route(len(roots), tuple(steps), names), slot

    def follow(self, roots: Sequence[Node]) -> list[Node] | None:
        """The nodes at every slot of the graph below `roots`, or None where its shape differs."""
        distinct: list[Node | None] = list(dict.fromkeys(roots))
        if len(distinct) != self.roots:
            return None
        nodes = distinct + [None] * len(self.steps)  # filled in place: no call per step
        try:
            for k, (source, position) in enumerate(self.steps, self.roots):
                parent = nodes[source]
                nodes[k] = None if parent is None else parent.next_functions[position][0]
        except IndexError:
            return None
        for k, name in self.names:
            found = nodes[k]
            if found is None or found.name() != name:
                return None
        return nodes  # type: ignore[return-value]  # every named slot was checked


def plan_calls(graph: Graph, closure: set[Node], weights: list[Node]) -> list[Call] | None:
    """W's autograd calls, or None when an output outside the closure reaches a weight."""
    roots = set(graph.roots)
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
    members: dict[Node, Call] = {}
    for weight in weights:
        members.setdefault(groups.find(weight), Call([], [])).weights.append(weight)
    for node, weight in first.items():
        members[groups.find(weight)].intermediates.append(node)
    return _join_crossed(list(members.values()), graph, closure)


def _join_crossed(calls: list[Call], graph: Graph, closure: set[Node]) -> list[Call]:
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
    call = Call([n for k in sorted(merged) for n in calls[k].intermediates],
                [w for k in sorted(merged) for w in calls[k].weights], crossed=True)
    return [call] + [c for k, c in enumerate(calls) if k not in merged]


def _children_first(graph: Graph, within: set[Node]) -> list[Node]:
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
