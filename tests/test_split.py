"""Tests for passes.split: one GraphModule per stage, joined by explicit send/recv nodes.

Every test runs the stage graphs the way one process would: in stage order, with a mailbox
`Comm` that holds each sent value until its recv takes it. The reference models are compared
with their eager outputs (resnet in eval mode, gpt with dropout=0.0; see test_transparency.py);
partitions use the deterministic "a100" profile because only their shape matters here.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx import GraphModule, Node

import fxpipe
from fxpipe import ir
from fxpipe.models import MODELS
from fxpipe.models import load as load_model
from fxpipe.passes.cost import annotate_costs
from fxpipe.passes.partition import partition
from fxpipe.passes.split import StageGraph, shared_parameters, split_stages
from fxpipe.profile import get_profile

PROFILE = get_profile("a100")  # a datasheet preset: deterministic, no CPU micro-benchmark
STAGES = (1, 2, 3, 4)



class Mailbox:
    """A Comm for running every stage in one process: a send parks the value, its recv takes it."""

    def __init__(self) -> None:
        self.box: dict[tuple[str, int, int], Any] = {}
        self.stage = -1

    def bind(self, stage: int) -> Mailbox:
        self.stage = stage
        return self

    def recv(self, tag: str, src: int) -> Any:
        return self.box.pop((tag, src, self.stage))

    def send(self, value: Any, tag: str, dst: int) -> None:
        key = (tag, self.stage, dst)
        assert key not in self.box, f"{tag} sent twice from stage {self.stage} to {dst}"
        self.box[key] = value


@dataclass(frozen=True)
class Captured:
    model: nn.Module
    inputs: tuple
    kwargs: dict[str, torch.Tensor]
    gm: GraphModule
    expected: Any  # the eager model's output on (inputs, kwargs)


@functools.cache
def captured(name: str) -> Captured:
    """A reference model, its costed capture and its eager output (shared: do not modify)."""
    model, inputs, kwargs = load_model(name, deterministic=True)
    gm = fxpipe.capture(model, inputs, kwargs, inline_modules=True)
    annotate_costs(gm)
    with torch.no_grad():
        expected = model(*inputs, **kwargs)
    return Captured(model, inputs, kwargs, gm, expected)


@dataclass(frozen=True)
class Split:
    stages: list[StageGraph]
    stage_of: dict[str, int]  # compute node name -> stage, as partition assigned it


@functools.cache
def split_of(name: str, num_stages: int) -> Split:
    gm = captured(name).gm
    partition(gm, num_stages, microbatch_size=4, chunks=2, profile=PROFILE)
    ir.verify(gm, after="partition")
    stages = split_stages(gm, num_stages)
    return Split(stages, {n.name: ir.stage(n) for n in ir.compute_nodes(gm.graph)})


def run_stages(gm: GraphModule, stages: list[StageGraph], inputs: tuple,
               kwargs: dict | None = None) -> Any:
    """Runs the stage graphs in order in this process; returns the model-structured outputs."""
    signature = gm.meta[ir.CAPTURE].signature
    flat = signature.flatten_inputs(inputs, kwargs or {})
    env = dict(zip([n.name for n in gm.graph.nodes if n.op == "placeholder"], flat))
    mailbox = Mailbox()
    out = None
    with torch.no_grad():
        for st in stages:
            out = st.graph_module(mailbox.bind(st.index), *[env[name] for name in st.inputs])
    assert not mailbox.box, f"values sent but never received: {sorted(mailbox.box)}"
    return signature.unflatten_outputs(out)


def comm_nodes(st: StageGraph, kind: str) -> list[Node]:
    return [n for n in st.graph_module.graph.nodes
            if ir.is_comm(n) and ir.comm(n).kind == kind]


def own_compute(st: StageGraph) -> list[Node]:
    """The stage's compute nodes that partition assigned to it (not recomputed input sizes)."""
    return [n for n in ir.compute_nodes(st.graph_module.graph) if ir.STAGE in n.meta]


