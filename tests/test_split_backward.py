"""The split backward (fxpipe.runtime.execution.split_backward): I then W equals one full backward,
and W runs only the weights' part of the graph.

Each test builds a small stage-like computation by hand (received leaves that require grad,
parameters, outputs with the gradients the next stage would send, or a loss), runs
`input_backward` and later `WeightPass.run`, and compares the leaves' gradients and every
parameter's .grad with a plain `torch.autograd.backward` on an identical copy. `check` runs two
micro-batches, the second following the plan the first one's graph was read into. Counting
autograd Functions show which nodes ran in which half; counting engine calls and Python calls
show what a micro-batch costs once its stage's plan is read.
"""
from __future__ import annotations

import copy
import gc
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from fxpipe.errors import PipelineRuntimeError
from fxpipe.runtime.execution import split_backward
from fxpipe.runtime.execution.split_backward import SplitPlans, WeightPass, input_backward
from fxpipe.runtime.stage import checkpoint
from fxpipe.testing.engine_calls import EngineCalls

Outputs = list[torch.Tensor]


def counting() -> Any:
    """A fresh identity autograd Function whose backward counts its calls in `.calls`."""

    class Counting(torch.autograd.Function):
        calls = 0

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            Counting.calls += 1
            return grad

    return Counting


def params(module: nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def run_split(module: nn.Module, received: Sequence[torch.Tensor],
              grads: Sequence[torch.Tensor | None] | None = None,
              plans: SplitPlans | None = None, direct: bool = False, release: bool = False,
              ) -> tuple[list[torch.Tensor | None], WeightPass]:
    leaves = [r.clone().requires_grad_() for r in received]
    outputs = module(*leaves)
    got, weight_pass = input_backward(outputs, grads or [None] * len(outputs), leaves,
                                      plans=plans, direct=direct, release=release)
    return got, weight_pass


def run_full(module: nn.Module, received: Sequence[torch.Tensor],
             grads: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor | None]:
    leaves = [r.clone().requires_grad_() for r in received]
    outputs = module(*leaves)
    torch.autograd.backward(outputs, grads or [None] * len(outputs))
    return [leaf.grad for leaf in leaves]


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def check(module: nn.Module, received: Sequence[torch.Tensor],
          grads: Sequence[torch.Tensor | None] | None = None, *, fallback: bool,
          direct: bool | None = None) -> None:
    """Split on `module`, full backward on a copy: same leaf gradients, same .grad, for two
    micro-batches (the second follows the first one's plan); with W computing linears' and
    norms' weight gradients itself (`direct`, on `module`) and through the engine (on a copy),
    or only as `direct` says."""
    engine = copy.deepcopy(module) if direct is None else None
    _check(module, received, grads, fallback, True if direct is None else direct)
    if engine is not None:
        _check(engine, received, grads, fallback, False)


def _check(module: nn.Module, received: Sequence[torch.Tensor],
           grads: Sequence[torch.Tensor | None] | None, fallback: bool, direct: bool) -> None:
    reference = copy.deepcopy(module)
    plans: SplitPlans = {}
    for _ in range(2):
        got, weight_pass = run_split(module, received, grads, plans, direct)
        assert weight_pass.fallback == fallback
        weight_pass.run(params(module))
        expected = run_full(reference, received, grads)
        for g, e in zip(got, expected):
            if e is None:
                assert g is None
            else:
                assert g is not None
                torch.testing.assert_close(g, e)
        assert_same_grads(module, reference)
    assert len(plans) == 1


# -- stages ---------------------------------------------------------------------------------------


class Block(nn.Module):
    """A residual MLP block, the shape of a transformer layer's second half."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class Middle(nn.Module):
    """A middle stage: received x, two blocks, sends the result."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x: torch.Tensor) -> Outputs:
        return [self.blocks(x)]


def test_split_backward_of_a_middle_stage_equals_a_full_backward() -> None:
    check(Middle(), [torch.randn(4, 8)], [torch.randn(4, 8)], fallback=False)


def test_the_weight_pass_is_exact_where_torch_has_no_engine_entry_to_call(monkeypatch) -> None:
    # W calls the engine as torch.autograd.backward does, without its checks; a torch without
    # that entry point takes torch.autograd.backward itself
    monkeypatch.delattr(torch.autograd.graph, "_engine_run_backward")
    check(Middle(), [torch.randn(4, 8)], [torch.randn(4, 8)], fallback=False)


def test_the_last_stage_loss_starts_from_a_none_gradient() -> None:
    class Last(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> Outputs:
            return [self.head(self.block(x)).logsumexp(-1).mean()]

    check(Last(), [torch.randn(4, 8)], fallback=False)


def test_input_pass_runs_no_weight_only_node_and_weight_pass_no_input_only_node() -> None:
    to_input, to_weight = counting(), counting()

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Outputs:
            h = to_input.apply(self.a(to_input.apply(x)))  # only on the way to x
            return [torch.nn.functional.linear(h, to_weight.apply(self.b.weight), self.b.bias)]

    stage = Stage()
    reference = copy.deepcopy(stage)
    grad = torch.randn(4, 8)
    _, weight_pass = run_split(stage, [torch.randn(4, 8)], [grad])
    assert (to_input.calls, to_weight.calls) == (2, 0)
    weight_pass.run(params(stage))
    assert (to_input.calls, to_weight.calls) == (2, 1)
    run_full(reference, [torch.randn(4, 8)], [grad])  # also counts: a full walk runs both
    assert (to_input.calls, to_weight.calls) == (4, 2)


def test_weight_pass_does_not_walk_the_input_path_between_layers() -> None:
    between = counting()

    class Deep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

        def forward(self, x: torch.Tensor) -> Outputs:
            for layer in self.layers:
                x = between.apply(torch.tanh(layer(x)))
            return [x]

    check(Deep(), [torch.randn(4, 8)], [torch.randn(4, 8)], fallback=False)
    # per micro-batch: in I and in the reference, not W; W through the engine and not
    assert between.calls == 2 * 2 * (4 + 4)


def test_first_stage_without_received_leaves_falls_back_to_a_full_weight_pass() -> None:
    path = counting()

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.block = Block()

        def forward(self) -> Outputs:
            return [path.apply(self.block(self.emb(torch.tensor([1, 2, 3]))))]

    stage = First()
    reference = copy.deepcopy(stage)
    grad = torch.randn(3, 8)
    got, weight_pass = run_split(stage, [], [grad])
    assert got == [] and weight_pass.fallback and path.calls == 0  # I has nothing to do
    weight_pass.run(params(stage))
    assert path.calls == 1
    run_full(reference, [], [grad])
    assert_same_grads(stage, reference)


def test_an_output_that_depends_on_no_received_leaf_makes_the_micro_batch_fall_back() -> None:
    class TwoOutputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.scale = nn.Parameter(torch.randn(8))
            self.model_input = torch.randn(4, 8)

        def forward(self, x: torch.Tensor) -> Outputs:
            # scale reaches the outputs both through the received x and beside it
            return [self.lin(x) * self.scale, self.scale * self.model_input]

    check(TwoOutputs(), [torch.randn(4, 8)], [torch.randn(4, 8), torch.randn(4, 8)],
          fallback=True)


def test_a_weight_used_only_beside_the_received_leaf_makes_the_micro_batch_fall_back() -> None:
    class Beside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.other = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Outputs:
            return [self.lin(x), self.other(torch.ones(2, 8))]

    check(Beside(), [torch.randn(4, 8)], [torch.randn(4, 8), torch.randn(2, 8)], fallback=True)


def test_an_output_outside_the_input_closure_that_reaches_no_weight_does_not_fall_back() -> None:
    lin = nn.Linear(8, 8)
    reference = copy.deepcopy(lin)
    x, side = torch.randn(4, 8), torch.randn(4, 8)
    grads = [torch.randn(4, 8), torch.randn(4, 8)]
    leaf, aside = x.clone().requires_grad_(), side.clone().requires_grad_()
    got, weight_pass = input_backward([lin(leaf), aside * 3], grads, [leaf],
                                      weights=list(lin.parameters()))
    assert not weight_pass.fallback
    weight_pass.run(list(lin.parameters()))
    leaf2 = x.clone().requires_grad_()
    torch.autograd.backward([reference(leaf2)], grads[:1])
    torch.testing.assert_close(got[0], leaf2.grad)
    assert_same_grads(lin, reference)


def test_a_weight_pass_given_a_weight_the_input_pass_did_not_serve_refuses_it() -> None:
    lin, extra = nn.Linear(8, 8), nn.Parameter(torch.randn(8))
    leaf = torch.randn(4, 8, requires_grad=True)
    _, weight_pass = input_backward([lin(leaf) * extra], [torch.randn(4, 8)], [leaf],
                                    weights=list(lin.parameters()))
    with pytest.raises(PipelineRuntimeError, match="was not given"):
        weight_pass.run([*lin.parameters(), extra])


def test_a_tied_weight_used_above_and_below_other_layers_gets_its_exact_gradient() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(8, 8)
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Outputs:
            h = torch.tanh(self.shared(x))
            h = torch.tanh(self.a(h))
            h = torch.tanh(self.shared(h))  # a path through the input closure joins both uses
            return [self.shared(self.b(h))]

    check(Tied(), [torch.randn(4, 8)], [torch.randn(4, 8)], fallback=False)


def test_a_tied_weight_inside_a_remat_region_is_exact() -> None:
    class TiedRemat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(8, 8)
            self.a = nn.Linear(8, 8)  # its node lies on the path that joins both uses

        def region(self, x: torch.Tensor) -> torch.Tensor:
            return self.shared(torch.tanh(self.a(torch.tanh(self.shared(x)))))

        def forward(self, x: torch.Tensor) -> Outputs:
            return [checkpoint(self.region, x, enabled=True)]

    check(TiedRemat(), [torch.randn(4, 8)], [torch.randn(4, 8)], fallback=False)


def test_a_tied_weight_used_side_by_side_gets_its_exact_gradient() -> None:
    class SideBySide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> Outputs:
            return [self.shared(x) + self.shared(y)]

    check(SideBySide(), [torch.randn(4, 8), torch.randn(4, 8)], [torch.randn(4, 8)],
          fallback=False)


def test_a_tensor_hook_on_an_intermediate_output_applies_once() -> None:
    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Outputs:
            h = self.a(x)
            h.register_hook(lambda grad: grad * 2)  # runs before the node that made h
            return [self.b(torch.tanh(h))]

    # W through the engine: a caller that computes weight gradients itself (direct) vouches
    # that no such hook exists, as generated stage code registers none
    check(Hooked(), [torch.randn(4, 8)], [torch.randn(4, 8)], fallback=False, direct=False)


def test_frozen_parameters_and_buffers_get_no_gradient() -> None:
    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(8, 8)
            self.frozen.requires_grad_(False)
            self.trained = nn.Linear(8, 8)
            self.register_buffer("shift", torch.randn(8))

        def forward(self, x: torch.Tensor) -> Outputs:
            return [self.trained(self.frozen(x) + self.shift)]

    stage = Frozen()
    check(stage, [torch.randn(4, 8)], [torch.randn(4, 8)], fallback=False)
    assert stage.frozen.weight.grad is None and stage.trained.weight.grad is not None


def test_a_parameter_that_scales_the_received_leaf_gets_its_exact_gradient() -> None:
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Parameter(torch.randn(8))  # used right at the received value
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Outputs:
            return [self.lin(torch.tanh(x * self.gate))]

    check(Gate(), [torch.randn(4, 8)], [torch.randn(4, 8)], fallback=False)


def test_in_place_ops_and_views_keep_the_gradients_exact() -> None:
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.scale = nn.Parameter(torch.randn(4))
            self.bias = nn.Parameter(torch.randn(8))

        def forward(self, x: torch.Tensor) -> Outputs:
            h = self.lin(x)
            h[:, :4].mul_(self.scale)  # in place on a view: CopySlices
            h.add_(self.bias)
            return [h.t(), h.view(2, 16)[0]]  # sent values that are views

    check(InPlace(), [torch.randn(4, 8)], [torch.randn(8, 4), torch.randn(16)], fallback=False)


def test_outputs_that_are_a_tuple_of_tensors_get_exact_gradients() -> None:
    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> Outputs:
            a, b = self.lin(x).chunk(2, dim=-1)  # one node with two outputs
            return [a * self.w, b, y]  # y: a received leaf sent on as it is

    check(Split(), [torch.randn(4, 8), torch.randn(3)],
          [torch.randn(4, 4), torch.randn(4, 4), torch.randn(3)], fallback=False)


def test_weight_passes_run_in_another_order_and_add_to_existing_grads() -> None:
    stage = Middle()
    reference = copy.deepcopy(stage)
    for module in (stage, reference):
        for p in module.parameters():
            p.grad = torch.ones_like(p)
    batches = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(3)]
    passes = [run_split(stage, [x], [g])[1] for x, g in batches]
    for k in (2, 0, 1):
        passes[k].run(params(stage))
    for x, g in batches:
        run_full(reference, [x], [g])
    assert_same_grads(stage, reference)


def test_fallback_and_split_micro_batches_mix_in_any_order() -> None:
    class Sometimes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()
            self.side = nn.Parameter(torch.randn(8))
            self.beside = False

        def forward(self, x: torch.Tensor) -> Outputs:
            out = [self.block(x) * self.side]
            return out + [self.side * 2.0] if self.beside else out

    stage = Sometimes()
    reference = copy.deepcopy(stage)
    batches = []
    for mb in range(4):
        grads = [torch.randn(4, 8)] + ([torch.randn(8)] if mb % 2 else [])
        batches.append((mb % 2 == 1, torch.randn(4, 8), grads))
    passes = []
    for beside, x, grads in batches:
        stage.beside = beside
        passes.append(run_split(stage, [x], grads)[1])
    assert [p.fallback for p in passes] == [False, True, False, True]
    for k in (3, 0, 2, 1):
        passes[k].run(params(stage))
    for beside, x, grads in batches:
        reference.beside = beside
        run_full(reference, [x], grads)
    assert_same_grads(stage, reference)


class Remat(nn.Module):
    """A block inside a remat region that counts how often it runs."""

    def __init__(self, region_runs: list[int]) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(8, 8)
        self.runs = region_runs

    def region(self, x: torch.Tensor) -> torch.Tensor:
        self.runs.append(1)
        return self.block(x)

    def forward(self, x: torch.Tensor) -> Outputs:
        return [self.head(checkpoint(self.region, x, enabled=True))]


@pytest.mark.parametrize("direct", [False, True])
def test_remat_is_exact_and_the_weight_pass_recomputes_a_region_once(direct: bool) -> None:
    runs: list[int] = []
    stage = Remat(runs)
    reference = copy.deepcopy(stage)
    reference.runs = []
    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    got, weight_pass = run_split(stage, [x], [grad], direct=direct)
    assert len(runs) == 2  # forward, and the recompute of I
    weight_pass.run(params(stage))
    assert len(runs) == 3  # the region holds three weight groups; W recomputes it once
    expected = run_full(reference, [x], [grad])
    torch.testing.assert_close(got[0], expected[0])
    assert_same_grads(stage, reference)


def test_remat_on_a_stage_that_falls_back_is_exact() -> None:
    runs: list[int] = []
    stage = Remat(runs)
    reference = copy.deepcopy(stage)
    model_input, grad = torch.randn(4, 8), torch.randn(4, 8)  # no received leaf: the first stage
    _, weight_pass = input_backward(stage(model_input), [grad], [])
    assert weight_pass.fallback
    weight_pass.run(params(stage))
    assert len(runs) == 2  # forward, and the recompute of W's full backward
    torch.autograd.backward(reference(model_input), [grad])
    assert_same_grads(stage, reference)


class Probe(torch.autograd.Function):
    """Identity whose autograd node holds a marker, to see when the node is freed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.marker = Marker()
        Marker.last = weakref.ref(ctx.marker)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Marker:
    last: Any = None


def test_input_pass_frees_the_graph_above_the_intermediates() -> None:
    lin = nn.Linear(8, 8)
    leaf = torch.randn(4, 8, requires_grad=True)
    outputs = [Probe.apply(lin(leaf))]
    _, weight_pass = input_backward(outputs, [torch.randn(4, 8)], [leaf])
    gc.collect()
    assert not weight_pass.fallback and Marker.last() is None  # outputs held, graph not
    weight_pass.run(list(lin.parameters()))
    assert lin.weight.grad is not None


def test_a_sent_value_that_a_later_node_saves_stays_usable_by_the_weight_pass() -> None:
    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Outputs:
            y = self.a(x)
            return [y, self.b(y)]  # b saved y to compute its weight's gradient

    check(Skip(), [torch.randn(4, 8)], [torch.randn(4, 8), torch.randn(4, 8)], fallback=False)


def test_input_pass_keeps_the_whole_graph_when_the_weight_pass_falls_back() -> None:
    lin = nn.Linear(8, 8)
    leaf = torch.randn(4, 8, requires_grad=True)
    outputs = [Probe.apply(lin(leaf)), lin(torch.ones(4, 8))]
    _, weight_pass = input_backward(outputs, [torch.randn(4, 8), torch.randn(4, 8)], [leaf])
    del outputs
    gc.collect()
    assert weight_pass.fallback and Marker.last() is not None
    weight_pass.run(list(lin.parameters()))
    del weight_pass
    gc.collect()
    assert Marker.last() is None


def test_a_weight_pass_runs_only_once() -> None:
    _, weight_pass = run_split(Middle(), [torch.randn(4, 8)], [torch.randn(4, 8)])
    weight_pass.run()
    with pytest.raises(PipelineRuntimeError, match="already run"):
        weight_pass.run()


# -- reading a stage's graph once -----------------------------------------------------------------


class Chain(nn.Module):
    """`depth` layers one after another: each Linear's node is an intermediate, and a path
    through the input closure leads from each to the ones below."""

    def __init__(self, depth: int, extra_after: int | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(depth))
        self.extra_after = extra_after  # a layer after which one more op runs (another shape)

    def forward(self, x: torch.Tensor) -> Outputs:
        for k, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if k == self.extra_after:
                x = x * 2
        return [x]


def test_later_micro_batches_follow_the_plan_without_reading_the_graph(monkeypatch) -> None:
    reads: list[int] = []
    read = split_backward.Graph

    def counted(roots: Any) -> Any:
        reads.append(1)
        return read(roots)

    monkeypatch.setattr(split_backward, "Graph", counted)
    stage = Chain(4)
    reference = copy.deepcopy(stage)
    plans: SplitPlans = {}
    batches = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(3)]
    passes = [run_split(stage, [x], [g], plans) for x, g in batches]
    assert len(reads) == 1 and len(plans) == 1
    for k in (2, 0, 1):
        passes[k][1].run(params(stage))
    for (x, g), (got, _) in zip(batches, passes):
        torch.testing.assert_close(got[0], run_full(reference, [x], [g])[0])
    assert_same_grads(stage, reference)


def test_a_graph_of_another_shape_is_read_anew_and_stays_exact(monkeypatch) -> None:
    reads: list[int] = []
    read = split_backward.Graph

    def counted(roots: Any) -> Any:
        reads.append(1)
        return read(roots)

    monkeypatch.setattr(split_backward, "Graph", counted)
    stage = Chain(4)
    reference = copy.deepcopy(stage)
    plans: SplitPlans = {}
    shapes = [None, 1, 1, None]  # the same roots (tanh), another node on the way in between
    for extra in shapes:
        stage.extra_after = reference.extra_after = extra
        x, g = torch.randn(4, 8), torch.randn(4, 8)
        got, weight_pass = run_split(stage, [x], [g], plans)
        weight_pass.run(params(stage))
        torch.testing.assert_close(got[0], run_full(reference, [x], [g])[0])
    assert_same_grads(stage, reference)
    assert len(reads) == 3  # the third micro-batch followed the second one's plan


def _python_calls_in_fxpipe(run: Any, *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """How many Python functions of fxpipe's files (helpers, hooks) `run(*args, **kwargs)`
    calls, and what it returns."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and "/fxpipe/" in frame.f_code.co_filename:
            calls += 1

    sys.setprofile(profile)
    try:
        result = run(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return calls, result


def test_after_the_first_micro_batch_i_is_one_engine_call_with_python_work_not_per_layer() -> None:
    costs = {}
    for depth in (2, 8):
        stage = Chain(depth)
        plans: SplitPlans = {}
        x, g = torch.randn(4, 8), torch.randn(4, 8)
        run_split(stage, [x], [g], plans)[1].run()  # reads the stage's plan
        leaf = x.clone().requires_grad_()
        outputs = stage(leaf)
        with EngineCalls() as input_calls:
            python, (_, weight_pass) = _python_calls_in_fxpipe(input_backward, outputs, [g],
                                                               [leaf], plans=plans)
        with EngineCalls() as weight_calls:
            weight_pass.run()
        costs[depth] = (input_calls.count, python, weight_calls.count)
    assert costs[2][0] == costs[8][0] == 1
    assert costs[2][1] == costs[8][1]  # no hook, no graph walk per intermediate
    # W: one call per layer's weights (a path through C joins the layers: backward_graph.py)
    assert (costs[2][2], costs[8][2]) == (2, 8)


def test_dropout_and_batchnorm_stages_follow_their_plan_exactly() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)
            self.drop = nn.Dropout(0.3)
            self.head = nn.Linear(4 * 5 * 5, 6)

        def forward(self, x: torch.Tensor) -> Outputs:
            h = self.drop(torch.relu(self.bn(self.conv(x))))
            return [self.head(h.flatten(1))]

    stage = Noisy().train()
    reference = copy.deepcopy(stage)
    plans: SplitPlans = {}
    passes, expected = [], []
    for mb in range(3):
        x, g = torch.randn(4, 3, 5, 5), torch.randn(4, 6)
        torch.manual_seed(mb)  # the same dropout masks in both
        got, weight_pass = run_split(stage, [x], [g], plans)
        passes.append((got, weight_pass))
        torch.manual_seed(mb)
        expected.append(run_full(reference, [x], [g]))
    for k in (1, 2, 0):
        passes[k][1].run(params(stage))
    for (got, _), want in zip(passes, expected):
        torch.testing.assert_close(got[0], want[0])
    assert len(plans) == 1
    assert_same_grads(stage, reference)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(stage.state_dict()[key], value, msg=key)


def test_nodes_that_do_not_list_their_inputs_keep_their_gradients_by_prehook(monkeypatch) -> None:
    monkeypatch.setattr(split_backward, "_inputs", lambda node: None)

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.w = nn.Parameter(torch.randn(4))
            self.block = Block()

        def forward(self, x: torch.Tensor) -> Outputs:
            h = self.lin(x)
            h.register_hook(lambda grad: grad * 2)
            a, b = self.block(h).chunk(2, dim=-1)  # one node with two outputs
            return [a * self.w, b]

    check(Both(), [torch.randn(4, 8)], [torch.randn(4, 4), torch.randn(4, 4)], fallback=False)


class Transformerish(nn.Module):
    """What a transformer stage's weights hang on: norms, linears on 3-D activations with and
    without a bias (addmm and mm behind views), a linear on 2-D rows."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8, bias=False)
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Outputs:
        h = x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))
        return [self.head(h.flatten(0, 1))]


def test_direct_weight_pass_computes_linears_and_norms_without_an_engine_call() -> None:
    check(Transformerish(), [torch.randn(2, 3, 8)], [torch.randn(6, 8)], fallback=False,
          direct=True)
    for depth in (2, 8):
        stage, plans = Chain(depth), {}
        x, g = torch.randn(4, 8), torch.randn(4, 8)
        reference = copy.deepcopy(stage)
        for _ in range(2):  # the second follows the plan
            _, weight_pass = run_split(stage, [x], [g], plans, direct=True)
            with EngineCalls() as weight_calls:
                weight_pass.run()
            assert weight_calls.count == 0
            run_full(reference, [x], [g])
        assert_same_grads(stage, reference)


def test_direct_weight_pass_under_autocast_casts_as_the_engine_does() -> None:
    """bfloat16 autocast puts a cast between each weight and its layer: W computes in the
    layer's dtype and casts, as the engine's W does."""
    stage = Transformerish()
    engine = copy.deepcopy(stage)
    x, g = torch.randn(2, 3, 8), torch.randn(6, 8)
    for module, direct in ((stage, True), (engine, False)):
        plans: SplitPlans = {}
        for _ in range(2):
            leaf = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outputs = module(leaf)
            _, weight_pass = input_backward(outputs, [g.bfloat16()], [leaf], plans=plans,
                                            direct=direct)
            with EngineCalls() as weight_calls:
                weight_pass.run()
            assert (weight_calls.count == 0) == direct
    for (name, p), q in zip(stage.named_parameters(), engine.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_direct_weight_pass_leaves_hooked_weights_to_the_engine() -> None:
    """A hook on a weight (replica averaging's, after its gradient accumulates) runs only in
    the engine: that layer's W takes the engine call, once per micro-batch."""
    stage = Transformerish()
    reference = copy.deepcopy(stage)
    fired: list[str] = []
    stage.up.weight.register_post_accumulate_grad_hook(lambda p: fired.append("up"))
    x, g = torch.randn(2, 3, 8), torch.randn(6, 8)
    plans: SplitPlans = {}
    for _ in range(2):
        _, weight_pass = run_split(stage, [x], [g], plans, direct=True)
        with EngineCalls() as weight_calls:
            weight_pass.run()
        assert weight_calls.count == 1
        run_full(reference, [x], [g])
    assert fired == ["up", "up"]
    assert_same_grads(stage, reference)


def test_direct_weight_pass_leaves_a_layer_whose_input_reaches_its_weight_to_the_engine() -> None:
    """A linear whose input is made from its own weight (not from what was received): the
    weight's gradient also flows through the input, which only the engine's W follows."""
    class OwnInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> Outputs:
            return [torch.addmm(x * 2, torch.tanh(self.w), self.w.t())]

    check(OwnInput(), [torch.randn(8, 8)], [torch.randn(8, 8)], fallback=False, direct=True)


class Convish(nn.Module):
    """A conv net's stage: convolutions with and without a bias, a norm, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.grouped = nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=2, bias=False)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> Outputs:
        h = torch.relu(self.norm(self.grouped(torch.relu(self.conv(x)))))
        return [self.head(h.mean(dim=(2, 3)))]


def test_direct_weight_pass_computes_convolutions_without_an_engine_call() -> None:
    check(Convish(), [torch.randn(2, 4, 6, 6)], [torch.randn(2, 3)], fallback=False)
    stage, plans = Convish(), {}
    x, g = torch.randn(2, 4, 6, 6), torch.randn(2, 3)
    _, weight_pass = run_split(stage, [x], [g], plans, direct=True)
    with EngineCalls() as weight_calls:
        weight_pass.run()
    assert weight_calls.count == 1  # the batch norm's weights only: not a layer of a recipe


class _Kernels(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten kernels that run while it is on, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _kernels_of_each_pass(stage: Transformerish) -> list[tuple[_Kernels, _Kernels]]:
    """I then W on `stage` for two micro-batches (the second follows the first's plan), each
    pass's kernels counted, and the gradients checked against a plain backward."""
    reference = copy.deepcopy(stage)
    x, g = torch.randn(2, 3, 8), torch.randn(6, 8)
    plans: SplitPlans = {}
    counted = []
    for _ in range(2):
        leaf = x.clone().requires_grad_()
        outputs = stage(leaf)
        with _Kernels() as input_kernels:
            _, weight_pass = input_backward(outputs, [g], [leaf], params(stage), plans,
                                            direct=True)
        with _Kernels() as weight_kernels:
            weight_pass.run(params(stage))
        counted.append((input_kernels, weight_kernels))
        run_full(reference, [x], [g])
    assert_same_grads(stage, reference)
    return counted


def test_a_layer_norms_weights_come_from_the_kernel_that_makes_its_input_gradient() -> None:
    """I asks for the norm's weights: native_layer_norm_backward runs once per micro-batch, in
    I, as in a plain backward, and W only accumulates what it returned."""
    for k, (input_kernels, weight_kernels) in enumerate(_kernels_of_each_pass(Transformerish())):
        assert input_kernels.counts.get("native_layer_norm_backward") == 1
        assert "native_layer_norm_backward" not in weight_kernels.counts
        # the three linears (up, down, head): a product of their own for the first micro-batch,
        # then multiplied straight into the gradient the first left
        assert weight_kernels.counts.get("addmm_" if k else "mm") == 3
        assert weight_kernels.counts.get("mm" if k else "addmm_") is None


def test_a_hooked_layer_norm_weight_is_left_to_the_weight_pass() -> None:
    stage = Transformerish()
    fired: list[str] = []
    stage.ln.weight.register_post_accumulate_grad_hook(lambda p: fired.append("ln"))
    for input_kernels, _ in _kernels_of_each_pass(stage):
        assert "native_layer_norm_backward" in input_kernels.counts  # the input's gradient
    assert fired == ["ln", "ln"]


def test_a_hook_put_on_a_norm_weight_between_the_passes_is_refused() -> None:
    stage = Transformerish()
    leaf = torch.randn(2, 3, 8).requires_grad_()
    _, weight_pass = input_backward(stage(leaf), [torch.randn(6, 8)], [leaf], params(stage),
                                    direct=True)
    stage.ln.weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(PipelineRuntimeError, match="between the input and the weight pass"):
        weight_pass.run(params(stage))


class _Boxed:
    """Saved-tensor hooks that box what autograd saves, so that a test can see (by weak
    references to the boxes) whether the graph still holds it."""

    class Box:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    def __init__(self) -> None:
        self.boxes: list[weakref.ref[_Boxed.Box]] = []

    def pack(self, t: torch.Tensor) -> _Boxed.Box:
        box = _Boxed.Box(t)
        self.boxes.append(weakref.ref(box))
        return box

    def held(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.boxes)


def test_a_releasing_input_pass_frees_the_graph_and_keeps_what_w_reads() -> None:
    """With `release`, I reads the linears' saved inputs and frees everything autograd saved,
    as a plain backward does; W computes from what I read. Without it, the graph stays."""
    stage = Transformerish()
    reference = copy.deepcopy(stage)
    x, g = torch.randn(2, 3, 8), torch.randn(6, 8)
    plans: SplitPlans = {}
    for release in (False, True, True):
        boxed = _Boxed()
        leaf = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(boxed.pack, lambda box: box.t):
            outputs = stage(leaf)
        saved = boxed.held()
        _, weight_pass = input_backward(outputs, [g], [leaf], params(stage), plans, direct=True,
                                        release=release)
        held = weight_pass.held()
        if release:
            assert boxed.held() == 0 < saved
            assert held is not None and len(held) == 3  # the inputs of up, down and head
        else:
            assert boxed.held() == saved and held is None
        with EngineCalls() as weight_calls:
            weight_pass.run(params(stage))
        assert weight_calls.count == 0
        run_full(reference, [x], [g])
    assert_same_grads(stage, reference)


@pytest.mark.parametrize("make", [Middle, Transformerish, Convish, lambda: Chain(3)])
def test_a_releasing_input_pass_is_exact_where_it_frees_and_where_it_cannot(make: Any) -> None:
    """A batch norm's weights (Convish) need the engine in W: that stage keeps its graph."""
    stage = make()
    reference = copy.deepcopy(stage)
    shape = (2, 4, 6, 6) if isinstance(stage, Convish) else (2, 3, 8)
    x = torch.randn(shape)
    g = [o.detach().clone().normal_() for o in reference(x.clone())]
    plans: SplitPlans = {}
    for _ in range(2):
        got, weight_pass = run_split(stage, [x], g, plans, direct=True, release=True)
        assert (weight_pass.held() is None) == isinstance(stage, Convish)
        weight_pass.run(params(stage))
        torch.testing.assert_close(got[0], run_full(reference, [x], g)[0])
    assert_same_grads(stage, reference)


def test_a_hook_put_on_a_weight_after_a_releasing_input_pass_is_refused() -> None:
    stage = Transformerish()
    leaf = torch.randn(2, 3, 8).requires_grad_()
    _, weight_pass = input_backward(stage(leaf), [torch.randn(6, 8)], [leaf], params(stage),
                                    direct=True, release=True)
    assert weight_pass.held() is not None
    stage.up.weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(PipelineRuntimeError, match="between the input and the weight pass"):
        weight_pass.run(params(stage))
