"""Tests for passes.partition: atoms, stage assignment, balance modes, memory limits and chunks.

The pure solver (passes.partition.solver) has its own literal and oracle tests; these check the
pass around it on captured graphs. Partitions use the deterministic "a100" preset unless the
exact numbers matter; the GPT benchmark uses the measured CPU profile, as the project requires.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx import GraphModule, Node

import fxpipe
from fxpipe import ir
from fxpipe.errors import FxPipeError, PartitionError
from fxpipe.models import MODELS, gpt, mlp
from fxpipe.models import load as load_model
from fxpipe.passes.cost import annotate_costs
from fxpipe.passes.partition import PartitionPlan, atoms_of, partition
from fxpipe.profile import get_profile
from fxpipe.runtime.planning.timeline import predicted_step
from fxpipe.units import human_time

PROFILE = get_profile("a100")  # a datasheet preset: deterministic, no CPU micro-benchmark



@dataclass(frozen=True)
class Captured:
    model: nn.Module
    inputs: tuple
    gm: GraphModule


@functools.cache
def captured(name: str) -> Captured:
    """A reference model and its costed capture (shared: tests re-partition it)."""
    model, inputs, kwargs = load_model(name, deterministic=True)
    gm = fxpipe.capture(model, inputs, kwargs, inline_modules=True)
    annotate_costs(gm)
    return Captured(model, inputs, gm)


def plan_for(name: str, num_stages: int, **options: Any) -> PartitionPlan:
    options = {"microbatch_size": 2, "chunks": 4, "profile": PROFILE, **options}
    return partition(captured(name).gm, num_stages, **options)


def stage_counts(gm: GraphModule, num_stages: int) -> list[int]:
    counts = collections.Counter(ir.stage(n) for n in ir.compute_nodes(gm.graph))
    return [counts[s] for s in range(num_stages)]


def is_glue(node: Node) -> bool:
    """Launches no kernel: getitem, view, size, shape arithmetic. (A multi-output operation
    that computes, such as an LSTM, is not glue.)"""
    if node.target in (operator.getitem, getattr, "view", "size", "dim"):
        return True
    return ir.cost(node).fwd_kernels == 0


def atom_cut_starts(gm: GraphModule, atom_cut: int) -> list[str]:
    """The first nodes of the 2-stage partition cutting before atom `atom_cut` (partition's
    `starts`: atoms need not be program-order prefixes, a constant joins its user's atom)."""
    atoms = atoms_of(gm)
    return [atoms[0][0].name, atoms[atom_cut][0].name]


# --- atoms -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_glue_nodes_are_never_alone_in_an_atom(name):
    atoms = atoms_of(captured(name).gm)
    for atom in atoms:
        assert any(not is_glue(n) for n in atom), [n.name for n in atom]


def test_glue_joins_the_atom_of_the_operation_that_produces_its_input():
    atoms = atoms_of(captured("gpt").gm)
    by_name = {n.name: i for i, atom in enumerate(atoms) for n in atom}
    assert by_name["blocks_0_attn_split"] == by_name["blocks_0_attn_c_attn"]
    assert by_name["blocks_0_attn_transpose"] == by_name["blocks_0_attn_c_attn"]
    assert by_name["blocks_0_attn_reshape"] == by_name["blocks_0_attn_scaled_dot_product_attention"]
    assert len(atoms) < len(ir.compute_nodes(captured("gpt").gm.graph))


@pytest.mark.parametrize("name", MODELS)
def test_every_compute_node_is_in_exactly_one_atom(name):
    gm = captured(name).gm
    counts = collections.Counter(n for atom in atoms_of(gm) for n in atom)
    assert set(counts) == set(ir.compute_nodes(gm.graph))
    assert set(counts.values()) == {1}


@pytest.mark.parametrize("name", MODELS)
def test_atoms_in_order_are_a_topological_order(name):
    gm = captured(name).gm
    order = [n for atom in atoms_of(gm) for n in atom]
    position = {n: i for i, n in enumerate(order)}
    for node in order:
        for arg in node.all_input_nodes:
            if arg in position:
                assert position[arg] < position[node], f"{node.name} before its input {arg.name}"


# --- stages ------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_stages", (1, 2, 3, 4), ids=lambda k: f"{k}stages")
@pytest.mark.parametrize("name", MODELS)
def test_every_compute_node_gets_a_stage_and_stages_are_contiguous(name, num_stages):
    gm = captured(name).gm
    plan = plan_for(name, num_stages)
    ir.verify(gm, after="partition")

    order = [n for atom in atoms_of(gm) for n in atom]
    stages = [ir.stage(n) for n in order]
    assert stages == sorted(stages)
    assert set(stages) == set(range(num_stages))
    assert len(plan.stages) == num_stages
    for s, stage in enumerate(plan.stages):
        assert set(stage.nodes) == {n.name for n in order if ir.stage(n) == s}
    assert plan.bottleneck == max(st.time for st in plan.stages)
    # the step as GPipe plays it with these stage times, at most (M+S-1) x the slowest stage
    assert plan.predicted_step_time == pytest.approx(predicted_step(plan, "gpipe")[0])
    assert plan.predicted_step_time <= (plan.chunks + num_stages - 1) * plan.bottleneck * 1.0001


# --- balance modes -----------------------------------------------------------------------------


def test_cost_balance_finds_the_fastest_two_stage_cut():
    gm = captured("gpt").gm
    best = plan_for("gpt", 2)
    assert best.balance == "cost"
    bottlenecks = [plan_for("gpt", 2, starts=atom_cut_starts(gm, cut)).bottleneck
                   for cut in range(1, len(atoms_of(gm)))]
    assert best.bottleneck == pytest.approx(min(bottlenecks), rel=1e-6)


def _stage_param_bytes(gm: GraphModule, num_stages: int, b: int) -> list[float]:
    totals = [0.0] * num_stages
    for node in ir.compute_nodes(gm.graph):
        totals[ir.stage(node)] += float(ir.evaluate(ir.cost(node).param_bytes, b))
    return totals


@pytest.mark.parametrize("name", ("mlp", "gpt"))
def test_params_balance_minimises_the_largest_stage_parameter_bytes(name):
    gm = captured(name).gm
    options = {"microbatch_size": 2, "chunks": 4, "profile": PROFILE}
    best = {}
    for cut in range(1, len(atoms_of(gm))):
        partition(gm, 2, starts=atom_cut_starts(gm, cut), **options)
        best[cut] = max(_stage_param_bytes(gm, 2, 2))

    plan = partition(gm, 2, balance="params", **options)

    assert plan.balance == "params"
    assert max(_stage_param_bytes(gm, 2, 2)) == min(best.values())


def test_params_balance_still_predicts_stage_times_in_seconds():
    plan = plan_for("mlp", 2, balance="params")
    same_cuts = plan_for("mlp", 2, balance=[len(s.nodes) for s in plan.stages])
    assert plan.bottleneck == pytest.approx(same_cuts.bottleneck)


@pytest.mark.parametrize("counts", ([1, -1], [-1, 1], [20, -1], [5, 20, -1], [1, 1, 1, -1]),
                         ids=str)
def test_explicit_counts_give_exactly_those_numbers_of_compute_nodes(counts):
    gm = captured("gpt").gm
    total = len(ir.compute_nodes(gm.graph))
    counts = [c if c > 0 else total - sum(x for x in counts if x > 0) for c in counts]

    plan = plan_for("gpt", len(counts), balance=counts)

    ir.verify(gm, after="partition")
    assert stage_counts(gm, len(counts)) == counts
    assert [len(s.nodes) for s in plan.stages] == counts
    order = [n.name for n in ir.compute_nodes(gm.graph)]
    assert [n for s in plan.stages for n in s.nodes] == order  # program order, cut as given


def _in(node: Node, module: str) -> bool:
    path = ir.module_path(node)
    return path == module or path.startswith(module + ".")


@pytest.mark.parametrize("points", (["blocks.1"], ["blocks.1", "ln_f"]), ids=str)
def test_split_points_start_each_stage_at_the_first_node_of_the_module(points):
    gm = captured("gpt").gm
    plan = plan_for("gpt", len(points) + 1, split_points=points)
    ir.verify(gm, after="partition")
    compute = ir.compute_nodes(gm.graph)

    for s, point in enumerate(points, start=1):
        first = next(n for n in compute if _in(n, point))
        assert plan.stages[s].nodes[0] == first.name
        assert plan.stages[s].first_module.startswith(point)
        assert all(ir.stage(n) < s for n in compute[:compute.index(first)])
        assert all(ir.stage(n) >= s for n in compute if _in(n, point))


@pytest.mark.parametrize(("points", "num_stages", "message", "hint"), [
    (["blocks.7"], 2, "'blocks.7' names no module", "blocks"),
    (["no_such_module"], 2, "names no module", "qualified module names"),
    (["blocks.1", "blocks.0"], 3, "does not come after", "order"),
    (["blocks.1", "blocks.1"], 3, "does not come after", "order"),
    (["blocks.1"], 3, "make 2 stages, not 3", "stages=2"),
], ids=("missing-index", "missing-name", "out-of-order", "repeated", "wrong-number"))
def test_bad_split_points_raise_partition_error_with_a_hint(points, num_stages, message, hint):
    with pytest.raises(PartitionError, match=re.escape(message)) as error:
        plan_for("gpt", num_stages, split_points=points)
    assert error.value.hint and hint in error.value.hint
    assert isinstance(error.value, (FxPipeError, ValueError))


BAD_COUNTS = {  # for n compute nodes and 2 stages
    "wrong-sum": lambda n: [10, 10],
    "one-entry": lambda n: [n],
    "three-entries": lambda n: [n - 1, 1, 0],
    "float": lambda n: [n / 2, n / 2],
    "zero": lambda n: [0, n],
    "negative": lambda n: [-1, n + 1],
}


@pytest.mark.parametrize("bad", BAD_COUNTS)
def test_bad_node_counts_raise_partition_error_with_a_hint(bad):
    total = len(ir.compute_nodes(captured("gpt").gm.graph))
    with pytest.raises(PartitionError) as error:
        plan_for("gpt", 2, balance=BAD_COUNTS[bad](total))
    assert f"sum to {total}" in error.value.hint


def test_a_zero_node_count_is_named_in_the_error():
    total = len(ir.compute_nodes(captured("gpt").gm.graph))
    with pytest.raises(PartitionError) as error:
        plan_for("gpt", 2, balance=[0, total])
    assert f"({total} != {total})" not in str(error.value)


class ThreeLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x).view(-1, 4)))