def resolve(gm: torch.nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


CASES = [pytest.param(name, k, id=f"{name}-{k}stages") for name in MODELS for k in STAGES]


# --- every reference model x stages ------------------------------------------------------------


@pytest.mark.parametrize(("name", "num_stages"), CASES)
def test_stages_run_in_order_reproduce_the_model_outputs(name, num_stages):
    case = captured(name)
    stages = split_of(name, num_stages).stages
    assert [st.index for st in stages] == list(range(num_stages))
    assert [st.is_last for st in stages] == [False] * (num_stages - 1) + [True]

    outputs = run_stages(case.gm, stages, case.inputs, case.kwargs)

    torch.testing.assert_close(outputs, case.expected)


@pytest.mark.parametrize(("name", "num_stages"), CASES)
def test_every_stage_graph_passes_verify_after_split(name, num_stages):
    for st in split_of(name, num_stages).stages:
        ir.verify(st.graph_module, after="split")


@pytest.mark.parametrize(("name", "num_stages"), CASES)
def test_every_send_has_exactly_one_matching_recv_and_every_recv_one_send(name, num_stages):
    stages = split_of(name, num_stages).stages
    sends = [(st.index, ir.comm(n).peer, ir.comm(n).tag) for st in stages
             for n in comm_nodes(st, "send")]
    recvs = [(ir.comm(n).peer, st.index, ir.comm(n).tag) for st in stages
             for n in comm_nodes(st, "recv")]

    assert len(set(sends)) == len(sends), "a value is sent twice to the same stage"
    assert len(set(recvs)) == len(recvs), "a value is received twice from the same stage"
    assert sorted(sends) == sorted(recvs)
    # StageGraph's summaries describe the same nodes
    for st in stages:
        assert [ir.comm(n) for n in comm_nodes(st, "send")] == list(st.sends)
        assert [ir.comm(n) for n in comm_nodes(st, "recv")] == list(st.recvs)
        assert all(c.peer > st.index for c in st.sends)
        assert all(c.peer < st.index for c in st.recvs)


@pytest.mark.parametrize(("name", "num_stages"), CASES)
def test_every_compute_node_of_the_captured_graph_is_in_exactly_one_stage_graph(name, num_stages):
    gm = captured(name).gm
    split = split_of(name, num_stages)
    expected = [n.name for n in ir.compute_nodes(gm.graph)]
    found = [n.name for st in split.stages for n in own_compute(st)]

    assert sorted(found) == sorted(expected)
    for st in split.stages:
        assert all(split.stage_of[n.name] == st.index == ir.stage(n) for n in own_compute(st))
        # anything else is a non-tensor value recomputed from model inputs (e.g. x.size(0))
        extra = [n for n in ir.compute_nodes(st.graph_module.graph) if ir.STAGE not in n.meta]
        assert all(not isinstance(ir.value_info(n), ir.TensorInfo) for n in extra), extra


@pytest.mark.parametrize(("name", "num_stages"), CASES)
def test_recvs_come_before_all_compute_nodes_and_sends_after_them(name, num_stages):
    for st in split_of(name, num_stages).stages:
        order = {n: i for i, n in enumerate(st.graph_module.graph.nodes)}
        compute = [order[n] for n in ir.compute_nodes(st.graph_module.graph)]
        recvs = [order[n] for n in comm_nodes(st, "recv")]
        sends = [order[n] for n in comm_nodes(st, "send")]
        assert compute, f"stage {st.index} has no compute node"
        assert max(recvs, default=-1) < min(compute)
        assert min(sends, default=len(order)) > max(compute)


@pytest.mark.parametrize(("name", "num_stages"), CASES)
def test_values_are_received_straight_from_the_stage_that_computes_them(name, num_stages):
    split = split_of(name, num_stages)
    for st in split.stages:
        for c in st.recvs:
            assert split.stage_of[c.tag] == c.peer, f"{c.tag} relayed through stage {c.peer}"


# --- particular structures ---------------------------------------------------------------------


def test_tied_embedding_and_lm_head_share_one_parameter_in_the_first_and_last_gpt_stage():
    case = captured("gpt")
    stages = split_of("gpt", 3).stages
    weight = case.model.wte.weight
    assert case.model.lm_head.weight is weight

    assert shared_parameters(stages) == {"wte.weight": [0, 2]}
    for index in (0, 2):
        gm = stages[index].graph_module
        tied = [n for n in gm.graph.nodes if n.op == "get_attr" and resolve(gm, n.target) is weight]
        assert len(tied) == 1, f"stage {index}: {tied}"
    assert not any(resolve(stages[1].graph_module, t) is weight for t in stages[1].attrs)


def test_unet_skip_connection_goes_straight_to_a_non_adjacent_stage():
    stages = split_of("unet", 4).stages
    skips = [(st.index, c.peer, c.tag) for st in stages for c in st.sends if c.peer > st.index + 1]
    assert skips, "no value crosses more than one stage boundary"

    for src, dst, tag in skips:
        assert (tag, src) in {(c.tag, c.peer) for c in stages[dst].recvs}
        for middle in stages[src + 1:dst]:
            assert tag not in {c.tag for c in middle.recvs}, f"stage {middle.index} receives {tag}"
            assert tag not in {c.tag for c in middle.sends}, f"stage {middle.index} relays {tag}"


class LateInput(nn.Module):
    """y is only used by the very last operation."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                                  nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * y


@pytest.mark.parametrize("num_stages", (2, 3), ids=lambda k: f"{k}stages")
def test_a_model_input_used_only_at_the_end_is_an_input_of_the_last_stage_only(num_stages):
    model = LateInput()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    gm = fxpipe.capture(model, (x, y), inline_modules=True)
    annotate_costs(gm)
    partition(gm, num_stages, microbatch_size=3, chunks=2, profile=PROFILE)
    stages = split_stages(gm, num_stages)

    assert "y" in stages[-1].inputs
    assert "y" not in stages[0].inputs and "x" in stages[0].inputs
    assert all("y" not in st.inputs for st in stages[:-1])
    assert not any(c.tag == "y" for st in stages for c in st.sends)
    torch.testing.assert_close(run_stages(gm, stages, (x, y)), model(x, y))


class SizesAcrossStages(nn.Module):
    """Non-tensor values used after they are computed: a size of a model input, a constant and a
    size of an activation (which depends on the micro-batch size)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(4, 4)
        self.fc3 = nn.Linear(16, 3)
        self.shift = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.size(0)  # from a model input: recomputed wherever it is needed
        h = torch.relu(self.fc1(x)).view(-1, 4, 4)
        n = h.shape[-1]  # 4 at every batch size: folded
        b = h.size(0)  # from an activation: sent
        h = torch.tanh(self.fc2(h))
        return self.fc3(h.reshape(rows, n * n)) + self.shift.expand(b, 3)


def _scalar_nodes(gm: GraphModule) -> tuple[Node, Node, Node]:
    nodes = ir.compute_nodes(gm.graph)
    sizes = [n for n in nodes if n.op == "call_method" and n.target == "size"]
    input_size = next(n for n in sizes if n.args[0].op == "placeholder")
    activation_size = next(n for n in sizes if n.args[0].op != "placeholder")
    constant = next(n for n in nodes if isinstance(ir.value_info(n), ir.ScalarInfo)
                    and ir.value_info(n).value == 4)
    return input_size, constant, activation_size


def test_non_tensor_values_crossing_stages_are_folded_or_sent_and_work_at_any_batch_size():
    model = SizesAcrossStages()
    gm = fxpipe.capture(model, (torch.randn(6, 8),), inline_modules=True)
    annotate_costs(gm)
    input_size, constant, activation_size = _scalar_nodes(gm)
    count = len(ir.compute_nodes(gm.graph))
    sent_activation_size = 0
    for first in range(1, count):  # every cut position
        partition(gm, 2, microbatch_size=3, chunks=2, profile=PROFILE,
                  balance=[first, count - first])
        stages = split_stages(gm, 2)
        sent = {c.tag for c in stages[0].sends}

        assert input_size.name not in sent and constant.name not in sent
        crosses = ir.stage(activation_size) == 0 and any(
            ir.stage(u) == 1 for u in activation_size.users)
        assert (activation_size.name in sent) == crosses, (first, sent)
        sent_activation_size += crosses
        for batch in (6, 3, 5):  # the example batch and other micro-batch sizes
            x = torch.randn(batch, 8)
            torch.testing.assert_close(run_stages(gm, stages, (x,)), model(x),
                                       msg=lambda m, f=first, b=batch: f"cut {f}, batch {b}: {m}")
    assert sent_activation_size, "no cut separated h.size(0) from its user"


def test_parameters_keep_their_qualified_names():
    for name in MODELS:
        case = captured(name)
        model_tensors = dict(case.model.named_parameters(remove_duplicate=False))
        model_tensors.update(case.model.named_buffers(remove_duplicate=False))
        for st in split_of(name, 3).stages:
            for node in st.graph_module.graph.nodes:
                if node.op != "get_attr":
                    continue
                qualified = ir.qualname(case.gm, node.target)
                assert qualified in model_tensors, f"{name}: {node.target} -> {qualified}"
                assert resolve(st.graph_module, node.target) is model_tensors[qualified]


def test_stage_graphs_alone_map_their_attributes_to_the_models_names():
    case = captured("gpt")
    model_names = {n for n, _ in case.model.named_parameters(remove_duplicate=False)}
    for st in split_of("gpt", 2).stages:
        names = {ir.qualname(st.graph_module, t) for t in st.attrs}
        assert names <= model_names, sorted(names - model_names)[:3]


def test_split_stages_leaves_the_input_graph_untouched():
    model = LateInput()
    gm = fxpipe.capture(model, (torch.randn(6, 8), torch.randn(6, 4)), inline_modules=True)
    annotate_costs(gm)
    partition(gm, 3, microbatch_size=3, chunks=2, profile=PROFILE)
    before_code, before_count = gm.code, len(gm.graph.nodes)
    before_meta = {n.name: dict(n.meta) for n in gm.graph.nodes}

    split_stages(gm, 3)

    assert len(gm.graph.nodes) == before_count
    assert gm.code == before_code
    assert {n.name: dict(n.meta) for n in gm.graph.nodes} == before_meta
    gm.graph.lint()


def test_stage_graphs_write_their_code_when_read_and_the_history_shows_it() -> None:
    """Stage modules generate their Python code lazily (128 stages need not all be compiled at
    once); called or read, they are the GraphModules fx makes, and the build's history shows
    each stage's code."""
    model, inputs, kwargs = load_model("mlp")
    program = fxpipe.compile(model, inputs, example_kwargs=kwargs, stages=2, chunks=2,
                             profile="a100")
    stages = [s for s in program.history if s.after.startswith("split_stages")]
    assert [s.after for s in stages] == [f"split_stages + mark_remat: stage {i}" for i in (0, 1)]
    for snapshot, stage in zip(stages, program.built.stages):
        assert isinstance(stage.graph_module, GraphModule)
        assert "def forward(self, comm" in snapshot.text
        assert snapshot.text == stage.graph_module.code
