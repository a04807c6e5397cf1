"""A backward split into an input pass and a later weight pass that walks only the weights' part.

Zero-bubble schedules send the input gradients of a micro-batch back at once (I) and compute the
weight gradients later (W). A second full backward for W would redo I's work. The graph is read
instead (fxpipe/runtime/execution/backward_graph.py) so that W runs only the nodes that lead to
weights, starting from the intermediates, the nodes where a weight's path leaves the input closure.

The reading runs once per stage and graph shape (`SplitPlan`, kept in the `plans` a caller
passes): every micro-batch of a stage runs the same operations, so later micro-batches only
follow the plan's route to their intermediates and check the nodes' kinds there. I is one
autograd call that asks, beside the received leaves' gradients, for the gradient entering each
intermediate (a `GradientEdge` input, which autograd captures on its way through that node,
with no Python hook); W starts from those edges with those gradients. A gradient captured so
is taken before the node's tensor hooks (a hook registered on the tensor the node made), which
then run again when W starts there, so such a hook applies once to each half. The intermediates
of a call whose paths cross (see backward_graph) are clamped in W to what entered them in I, so
there node prehooks keep the gradients, after the tensor hooks; so do those of a call with a
node whose number of inputs the installed torch does not expose.

Where one call's weights hang on one node of a linear, a convolution or a layer norm, with
nothing but the layer's own transpose and cast between (weight_recipes.py), and the caller
vouches that no tensor hook sits on the stage's values (`direct`: generated stage code
registers none), W computes their gradients from that node's saved tensors and the captured
gradient, with the kernel autograd would run, and no engine call. A layer norm's weights are
asked of I itself instead (weight_recipes.IN_INPUT_PASS): the kernel that computes the norm's
input gradient computes theirs in the same call, where W would run it again to read the input
and its statistics a second time; W then only accumulates them. Hooks on those weights are read
when I runs: a hooked one is left to W as before.

Between I and W the graph is kept for W (`retain_graph`), with every tensor its nodes saved,
unless the caller says that no remat region recomputes in this micro-batch (`release`) and W
needs nothing of the graph but the recipes' saved inputs: every call of the plan has a recipe
and no weight is hooked. Then I reads those inputs first (a linear's x, a convolution's input)
and frees the graph as a plain backward does, so that from I to W the micro-batch holds only
them and the captured gradients.

Exactness needs every output to lie in C or to reach no weight. An output outside C reaches no
received leaf, so its paths never meet an intermediate (the first stage, whose outputs depend on
no received leaf; `w * x_model_input` sent beside `f(received)`). Then the whole micro-batch
falls back: I takes the leaves' gradients with the graph retained, and W runs a full backward
from the outputs, as an unsplit backward would.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils.checkpoint
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from fxpipe.errors import PipelineRuntimeError
from fxpipe.runtime.execution.backward_graph import Graph, Route, plan_calls
from fxpipe.runtime.execution.weight_recipes import (
    IN_INPUT_PASS,
    Recipe,
    accumulate,
    add_weight_grads,
    hooked,
    recipe_for,
    saved_for,
)

__all__ = ["SplitPlan", "SplitPlans", "WeightPass", "engine_backward", "engine_grad",
           "input_backward"]

Grads = tuple[torch.Tensor | None, ...]


@dataclass(frozen=True)
class _PlannedCall:
    """One autograd call of W: the captured edges it starts from (indices into the plan's
    `captured`), the slots of the clamped intermediates of a crossed call, its weights; and
    where one layer's node makes them all, how W computes them without the call
    (fxpipe/runtime/execution/weight_recipes.py)."""

    captured: tuple[int, ...]
    clamped: tuple[int, ...]
    weights: tuple[torch.Tensor, ...]
    recipe: Recipe | None = None
    early: bool = False  # its weights may be asked of I (weight_recipes.IN_INPUT_PASS)


@dataclass(frozen=True)
class SplitPlan:
    """What reading one stage's backward graph found, in terms that hold for every micro-batch.

    route: finds the intermediates (their slots) from the roots; captured: (slot, input) of
    each gradient I asks for, the early calls' last; kept: slots whose gradients node prehooks
    keep (crossed calls); fallback: W is a full backward (see the module docstring); weights:
    the tensors W serves; grouped: W runs in one group of graph execution (_one_recompute): it
    makes several calls, or reads saved tensors for a recipe; early: the weights of the early
    calls, which I computes instead of capturing those calls' gradients (`late` captured
    entries), unless one of them is hooked; releasable: every call has a recipe and none is
    clamped, so that I may free the graph once it has read the recipes' saved inputs.
    """

    route: Route
    captured: tuple[tuple[int, int], ...]
    kept: tuple[int, ...]
    calls: tuple[_PlannedCall, ...]
    fallback: bool
    weights: tuple[torch.Tensor, ...]
    grouped: bool = False
    early: tuple[torch.Tensor, ...] = ()
    late: int = 0
    releasable: bool = False  # W can do without the graph (module docstring)


SplitPlans = dict[Hashable, SplitPlan]  # per stage: a plan for each graph shape met


def input_backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   leaves: Sequence[torch.Tensor],
                   weights: Sequence[torch.Tensor] | None = None,
                   plans: SplitPlans | None = None, *, direct: bool = False,
                   release: bool = False) -> tuple[list[torch.Tensor | None], WeightPass]:
    """The input half of a backward: the gradients of `leaves`, and the pass for the weights.

    Args:
        outputs: where the backward starts (sent values, a loss); those that do not require
            grad are skipped.
        grads: their gradients (None for a scalar loss).
        leaves: the received leaf tensors whose gradients are wanted now.
        weights: the tensors W may accumulate into; by default every other leaf of the graph
            that requires grad.
        plans: where the plans of this stage's graphs are kept from one micro-batch to the next
            (one dict per stage); None reads every graph anew.
        direct: W computes the weight gradients of linears, convolutions and layer norms
            itself, from the saved tensors (weight_recipes.py); the caller vouches that no
            tensor hook sits on a value the stage computed (generated stage code registers
            none).
        release: no remat region recomputes in this micro-batch (its saved tensors are read
            without recomputing): where the plan allows, I frees the graph, and W keeps only
            what its recipes read (module docstring).

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
    served = None if weights is None else frozenset(map(id, weights))
    got: list[torch.Tensor | None] = [None] * len(leaves)
    if not pairs:
        return got, WeightPass(None, {}, (), {}, served, weights)
    tensors, gradients = [t for t, _ in pairs], [g for _, g in pairs]
    roots = [get_gradient_edge(t).node for t in tensors]
    key = (tuple(r.name() for r in roots), tuple(wanted), len(leaves), served,
           torch.is_autocast_enabled(), direct)
    plan = plans.get(key) if plans is not None else None
    nodes = plan.route.follow(roots) if plan is not None else None
    if plan is None or nodes is None:
        plan, nodes = _read(roots, [leaves[i] for i in wanted], weights, direct)
        if plans is not None:
            plans[key] = plan
    wanted_leaves = [leaves[i] for i in wanted]
    if plan.fallback:
        if wanted:
            leaf_grads = engine_grad(tensors, gradients, wanted_leaves,
                                     retain_graph=bool(plan.weights))
            for i, grad in zip(wanted, leaf_grads):
                got[i] = grad
        return got, WeightPass(plan, {}, (), {}, served, weights, full=(tensors, gradients))
    # freeing needs no weight hooked, and then the early calls' weights are asked of I too
    free = release and plan.releasable and not hooked(plan.weights)
    early = plan.early if plan.early and (free or not hooked(plan.early)) else ()
    edges = [GradientEdge(nodes[slot], i)
             for slot, i in (plan.captured[:plan.late] if early else plan.captured)]
    saved = _read_ahead(plan, nodes) if free else None
    kept: dict[int, Grads] = {}
    handles = [nodes[slot].register_prehook(_keeper(kept, slot)) for slot in plan.kept]
    try:
        found: Sequence[torch.Tensor | None] = ()
        if wanted_leaves or edges or early:
            # autograd takes tensors and edges mixed
            asked: list[Any] = [*wanted_leaves, *edges, *early]
            found = engine_grad(tensors, gradients, asked,
                                retain_graph=bool(plan.weights) and saved is None)
    finally:
        for handle in handles:
            handle.remove()
    for i, found_grad in zip(wanted, found):
        got[i] = found_grad
    _release(tensors)
    clamped = {slot: nodes[slot] for slot in plan.kept}  # not the nodes above: they are freed
    done = len(wanted) + len(edges)
    return got, WeightPass(plan, clamped, tuple(zip(edges, found[len(wanted):done])), kept,
                           served, weights,
                           early=tuple(zip(early, found[done:])) if early else None, saved=saved)