def test_more_stages_than_atoms_raises_partition_error_stating_both_numbers():
    gm = fxpipe.capture(ThreeLayers(), (torch.randn(4, 4),), inline_modules=True)
    annotate_costs(gm)
    atoms = len(atoms_of(gm))
    assert atoms == 3

    plan = partition(gm, atoms, microbatch_size=2, chunks=2, profile=PROFILE)
    assert len(plan.stages) == atoms
    with pytest.raises(PartitionError, match=rf"\({atoms + 2} > {atoms}\)") as error:
        partition(gm, atoms + 2, microbatch_size=2, chunks=2, profile=PROFILE)
    assert f"at most {atoms} stages" in error.value.hint


def _computes(node: Node) -> bool:
    """Launches a kernel that computes a floating-point value (not a view, not a counter)."""
    info = node.meta.get(ir.TENSOR)
    return (not is_glue(node) and isinstance(info, ir.TensorInfo)
            and info.dtype.is_floating_point)


def test_at_the_most_stages_accepted_every_stage_of_a_batchnorm_net_computes():
    from tests.skip_cnn import build

    model, inputs = build()
    gm = fxpipe.capture(model, inputs, inline_modules=True)  # train mode: counters count
    annotate_costs(gm)
    most = len(atoms_of(gm))
    atom = {n.name: i for i, a in enumerate(atoms_of(gm)) for n in a}
    assert atom["stem_bn_add_"] == atom["stem_bn_batch_norm"]  # the counter stays with its op

    plan = partition(gm, most, microbatch_size=2, chunks=2, profile=PROFILE)
    nodes = {n.name: n for n in ir.compute_nodes(gm.graph)}
    idle = [s.nodes for s in plan.stages if not any(_computes(nodes[x]) for x in s.nodes)]
    assert idle == []
    with pytest.raises(PartitionError, match=rf"\({most + 1} > {most}\)") as error:
        partition(gm, most + 1, microbatch_size=2, chunks=2, profile=PROFILE)
    assert f"use at most {most} stages" in error.value.hint
    assert "atom" not in str(error.value) and "leaf_modules" not in error.value.hint


