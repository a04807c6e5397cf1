"""Balancing by measurement: node times corrected by what each stage measured, the loop that cuts
again until the stages are even, program.rebalance() keeping every parameter and optimizer state
(locally and under torchrun), and balanced cuts remembered per machine.

Measured times on a shared machine are noise; the loop's logic is tested with measurements made
up from known "true" node times, and transparency after a rebalance with a cut that the made-up
measurement forces to move.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import fxpipe
from fxpipe import ir
from fxpipe import program_balance as program_module
from fxpipe.losses import default_loss
from fxpipe.models import gpt, mlp
from fxpipe.passes.cost import annotate_costs
from fxpipe.passes.estimate import estimate_time
from fxpipe.passes.partition import (
    LOSS,
    BalanceRound,
    best_round,
    corrected,
    kept_reason,
    next_cut,
    partition,
    spread,
)
from fxpipe.profile import Curve, cache, get_profile
from fxpipe.rebalance import balance_by_measurement, cut_of, robust_time
from fxpipe.report import build_report
from fxpipe.runtime.planning.schedule import default_stages_per_rank
from tests.ranks import spawn

PROFILE = "a100"


@pytest.fixture(autouse=True)
def cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path / "cache"))
    cache.clear_memory()
    yield
    cache.clear_memory()


def make_gpt():
    model, inputs = gpt.build(dropout=0.0, n_layer=4)
    return model, inputs, gpt.target(inputs)


def early_blocks_slower(factor: float):
    """A made-up measurement in which the nodes of wte and blocks.0 take `factor` times their
    estimated time and every other node its estimate: per stage, the sum over its nodes."""
    def truth(node) -> float:
        return factor if ir.module_path(node).startswith(("wte", "blocks.0")) else 1.0

    def measure(built):
        nodes = {n.name: n for n in ir.compute_nodes(built.captured.graph)}
        b = built.plan.microbatch_size
        return [sum(sum(estimate_time(ir.cost(nodes[name]), built.profile, b))
                    * truth(nodes[name]) for name in stage.nodes)
                for stage in built.plan.stages]
    return measure


# --- the pure parts ----------------------------------------------------------------------------

def test_corrections_scale_each_stage_by_measured_over_predicted():
    fixes = corrected({"a": 2.0}, [["a", "b"], ["c"]], [1.0, 2.0], [3.0, 1.0])
    assert fixes == {"a": 6.0, "b": 3.0, "c": 0.5, LOSS: 0.5}
    assert spread([1.0, 1.05]) == pytest.approx(0.05)
    rounds = [BalanceRound(("x",), ("m",), (1.0,), (2.0, 1.0)),
              BalanceRound(("y",), ("n",), (1.0,), (1.5, 1.4))]
    assert best_round(rounds).starts == ("y",)


def test_under_a_looped_schedule_the_busiest_rank_decides_which_cut_is_kept():
    # interleaved on 2 ranks: stages 0 and 2 on rank 0, 1 and 3 on rank 1. The first cut's
    # slowest stage is the faster one (64.7 < 65.2 ms), but it leaves rank 1 with 127 ms
    # against rank 0's 86.7; the second's ranks are 123.2 and 119.2 ms.
    ranks = (0, 1, 0, 1)
    uneven = BalanceRound(("a",), ("m",), (1.0,) * 4, (41.4, 64.7, 45.3, 62.3), ranks)
    even = BalanceRound(("b",), ("n",), (1.0,) * 4, (65.2, 59.6, 58.0, 59.6), ranks)
    assert uneven.rank_loads == pytest.approx((86.7, 127.0))
    assert best_round([uneven, even]) is even
    assert even.to_json()["rank_spread"] == pytest.approx(123.2 / 119.2 - 1)
    # ZB-V: rank r holds stages r and 3 - r
    v = BalanceRound(("c",), ("o",), (1.0,) * 4, (1.0, 2.0, 3.0, 4.0), (0, 1, 1, 0))
    assert v.rank_loads == (5.0, 5.0) and v.bottleneck == 5.0 and v.relative_bottleneck == 1.0


def test_rounds_measured_at_different_machine_speeds_are_compared_relative_to_their_mean():
    # GPipe GPT rounds of one compile (ms per micro-batch). The second round's busiest stage
    # measured least in absolute terms, but its stages are further apart; the machine was
    # faster while it ran (its stages sum to less). Five benches then measured that cut's
    # stages 12-16% apart.
    c_fc = BalanceRound(("c_fc",), ("m",), (1.0,) * 2, (93.88, 110.16), (0, 1))
    attn = BalanceRound(("attn",), ("n",), (1.0,) * 2, (89.07, 108.38), (0, 1))
    gelu = BalanceRound(("gelu",), ("o",), (1.0,) * 2, (99.06, 110.62), (0, 1))
    assert attn.bottleneck < c_fc.bottleneck < gelu.bottleneck
    assert best_round([c_fc, attn, gelu]) is gelu
    # the same cut measured on a machine 20% slower keeps its place
    slower = BalanceRound(("gelu",), ("o",), (1.0,) * 2, (118.87, 132.74), (0, 1))
    assert best_round([c_fc, attn, slower]) is slower
    assert slower.relative_bottleneck == pytest.approx(gelu.relative_bottleneck, rel=1e-3)


def test_a_cut_that_sends_more_messages_pays_for_them_when_rounds_are_compared():
    # The bundled MLP on 2 gloo ranks (ms per micro-batch): the cut at a block's end measured
    # 0.91 / 1.18, the cut inside the next block 0.83 / 0.78, but the latter sends the residual
    # and the hidden value each way, and stepped slower (about 10 ms against 8). Each message
    # costs its rank about 0.1 ms of link latency and host work.
    one = BalanceRound(("ln",), ("blocks.4.ln",), (1.0,) * 2, (0.91, 1.18), (0, 1),
                       messages=(0.208, 0.208))
    two = BalanceRound(("fc1",), ("blocks.4",), (1.0,) * 2, (0.83, 0.78), (0, 1),
                       messages=(0.416, 0.416))
    assert best_round([two, one]) is one
    assert one.bottleneck == pytest.approx(1.388)
    assert one.relative_bottleneck == pytest.approx(1.388 / 1.045)
    assert one.rank_loads == (0.91, 1.18)  # compute alone, as measured
    # without the messages, the closer measured compute would win
    bare = [dataclasses.replace(r, messages=()) for r in (two, one)]
    assert best_round(bare) is bare[0]
    assert one.to_json()["messages_s"] == [0.208, 0.208]
    assert "its messages included" in kept_reason([two, one])


def test_robust_time_takes_the_fastest_sample_of_alike_micro_batches():
    # except_last: micro-batches 0-2 recompute, 3 does not
    samples = [[5.0, 2.0, 9.0, 1.0], [2.5, 3.0, 2.0, 1.5]]
    assert robust_time(samples, "except_last") == pytest.approx((3 * 2.0 + 1.0) / 4)
    assert robust_time(samples, "never") == pytest.approx(1.0)


def test_corrected_node_times_move_the_cut_and_a_given_cut_is_kept():
    model, inputs, _ = make_gpt()
    gm = fxpipe.capture(model, inputs, inline_modules=True)
    annotate_costs(gm)
    options = dict(microbatch_size=2, chunks=4, profile=get_profile(PROFILE))
    plain = partition(gm, 2, **options)
    heavier = {name: 3.0 for name in plain.stages[1].nodes}
    moved = partition(gm, 2, corrections=heavier, **options)
    assert len(moved.stages[1].nodes) < len(plain.stages[1].nodes)
    assert moved.stages[1].time == pytest.approx(moved.stages[0].time, rel=0.3)
    kept = partition(gm, 2, starts=[s.nodes[0] for s in plain.stages], corrections=heavier,
                     **options)
    assert [s.nodes for s in kept.stages] == [s.nodes for s in plain.stages]


# --- the loop ----------------------------------------------------------------------------------

def test_the_loop_balances_stages_whose_true_times_differ_from_the_estimate():
    model, inputs, _ = make_gpt()
    program = fxpipe.compile(model, inputs, stages=2, chunks=4, profile=PROFILE)
    built = program.built
    installed = []
    final = balance_by_measurement(built, measure=early_blocks_slower(2.5),
                                   install=installed.append, rounds=6)
    assert len(final.rounds) >= 2
    assert final.rounds[0].spread > 0.3  # the estimate alone was far off
    assert cut_of(final) != cut_of(built) and installed[-1] is final
    kept = best_round(final.rounds)
    assert kept.spread < final.rounds[0].spread / 3
    # the first stage, which holds the slow blocks, gave nodes away
    assert len(final.plan.stages[0].nodes) < len(built.plan.stages[0].nodes)
    # what the kept cut predicts is what it measured
    assert [s.compute_time for s in final.plan.stages] == pytest.approx(kept.measured, rel=1e-6)


def test_a_cut_measured_far_apart_is_not_kept_without_trying_the_next_one_and_a_reason():
    # A link so slow (as a profile measured under load says) that solving again always returns
    # the cut at the narrow layer, while the stages measure 9x apart.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)],
                                torch.nn.Linear(64, 2), torch.nn.Linear(2, 64),
                                torch.nn.Linear(64, 64))
    slow_link = dataclasses.replace(get_profile(PROFILE), link=Curve.flat(1e3))
    program = fxpipe.compile(model, (torch.randn(8, 64),), stages=2, chunks=2,
                             profile=slow_link)
    final = balance_by_measurement(program.built, measure=lambda built: [9e-4, 1e-4],
                                   install=lambda built: None, rounds=4)
    assert len(final.rounds) >= 2  # the next cut was tried
    assert final.rounds[1].starts != final.rounds[0].starts
    assert final.rounds[0].note.startswith("solving again returned a cut already measured")
    assert final.rounds[-1].note  # why balancing stopped
    reason = kept_reason(final.rounds)
    assert "still 800.0% apart" in reason and final.rounds[-1].note in reason
    assert f"kept {reason}" in build_report(final, "Sequential").text()


def test_the_next_cut_moves_nodes_from_the_slowest_stage_to_its_faster_neighbour():
    assert next_cut([["a", "b", "c", "d"], ["e"]], [3.0, 1.0]) == ("a", "d")
    assert next_cut([["a"], ["b", "c", "d", "e"]], [1.0, 9.0]) == ("a", "d")
    assert next_cut([["a"], ["b"]], [9.0, 1.0]) is None  # one operation cannot be split


@pytest.mark.slow
def test_balance_dynamic_measures_once_and_remembers_the_cut(monkeypatch):
    model, inputs, _ = make_gpt()
    program = fxpipe.compile(model, inputs, stages=2, chunks=4, profile=PROFILE,
                             balance="dynamic")
    assert program.built.rounds and program.measured["balance"].endswith("compiling")
    assert "balance by measurement" in program.report().text()
    assert program.report().json_text().count("measured_s") == len(program.built.rounds)

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured although the cut was remembered")

    monkeypatch.setattr(program_module, "measure_local", no_measuring)
    again = fxpipe.compile(model, inputs, stages=2, chunks=4, profile=PROFILE, balance="dynamic")
    assert cut_of(again.built) == cut_of(program.built)
    assert "cache" in again.measured["balance"]


def test_balance_dynamic_with_split_points_measures_and_keeps_them_and_says_so():
    # It failed blaming a balance=[...] the user never passed.
    model, (x,) = mlp.build()
    with pytest.warns(UserWarning, match=r"balance='dynamic' measured the stages at .* kept the "
                                         r"cut: split_points=\['blocks'\] fixes it"):
        program = fxpipe.compile(model, (x,), stages=2, chunks=2, profile=PROFILE,
                                 balance="dynamic", split_points=["blocks"])
    assert program.plan.stages[1].first_module.startswith("blocks")
    assert program.measured["balance"].endswith("fixes kept")


@pytest.mark.parametrize("damage", ['{"starts": ["nope", "x"], "corrections": {}, "rounds": []}',
                                    '{"starts": "ab", "corrections": [], "rounds": []}',
                                    '{"starts": ['])
def test_a_damaged_remembered_cut_is_named_forgotten_and_measured_again(damage):
    # Every balance="dynamic" compile of the model failed (a PartitionError, or an
    # AttributeError), naming no file.
    model, (x,) = mlp.build()
    fxpipe.compile(model, (x,), stages=2, chunks=2, profile=PROFILE, balance="dynamic")
    [path] = cache.cache_dir().glob("balance/*.json")
    path.write_text(damage)
    with pytest.warns(UserWarning, match="the balanced cut remembered in .* cannot be used") \
            as caught:
        again = fxpipe.compile(model, (x,), stages=2, chunks=2, profile=PROFILE,
                               balance="dynamic")
    assert any(str(path) in str(w.message) for w in caught)
    assert again.measured["balance"].endswith("compiling")
    assert path.read_text() != damage  # measured anew and remembered
    third = fxpipe.compile(model, (x,), stages=2, chunks=2, profile=PROFILE, balance="dynamic")
    assert "cache" in third.measured["balance"]


# --- rebalancing a running program -------------------------------------------------------------

def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_a_rebalanced_program_trains_exactly_as_the_plain_model(monkeypatch):
    model, inputs, target = make_gpt()
    reference = copy.deepcopy(model)
    program = fxpipe.compile(model, inputs, stages=2, chunks=4, profile=PROFILE)
    opt = torch.optim.Adam(program.parameters(), lr=1e-3)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3)

    def train(step_fn, optimizer):
        loss = step_fn()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def ref_step():
        loss = default_loss(reference(*inputs), target)
        loss.backward()
        return float(loss.detach())

    assert train(lambda: program.step(*inputs, target=target), opt) == pytest.approx(
        train(ref_step, ref_opt), rel=1e-5)
    before = cut_of(program.built)
    made_up = early_blocks_slower(3.0)
    monkeypatch.setattr(program_module, "measure_local", lambda *a: made_up(program.built))
    rounds = program.rebalance(optimizer=opt)
    assert rounds and cut_of(program.built) != before
    loss = program.step(*inputs, target=target)
    grads = {k: v for k, v in _grads(model).items()}
    assert loss == pytest.approx(ref_step(), rel=1e-5)
    ref_grads = _grads(reference)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], msg=name)
    opt.step()
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_rebalance_measures_the_last_full_batch_not_a_short_last_one(monkeypatch):
    model, inputs, target = make_gpt()
    program = fxpipe.compile(model, inputs, stages=2, chunks=4, profile=PROFILE)
    batch = inputs[0].shape[0]
    program.step(*inputs, target=target)
    program.step(inputs[0][: batch - 1], target=target[: batch - 1])  # 7: micro-batches of 1
    sizes = []

    def measure(executor, signature, chunks, remat, flat, *rest):
        sizes.append(signature.batch_size(flat))
        return [1e-3, 1e-3]

    monkeypatch.setattr(program_module, "measure_local", measure)
    program.rebalance(rounds=1)
    assert sizes and set(sizes) == {batch}, sizes


def test_rebalance_after_an_eval_call_balances_the_train_plan_on_any_length(monkeypatch):
    model, inputs, target = make_gpt()
    program = fxpipe.compile(model, inputs, stages=2, chunks=4, profile=PROFILE)
    program.step(*inputs, target=target)
    with torch.no_grad():
        program.eval()(*inputs)
    program.train()
    lengths = []

    def measure(executor, signature, chunks, remat, flat, *rest):
        lengths.append(flat[0].shape[1])
        return [1e-3, 1e-3]

    monkeypatch.setattr(program_module, "measure_local", measure)
    program.rebalance(rounds=1)
    assert program.built.capture_info.training and lengths == [inputs[0].shape[1]]
    with pytest.warns(UserWarning, match="compiling the program again"):
        program.rebalance(inputs[0][:, :16], target=target[:, :16], rounds=1)
    assert program.built.capture_info.training and lengths[-1] == 16


def _fixed_cut_compiles():
    model, inputs, _ = make_gpt()
    cost = fxpipe.compile(model, inputs, stages=2, chunks=4, profile=PROFILE)
    nodes = sum(len(s.nodes) for s in cost.plan.stages)
    return inputs, [
        ("balance=[12, ", fxpipe.compile(model, inputs, stages=2, chunks=4, profile=PROFILE,
                                         balance=[12, nodes - 12])),
        ("split_points=['blocks.3']", fxpipe.compile(model, inputs, stages=2, chunks=4,
                                                     profile=PROFILE,
                                                     split_points=["blocks.3"]))]


def test_rebalance_keeps_a_cut_the_user_gave_and_says_so_with_the_times_it_measured(monkeypatch):
    # The cut stayed as given, silently (balance=[...]), or a ConfigError blamed a balance=[...]
    # the user never passed (split_points).
    inputs, programs = _fixed_cut_compiles()
    for given, program in programs:
        before = cut_of(program.built)
        monkeypatch.setattr(program_module, "measure_local",
                            lambda *a, p=program: early_blocks_slower(3.0)(p.built))
        with pytest.warns(UserWarning) as caught:
            rounds = program.rebalance(*inputs)
        text = "\n".join(str(w.message) for w in caught)
        assert "program.rebalance() measured the stages at" in text and "kept the cut" in text
        assert given in text and "to let fxpipe move the cut" in text
        assert len(rounds) == 1 and cut_of(program.built) == before
        assert not list(cache.cache_dir().glob("balance/*.json"))  # a given cut is not the
        # balanced one a later balance="dynamic" compile should take


# --- under torchrun ----------------------------------------------------------------------------

def _rebalance_on_ranks(rank: int, world: int, schedule: str = "gpipe") -> dict:
    """Trains 3 Adam steps with a rebalance (forced to move the cut) after the first."""
    model, inputs, target = make_gpt()
    program = fxpipe.compile(model, inputs, stages=world * default_stages_per_rank(schedule),
                             chunks=4, profile=PROFILE, schedule=schedule)
    opt = torch.optim.Adam(program.parameters(), lr=1e-3)
    losses = [program.step(*inputs, target=target)]
    opt.step()
    opt.zero_grad()
    before = cut_of(program.built)
    made_up = early_blocks_slower(3.0)
    program_module.measure_ranks = lambda *a: made_up(program.built)
    rounds = program.rebalance(optimizer=opt)
    for _ in range(2):
        losses.append(program.step(*inputs, target=target))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": program.state_dict(), "before": before,
            "after": cut_of(program.built), "rounds": [r.to_json() for r in rounds],
            "optimized": sorted(id(p) for g in opt.param_groups for p in g["params"]) ==
            sorted(id(p) for p in program.parameters() if p.requires_grad)}


def _plain_adam(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, inputs, target = make_gpt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = default_loss(model(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "zb-v"])
def test_rebalance_under_torchrun_moves_parameters_with_their_optimizer_state(schedule):
    # zb-v: four stages on two ranks, the first and last (the tied embedding) on rank 0
    results = spawn(2, "tests.test_balance", "_rebalance_on_ranks", schedule, timeout=120,
                    bound=400)
    losses, state = _plain_adam(3)
    assert results[0]["after"] != results[0]["before"]
    assert results[0]["rounds"] == results[1]["rounds"]  # every rank agrees
    assert results[0]["after"] == results[1]["after"]
    for r in results:
        assert r["optimized"]  # the optimizer holds exactly this rank's new parameters
        assert r["losses"] == pytest.approx(losses, rel=1e-5)
    merged = {**results[1]["state"], **results[0]["state"]}
    for name, value in state.items():
        torch.testing.assert_close(merged[name], value, msg=name)


def _dynamic_on_ranks(rank: int, world: int) -> dict:
    model, inputs, target = make_gpt()
    program = fxpipe.compile(model, inputs, stages=world, chunks=4, profile=PROFILE,
                             balance="dynamic")
    loss = program.step(*inputs, target=target)
    return {"loss": loss, "cut": cut_of(program.built),
            "rounds": [r.to_json() for r in program.built.rounds]}


@pytest.mark.slow
@pytest.mark.distributed
def test_balance_dynamic_under_torchrun_agrees_on_every_rank_and_stays_transparent():
    results = spawn(2, "tests.test_balance", "_dynamic_on_ranks", timeout=120, bound=400)
    losses, _ = _plain_adam(1)
    assert results[0]["cut"] == results[1]["cut"]
    assert results[0]["rounds"] == results[1]["rounds"] and results[0]["rounds"]
    assert results[0]["loss"] == results[1]["loss"] == pytest.approx(losses[0], rel=1e-5)