def _read_ahead(plan: SplitPlan, nodes: list[Node]) -> list[tuple[Any, ...] | None]:
    """What each call's recipe reads of its node (None for an early call), read before I
    frees the graph."""
    out: list[tuple[Any, ...] | None] = []
    for call in plan.calls:
        recipe = call.recipe
        if call.early or recipe is None:
            out.append(None)
        else:
            out.append(saved_for(recipe, nodes[plan.captured[call.captured[0]][0]]))
    return out


def _read(roots: list[Node], leaves: list[torch.Tensor],
          weights: Sequence[torch.Tensor] | None, direct: bool
          ) -> tuple[SplitPlan, list[Node]]:
    """Reads the graph below `roots` into a plan, and the nodes at its route's slots. With
    `direct`, a call whose one intermediate is a layer of weight_recipes gets its recipe, where
    one group of graph execution can span W (a remat region recomputed once for all its
    reads)."""
    graph = Graph(roots)
    leaf_nodes = {get_gradient_edge(leaf).node for leaf in leaves}
    closure = graph.reaching(leaf_nodes & graph.nodes)
    targets = graph.weight_nodes(leaf_nodes, None if weights is None else
                                 [get_gradient_edge(w).node for w in weights if w.requires_grad])
    calls = plan_calls(graph, closure, targets) if targets else []
    served = tuple(_variable(n) for n in targets)
    if calls is None:
        route, _ = Route.to(graph, [])
        return SplitPlan(route, (), (), (), True, served), []
    route, slot = Route.to(graph, [n for call in calls for n in call.intermediates])
    captured: list[tuple[int, int]] = []
    kept: list[int] = []
    planned: list[_PlannedCall] = []
    early_calls: list[tuple[int, list[tuple[int, int]]]] = []  # captured after the others
    for call in calls:
        slots = [slot[n] for n in call.intermediates]
        counts = [_inputs(n) for n in call.intermediates]
        clamp = call.crossed or None in counts  # crossed, or a node that does not say its inputs
        entries = [] if clamp else \
            [(s, i) for s, count in zip(slots, counts) for i in range(count or 0)]
        kept += slots if clamp else []
        recipe = recipe_for(call.intermediates[0], call.weights, closure) \
            if direct and _GRAPH_EXEC_GROUP is not None and not clamp \
            and len(call.intermediates) == 1 and counts == [1] else None
        early = recipe is not None and recipe.kind in IN_INPUT_PASS
        if early:
            early_calls.append((len(planned), entries))
        else:
            captured += entries
        planned.append(_PlannedCall(tuple(range(len(captured) - len(entries), len(captured)))
                                    if not early else (), tuple(slots) if clamp else (),
                                    tuple(_variable(w) for w in call.weights), recipe, early))
    late = len(captured)
    for k, entries in early_calls:
        planned[k] = replace(planned[k], captured=tuple(range(len(captured),
                                                              len(captured) + len(entries))))
        captured += entries
    nodes: list[Node] = [None] * len(slot)  # type: ignore[list-item]  # all filled below
    for node, k in slot.items():
        nodes[k] = node
    grouped = len(planned) > 1 or any(call.recipe is not None for call in planned)
    early_weights = tuple(w for call in planned if call.early for w in call.weights)
    releasable = not kept and all(call.recipe is not None for call in planned)
    return SplitPlan(route, tuple(captured), tuple(kept), tuple(planned), False, served,
                     grouped, early_weights, late, releasable), nodes


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

    def __init__(self, plan: SplitPlan | None, clamped: dict[int, Node],
                 captured: tuple[tuple[GradientEdge, torch.Tensor | None], ...],
                 kept: dict[int, Grads], served: frozenset[int] | None,
                 given: Sequence[torch.Tensor] | None,
                 full: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None,
                 early: tuple[tuple[torch.Tensor, torch.Tensor | None], ...] | None = None,
                 saved: list[tuple[Any, ...] | None] | None = None) -> None:
        self.fallback = full is not None
        self._early = early  # (weight, gradient) that I computed for the early calls
        self._saved = saved  # per call, what its recipe reads, where I freed the graph
        self._plan = plan
        self._clamped = clamped  # slot -> intermediate of a crossed call
        self._captured = captured
        self._kept = kept
        self._served = served  # ids of the weights input_backward was given, if any
        self._given = given  # those weights, as given: run() with the same list serves them all
        self._full = full
        self._done = False

    def run(self, weights: Sequence[torch.Tensor] | None = None) -> None:
        """Accumulates into the .grad of `weights` (default: every weight the input pass served)
        and frees what the pass kept."""
        if self._done:
            raise PipelineRuntimeError("this weight pass has already run",
                                       hint="run each split backward's W exactly once")
        self._done = True
        if weights is self._given:
            weights = None  # every weight served, without a check per weight per micro-batch
        if weights is not None and self._served is not None and \
                any(id(w) not in self._served for w in weights):
            raise PipelineRuntimeError("the weight pass was asked for a weight that "
                                       "input_backward was not given",
                                       hint="give input_backward every weight, or none")
        plan = self._plan
        try:
            if plan is None:
                return
            chosen = None if weights is None else {id(w) for w in weights}
            if self._full is not None:
                outputs, grads = self._full
                inputs = [w for w in plan.weights if chosen is None or id(w) in chosen]
                if inputs:
                    torch.autograd.backward(outputs, grads, inputs=inputs)
                return
            early, saved = self._early, self._saved
            if (early is not None and hooked(plan.early)) or \
                    (saved is not None and hooked(plan.weights)):
                raise PipelineRuntimeError(
                    "a hook was put on a weight between the input and the weight pass of a "
                    "split backward, which the input pass ran as without hooks",
                    hint="register weight hooks before the step")
            with _one_recompute(plan.grouped and saved is None):
                for k, call in enumerate(plan.calls):
                    if call.early and early is not None:
                        continue  # I computed its weights' gradients
                    # (where I freed the graph, no weight was hooked then, nor is now)
                    if call.recipe is not None and (saved is not None or not hooked(call.weights)):
                        self._compute(call, call.recipe, chosen,
                                      saved[k] if saved is not None else None)
                    else:
                        self._engine(call, chosen)
            for weight, grad in early or ():
                if grad is not None and (chosen is None or id(weight) in chosen):
                    accumulate(weight, grad)
        finally:
            self._plan, self._clamped, self._captured, self._kept = None, {}, (), {}
            self._full = self._given = self._early = self._saved = None

    def held(self) -> list[torch.Tensor] | None:
        """The saved tensors this pass keeps of the graph where I freed it (what its recipes
        read), or None where it keeps the whole graph."""
        if self._saved is None:
            return None
        return [t for values in self._saved if values is not None for t in values
                if isinstance(t, torch.Tensor)]

    def _engine(self, call: _PlannedCall, chosen: set[int] | None) -> None:
        """W of one group's weights through autograd's engine, from the captured edges."""
        inputs = [w for w in call.weights
                  if w.requires_grad and (chosen is None or id(w) in chosen)]
        pairs = [self._captured[k] for k in call.captured]
        edges = [edge for edge, grad in pairs if grad is not None]
        grads = [grad for _, grad in pairs if grad is not None]
        for slot in call.clamped:
            for i, grad in enumerate(self._kept.get(slot, ())):
                if grad is not None:
                    edges.append(GradientEdge(self._clamped[slot], i))
                    grads.append(grad)
        if not inputs or not edges:
            return
        handles = [self._clamped[slot].register_prehook(_clamp(self._kept[slot]))
                   for slot in call.clamped if slot in self._kept]
        try:
            engine_backward(edges, grads, inputs)
        finally:
            for handle in handles:
                handle.remove()

    def _compute(self, call: _PlannedCall, recipe: Recipe, chosen: set[int] | None,
                 saved: tuple[Any, ...] | None) -> None:
        """W of one layer's weights without autograd's engine (weight_recipes.py), from what
        I read of its node (`saved`), or else from the node now."""
        edge, grad = self._captured[call.captured[0]]
        if grad is None:
            return  # no gradient reached the layer
        add_weight_grads(recipe, saved if saved is not None else saved_for(recipe, edge.node),
                         grad, call.weights, chosen)