def test_too_many_stages_hints_fewer_leaf_modules_only_to_a_user_who_kept_modules_whole():
    model = ThreeLayers()
    gm = fxpipe.capture(model, (torch.randn(4, 4),), leaf_modules=[model.b],
                        inline_modules=True)
    annotate_costs(gm)
    with pytest.raises(PartitionError) as error:
        partition(gm, 9, microbatch_size=2, chunks=2, profile=PROFILE)
    assert "pass fewer leaf_modules" in error.value.hint and "(b)" in error.value.hint


# --- memory ------------------------------------------------------------------------------------


def _stated_minimum(name: str, num_stages: int, **options: Any) -> float:
    with pytest.raises(PartitionError, match="minimum") as error:
        plan_for(name, num_stages, memory_limit=1.0, **options)
    assert "raise the memory limit" in error.value.hint
    return float(re.search(r"minimum ([0-9.e+]+) bytes", str(error.value)).group(1))


@pytest.mark.parametrize(("name", "num_stages"), [("gpt", 2), ("mlp", 3)], ids=str)
def test_too_small_a_memory_limit_raises_partition_error_stating_the_minimum(name, num_stages):
    peak = max(s.memory for s in plan_for(name, num_stages, remat="never").stages)

    minimum = _stated_minimum(name, num_stages, remat="never")

    assert 1.0 < minimum <= peak * 1.001
    plan = plan_for(name, num_stages, remat="never", memory_limit=minimum * 1.001)
    assert max(s.memory for s in plan.stages) <= minimum * 1.001


