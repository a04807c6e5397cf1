"""fxpipe.plan: stages x replicas x micro-batches x schedule x remat for N devices."""
from __future__ import annotations

import pytest

import fxpipe
from fxpipe.cli import main
from fxpipe.errors import ConfigError
from fxpipe.models import gpt
from fxpipe.planner import PlanError, plan
from fxpipe.runtime.planning.schedule import placement


@pytest.fixture(scope="module")
def model_and_batch():
    return gpt.build(n_layer=4, d_model=64, n_head=4, seq_len=32, vocab_size=256, batch=8,
                     dropout=0.0)


@pytest.fixture(scope="module")
def four_devices(model_and_batch):
    model, inputs = model_and_batch
    return plan(model, inputs, devices=4, profile="a100",
                schedules=("gpipe", "1f1b", "zb-h1", "zb-v"))


def test_every_candidate_uses_every_device_and_shares_the_batch(four_devices):
    splits = {(c.ranks, c.replicas) for c in four_devices.candidates}
    assert splits == {(1, 4), (2, 2), (4, 1)}
    for c in four_devices.candidates:
        assert c.ranks * c.replicas == 4
        assert (8 // c.replicas) % c.chunks == 0  # micro-batches of the replica's share
        assert c.stages == c.ranks * c.stages_per_rank
        if not c.skipped:
            assert (c.allreduce_s > 0) == (c.replicas > 1)
    assert {c.schedule for c in four_devices.candidates} == {"gpipe", "1f1b", "zb-h1", "zb-v"}


def test_the_choice_is_the_fastest_and_compile_takes_its_options(four_devices, model_and_batch):
    model, inputs = model_and_batch
    choice = four_devices.choice
    assert choice.step_s == min(c.step_s for c in four_devices.candidates)
    program = fxpipe.compile(model, inputs, profile="a100", **four_devices.options)
    assert program.built.config.ranks == choice.ranks
    assert four_devices.processes == choice.ranks * choice.replicas
    assert "chosen" in four_devices.table() and "fxpipe.compile(model, batch, " in \
        four_devices.table()


def test_a_single_replica_candidate_predicts_what_compile_predicts(four_devices, model_and_batch):
    model, inputs = model_and_batch
    for c in [c for c in four_devices.candidates if c.replicas == 1][:3]:
        program = fxpipe.compile(model, inputs, stages=c.stages, chunks=c.chunks,
                                 schedule=c.schedule, remat=c.remat, profile="a100")
        assert c.pipeline_s == pytest.approx(program.plan.predicted_step_time, rel=1e-9), c
        per_rank: dict[int, float] = {}  # a device holds each of its stages (zb-v: two)
        for stage, rank in zip(program.plan.stages, placement(c.schedule, c.stages, c.ranks)):
            per_rank[rank] = per_rank.get(rank, 0.0) + (stage.memory or 0.0)
        assert c.memory_bytes == pytest.approx(max(per_rank.values()))


def test_a_memory_limit_leaves_out_what_does_not_fit_and_names_the_smallest(model_and_batch):
    model, inputs = model_and_batch
    free = plan(model, inputs, devices=2, profile="a100", schedules=("gpipe",), prune=False)
    memories = sorted(c.memory_bytes for c in free.candidates)
    limit = (memories[0] + memories[-1]) / 2
    tight = plan(model, inputs, devices=2, profile="a100", schedules=("gpipe",),
                 memory_per_device=limit)
    assert tight.choice.fits and tight.choice.memory_bytes <= limit
    assert any(not c.fits for c in tight.candidates)
    assert all(c.memory_bytes <= limit * (1 + 1e-9) for c in tight.candidates if c.fits)
    assert tight.options["memory_limit"] == limit
    with pytest.raises(PlanError, match="none of .* fits .*the least a candidate's fastest"):
        plan(model, inputs, devices=2, profile="a100", schedules=("gpipe",),
             memory_per_device=memories[0] / 100)


def test_replicas_across_machines_all_reduce_over_the_slower_link(model_and_batch):
    model, inputs = model_and_batch
    one_node = plan(model, inputs, devices=4, profile="a100", schedules=("gpipe",),
                    remats=("never",), prune=False)
    two_nodes = plan(model, inputs, devices=4, profile="a100", schedules=("gpipe",),
                     remats=("never",), devices_per_node=2, inter_node_bandwidth=1e8,
                     prune=False)

    def allreduce(p, ranks, chunks):
        return next(c.allreduce_s for c in p.candidates if c.ranks == ranks and c.chunks == chunks)

    assert allreduce(two_nodes, 1, 1) > 10 * allreduce(one_node, 1, 1)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"devices": 0}, "devices must be a positive integer"),
    ({"devices": 4, "devices_per_node": 3}, "devices_per_node=3 does not divide devices=4"),
    ({"devices": 4, "devices_per_node": 2}, "need the bandwidth between machines"),
    ({"devices": 2, "schedules": ("zigzag",)}, "unknown schedule"),
])
def test_bad_plans_are_refused_with_what_to_pass(model_and_batch, kwargs, message):
    model, inputs = model_and_batch
    with pytest.raises(ConfigError, match=message):
        plan(model, inputs, profile="a100", **kwargs)