def engine_backward(tensors: Sequence[torch.Tensor] | Sequence[GradientEdge],
                    grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor] = ()) -> None:
    """torch.autograd.backward(tensors, grads, inputs=inputs or None), entering the engine as
    it does, without its Python checks of the gradients: the executors call it for every
    micro-batch (and W once per weight group), with gradients the engine checks against its
    graph anyway (shape, dtype, device). A torch without that entry point takes
    torch.autograd.backward itself."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)  # what backward calls
    if run is None:
        torch.autograd.backward(tensors, list(grads), inputs=list(inputs) or None)
        return
    run(tuple(tensors), tuple(grads), False, False, tuple(inputs),
        allow_unreachable=True, accumulate_grad=True)


def engine_grad(tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                inputs: Sequence[Any], *, retain_graph: bool) -> Sequence[torch.Tensor | None]:
    """torch.autograd.grad(tensors, inputs, grads, retain_graph=..., allow_unused=True), entering
    the engine as it does where every gradient is given (I runs for every micro-batch; the
    engine checks the gradients against its graph); a None gradient (a loss left for autograd
    to start, or to refuse) takes torch.autograd.grad itself. `inputs` may hold tensors and
    GradientEdges."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)  # what grad calls
    given = run is not None
    for grad in grads:  # a loop, not any(): no call per gradient
        if grad is None:
            given = False
    if not given or run is None:
        return torch.autograd.grad(tensors, inputs, grads, retain_graph=retain_graph,
                                   allow_unused=True)
    found: Sequence[torch.Tensor | None] = run(tuple(tensors), tuple(grads), retain_graph, False,
                                               tuple(inputs), True, accumulate_grad=False)
    return found