@pytest.mark.parametrize(("name", "num_stages"), [("gpt", 2), ("mlp", 3)], ids=str)
def test_a_memory_limit_between_minimum_and_peak_is_respected(name, num_stages):
    free = plan_for(name, num_stages, remat="never")
    peak = max(s.memory for s in free.stages)
    minimum = _stated_minimum(name, num_stages, remat="never")
    assert minimum < 0.99 * peak, "no room between the minimum and the unconstrained peak"
    limit = (minimum + peak) / 2

    plan = plan_for(name, num_stages, remat="never", memory_limit=limit)

    ir.verify(captured(name).gm, after="partition")
    assert all(s.memory <= limit for s in plan.stages), [s.memory for s in plan.stages]
    assert plan.bottleneck >= free.bottleneck * (1 - 1e-9)  # the limit can only cost time


def test_the_stated_minimum_memory_is_itself_a_feasible_limit():
    minimum = _stated_minimum("gpt", 3, remat="never")
    plan_for("gpt", 3, remat="never", memory_limit=minimum)


@pytest.mark.parametrize("given", [{"balance": [30, 31]}, {"split_points": ["blocks.1"]}],
                         ids=("counts", "split-points"))
def test_given_cuts_over_the_memory_limit_raise_partition_error(given):
    with pytest.raises(PartitionError, match="memory"):
        plan_for("gpt", 2, memory_limit=1000.0, **given)


# --- chunks="auto" -----------------------------------------------------------------------------


def test_auto_chunks_picks_the_divisor_of_the_batch_with_the_least_predicted_step_time():
    from fxpipe.models import mlp

    model, (x,) = mlp.build(depth=4, batch=12)
    program = fxpipe.compile(model, (x,), stages=2, chunks="auto", profile="a100")
    plan = program.plan

    candidates = dict(plan.candidates)
    assert sorted(candidates) == [1, 2, 3, 4, 6, 12]
    assert plan.chunks in candidates and 12 % plan.chunks == 0
    assert plan.microbatch_size * plan.chunks == 12
    assert candidates[plan.chunks] == min(candidates.values())
    assert plan.predicted_step_time == pytest.approx(candidates[plan.chunks])
    text = program.report().text()
    line = next(line for line in text.splitlines() if "chunks='auto' candidates" in line)
    for chunks, seconds in plan.candidates:
        assert f"{chunks}: {human_time(seconds)}" in line


# --- the project's benchmark: cost-based beats equal blocks ------------------------------------

EQUAL_BLOCKS = {2: ["blocks.2"], 4: ["blocks.1", "blocks.2", "blocks.3"]}  # 4 blocks in all