def test_fxpipe_plan_prints_the_table_and_the_choice(capsys):
    assert main(["plan", "fxpipe.models.mlp:build", "--devices", "2", "--profile", "a100",
                 "--rows", "4"]) == 0
    out = capsys.readouterr().out
    assert "fxpipe plan: 2 devices" in out and "chosen" in out
    assert "run on 2 processes" in out


def _gpt_of(layers):
    return gpt.build(n_layer=layers, d_model=128, n_head=4, seq_len=32, vocab_size=512, batch=4,
                     dropout=0.0)


def test_the_largest_that_fits_fits_and_one_more_layer_does_not():
    from fxpipe.sizing import largest_that_fits

    options = {"devices": 2, "memory_per_device": 12e6, "profile": "a100",
               "schedules": ("gpipe",), "remats": ("except_last",)}
    layers, found = largest_that_fits(_gpt_of, **options)
    assert layers >= 2 and found.choice.fits
    assert found.choice.memory_bytes <= options["memory_per_device"]
    import torch

    with torch.device("meta"):
        model, inputs = _gpt_of(layers + 1)
    with pytest.raises(PlanError):
        plan(model, inputs, check="shapes", **options)
    with torch.device("meta"):
        model, inputs = _gpt_of(layers)
    full = plan(model, inputs, check="shapes", **options)  # the largest is planned in full
    assert [(_key(c), c.step_s) for c in found.candidates] == \
        [(_key(c), c.step_s) for c in full.candidates]
    first = plan(model, inputs, check="shapes", any_fit=True, **options)
    assert first.choice.fits and sum(c.fits for c in first.candidates) == 1
    with pytest.raises(PlanError, match="size 1 does not fit 2 devices"):
        largest_that_fits(_gpt_of, **{**options, "memory_per_device": 1e5})


@pytest.mark.slow
def test_the_largest_that_fits_is_found_from_a_guess_above_or_below_it():
    from fxpipe.sizing import largest_that_fits

    options = {"devices": 2, "memory_per_device": 12e6, "profile": "a100",
               "schedules": ("gpipe",), "remats": ("except_last",)}
    layers, _ = largest_that_fits(_gpt_of, **options)
    for guess in sorted({max(2, layers - 3), layers, layers + 1, layers + 6}):
        said: list[str] = []
        found, plan_of = largest_that_fits(_gpt_of, guess=guess, say=said.append, **options)
        assert found == layers, (guess, said)
        assert said[0].startswith(f"size {guess}: ")  # the guess is tried first
        assert any(line.startswith(f"size {layers}: fits") for line in said)
        assert f"size {layers + 1}: does not fit" in said
        assert plan_of.choice.fits


@pytest.mark.slow  # the search itself is checked in the fast tier (largest_that_fits above)
def test_fxpipe_plan_largest_prints_the_size_and_its_plan(capsys):
    assert main(["plan", "fxpipe.models.gpt:build", "--set", "d_model=64", "--set", "n_head=2",
                 "--set", "vocab_size=256", "--set", "seq_len=16", "--set", "batch=4",
                 "--devices", "2", "--memory-per-device", "3MB", "--largest", "n_layer",
                 "--profile", "a100", "--rows", "2"]) == 0
    captured = capsys.readouterr()
    assert "the largest n_layer that fits: " in captured.out
    assert "size 1: fits" in captured.err


def _key(c):
    return (c.ranks, c.replicas, c.stages_per_rank, c.chunks, c.schedule, c.remat, c.shard)