def _inputs(node: Node) -> int | None:
    """How many gradients enter `node` (one per output of the forward op that made it), where
    this torch says it; else a prehook keeps what enters."""
    metadata = getattr(node, "_input_metadata", None)  # untyped
    return len(metadata) if metadata is not None else None


def _variable(node: Node) -> torch.Tensor:
    variable: torch.Tensor = getattr(node, "variable")  # noqa: B009 (untyped attribute)
    return variable


def _keeper(kept: dict[int, Grads], slot: int) -> Callable[[Grads], None]:
    def keep(grads: Grads) -> None:
        kept[slot] = grads

    return keep


def _clamp(grads: Grads) -> Callable[[Grads], Grads]:
    return lambda _flowing: grads


def _one_recompute(grouped: bool) -> contextlib.AbstractContextManager[object]:
    """Makes a remat region recompute once across W's calls (they run disjoint nodes) and its
    reads of saved tensors (a read outside a backward would recompute the region each time),
    where the plan says W needs it (SplitPlan.grouped)."""
    group, current = _GRAPH_EXEC_GROUP, _CURRENT_GRAPH_EXEC_GROUP
    if not grouped or group is None or current is None or current() is not None:
        return contextlib.nullcontext()
    context: contextlib.AbstractContextManager[object] = group()
    return context


# what _one_recompute uses, where this torch has it
_GRAPH_EXEC_GROUP = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
_CURRENT_GRAPH_EXEC_GROUP = getattr(torch._C, "_get_graph_exec_group", None)