@functools.cache
def benchmark_gpt() -> GraphModule:
    model, inputs = gpt.build(d_model=128, n_layer=4, n_head=4, seq_len=64, vocab_size=4096,
                              batch=8, dropout=0.0)
    gm = fxpipe.capture(model, inputs, inline_modules=True)
    annotate_costs(gm)
    return gm


@pytest.mark.parametrize("num_stages", (2, 4), ids=lambda k: f"{k}stages")
def test_cost_balance_beats_equal_blocks_on_the_benchmark_gpt(num_stages):
    gm = benchmark_gpt()
    profile = get_profile("measure")  # the measured CPU profile (cached per process)
    options = {"microbatch_size": 2, "chunks": 4, "profile": profile}

    equal = partition(gm, num_stages, split_points=EQUAL_BLOCKS[num_stages], **options)
    blocks = [{ir.module_path(n).split(".")[1] for n in ir.compute_nodes(gm.graph)
               if ir.stage(n) == s and ir.module_path(n).startswith("blocks.")}
              for s in range(num_stages)]
    assert {len(b) for b in blocks} == {4 // num_stages}
    cost = partition(gm, num_stages, **options)

    print(f"\nbenchmark gpt, {num_stages} stages, slowest stage per micro-batch "
          f"({profile.name}): cost-based {cost.bottleneck * 1e3:.3f} ms "
          f"({[len(s.nodes) for s in cost.stages]} nodes), equal blocks "
          f"{equal.bottleneck * 1e3:.3f} ms ({[len(s.nodes) for s in equal.stages]} nodes)")
    assert cost.bottleneck < equal.bottleneck


def _three_residual_blocks() -> tuple[GraphModule, dict[str, int]]:
    """Three residual MLP blocks, captured and costed, and the partition options (2 samples
    per micro-batch, 4 micro-batches) under which two stages cut inside the middle block."""
    model, inputs = mlp.build(depth=3, batch=8)
    gm = fxpipe.capture(model, inputs, inline_modules=True)
    annotate_costs(gm)
    return gm, {"microbatch_size": 2, "chunks": 4}


def test_the_solver_counts_each_message_s_host_work_so_a_cut_sends_one_value_not_two():
    # Three residual MLP blocks on two stages: the compute is balanced by cutting inside the
    # middle block, which sends its input (the residual) and its hidden value, two messages
    # each way. Where every message costs its two ends host work (gloo on a CPU: tens of us),
    # a cut at a block's end sends one and steps faster.
    gm, options = _three_residual_blocks()
    free = partition(gm, 2, profile=PROFILE, **options)
    assert free.stages[0].forward_messages == 2  # without host work: inside the middle block
    hosts = dataclasses.replace(PROFILE, message_overhead=free.stages[0].compute_time)
    plan = partition(gm, 2, profile=hosts, **options)
    assert [s.forward_messages for s in plan.stages] == [1, 1]
    assert [s.backward_messages for s in plan.stages] == [1, 1]
    # the stages' own times leave the host work to the schedule's simulation, as before
    at_same_cut = partition(gm, 2, profile=PROFILE, starts=[s.nodes[0] for s in plan.stages],
                            **options)
    assert [s.time for s in plan.stages] == pytest.approx([s.time for s in at_same_cut.stages])
    assert plan.message_time(plan.stages[0]) == pytest.approx(
        plan.stages[0].comm_time + 2 * hosts.message_overhead)


def test_where_the_ranks_cores_move_the_bytes_the_solver_counts_each_transfer_whole():
    # The blocks of the test above: on a link a copy engine drives, half of each transfer
    # counts against either stage and the cut goes inside the middle block; where the ranks'
    # own cores move the bytes (gloo between CPU processes) each end pays the whole transfer,
    # and a cut at a block's end sends half the bytes.
    gm, options = _three_residual_blocks()
    engine = partition(gm, 2, profile=PROFILE, **options)
    assert not engine.host_link and engine.stages[0].forward_messages == 2
    host = partition(gm, 2, profile=dataclasses.replace(PROFILE, host_link=True), **options)
    assert host.host_link and [s.forward_messages for s in host.stages] == [1, 1]
    assert host.stages[0].comm_time < engine.stages[0].comm_time