@pytest.mark.parametrize("memory_fraction", [None, 0.5])
def test_pruning_leaves_the_choice_and_every_prediction_as_partitioning_every_candidate(
        model_and_batch, memory_fraction):
    model, inputs = model_and_batch
    options = {"devices": 4, "profile": "a100", "schedules": ("gpipe", "1f1b", "zb-v")}
    every = plan(model, inputs, prune=False, **options)
    if memory_fraction is not None:  # a limit half the candidates exceed
        memories = sorted(c.memory_bytes for c in every.candidates)
        options["memory_per_device"] = memories[len(memories) // 2]
        every = plan(model, inputs, prune=False, **options)
    pruned = plan(model, inputs, **options)
    assert _key(pruned.choice) == _key(every.choice)
    assert pruned.choice.step_s == every.choice.step_s
    assert not any(c.skipped for c in every.candidates)
    full = {_key(c): c for c in every.candidates}
    assert set(full) == {_key(c) for c in pruned.candidates}
    for c in pruned.candidates:
        whole = full[_key(c)]
        assert c.bound_s <= whole.step_s * (1 + 1e-9), c  # a lower bound of the step
        if c.skipped:  # left out because it could not beat the choice
            assert c.bound_s >= pruned.choice.step_s
        elif c.fits:  # partitioned: as partitioning every candidate predicts it
            assert (c.step_s, c.memory_bytes) == pytest.approx(
                (whole.step_s, whole.memory_bytes), rel=1e-9)
        else:  # a memory bound or no cut: it does not fit either way
            assert not whole.fits and c.memory_bytes <= whole.memory_bytes * (1 + 1e-9)
    if memory_fraction is not None:
        assert any(c.problem.startswith("holds at least") for c in pruned.candidates)
    assert any(c.skipped for c in pruned.candidates)
    assert "not partitioned" in pruned.table(rows=len(pruned.candidates))


def test_a_meta_model_is_planned_with_its_blocks_stamped():
    import torch

    with torch.device("meta"):
        model, inputs = _gpt_of(6)
    stamped = plan(model, inputs, devices=2, profile="a100", schedules=("gpipe",),
                   remats=("never",), check="shapes")
    traced = plan(model, inputs, devices=2, profile="a100", schedules=("gpipe",),
                  remats=("never",), check="shapes", stamp=False)
    assert [_key(c) for c in stamped.candidates] == [_key(c) for c in traced.candidates]
    assert [x for c in stamped.candidates if not c.skipped for x in (c.step_s, c.memory_bytes)] \
        == pytest.approx([x for c in traced.candidates if not c.skipped
                          for x in (c.step_s, c.memory_bytes)])


def test_the_bounds_are_what_the_measured_atoms_add_up_to():
    # Bounds sums the graph once (GraphTotals); partition measures atoms per candidate: the
    # same totals, so a bound never prunes a candidate that could fit or win.
    import math

    from fxpipe.losses import loss_time
    from fxpipe.optimizers import optimizer_memory
    from fxpipe.passes.partition.atoms import measure_atoms
    from fxpipe.planner import Candidate, planning

    model, inputs = _gpt_of(3)
    held = optimizer_memory("adam", False)
    graph = planning(model, inputs, devices=4, profile="a100")
    gm, bounds = graph.gm, graph.bounds
    groups = graph.partitions.reuse.groups
    for b, remat, chunks, shard, replicas in [(1, "never", 4, "none", 1),
                                              (2, "always", 2, "optimizer", 2),
                                              (4, "except_last", 1, "none", 1)]:
        c = Candidate(4 // replicas, 1, replicas, chunks, "gpipe", remat, shard)
        atoms = measure_atoms(gm, groups, balance="cost", profile=bounds.profile, b=b,
                              remat=remat, chunks=chunks, optimizer=held.sharded(shard, replicas))
        memory = (math.fsum(atoms.mem_fixed) + math.fsum(atoms.mem_act)) / c.ranks
        assert bounds.memory(c, b) == pytest.approx(memory, rel=1e-12)
        work = (math.fsum(atoms.compute) + loss_time(gm, b, bounds.profile, False)) * chunks
        step = work / c.ranks + bounds.profile.step_overhead + \
            bounds.link.all_reduce(c, bounds.grad_bytes / c.ranks)
        assert bounds.step(c, b) == pytest.approx(step, rel=1e-12)
