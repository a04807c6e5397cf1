"""shard="optimizer": ZeRO-1 on torch's ZeroRedundancyOptimizer over each stage's data-parallel
replicas, and shard="full": FSDP2's fully_shard over them (parameters, gradients and state), 2
stages x 2 replicas on 4 gloo processes (127.0.0.1), against the plain model; their
checkpoints resume into another replica count and shard mode; the memory model charges each
rank its share."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from ranks import spawn
from test_loss_reach import CUTS, UNREACHED, early_heads, first_output_loss

import fxpipe
from fxpipe.errors import ConfigError
from fxpipe.losses import default_loss
from fxpipe.models import gpt, mlp
from fxpipe.optimizers import optimizer_memory
from fxpipe.sharding import local_part, whole

STEPS, MORE, LR = 3, 2, 1e-2
# Adam's eps above the rounding noise of gradients that are zero in exact arithmetic (the
# attention's key bias): with the default 1e-8, Adam scales that noise up to full steps, and no
# two summation orders (micro-batches and replicas here, the whole batch at once there) agree
ADAM = {"lr": LR, "eps": 1e-6}
GPT = {"dropout": 0.0, "batch": 8}


def _gpt():
    torch.manual_seed(0)
    model, (x,) = gpt.build(**GPT)
    return model, x, gpt.target((x,), **GPT)


def _compile(model, x, shard="none", **options):
    return fxpipe.compile(model, (x,), stages=2, chunks=2, profile="a100", shard=shard,
                          dp_bucket_mb=4 / 1024, **options)


def _train(program, optimizer, x, y, steps):
    """Losses and, per step, this rank's gradients by the model's names."""
    losses, grads = [], []
    for _ in range(steps):
        losses.append(program.step(x, target=y))
        grads.append({n: p.grad.clone() for n, p in program.named_parameters()
                      if p.grad is not None})
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
    return losses, grads


def _state_bytes(optimizer) -> int:
    """Bytes of this rank's optimizer state tensors (the 0-dim step counters aside)."""
    inner = getattr(optimizer, "optim", optimizer)  # a ZeroRedundancyOptimizer's own part
    return sum(v.numel() * v.element_size() for state in inner.state.values()
               for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def _held(program, optimizer) -> tuple[float, int]:
    """(predicted held bytes of this rank's stage, measured: weights, gradients, state)."""
    (index,) = [s.index for s in program.stages if program.module_of(s.index) is not None]
    module = program.module_of(index)
    measured = sum(t.numel() * t.element_size() for t in [*module.parameters(),
                                                          *module.buffers()])
    measured += sum(p.grad.numel() * p.grad.element_size() for p in module.parameters()
                    if p.grad is not None)
    return program.plan.stages[index].held_bytes, measured + _state_bytes(optimizer)


def sharded_ranks(rank, world, resume_from, save_to):
    """On 4 ranks: (a) a checkpoint of the plain 2 x 1 run resumed with ZeRO, MORE steps;
    (b) a fresh ZeRO run: STEPS steps with every gradient, a save, MORE steps; (c) the held
    bytes of an MLP's stage with Adam against the memory model."""
    out = {}
    model, x, y = _gpt()
    program = _compile(model, x, shard="optimizer")
    optimizer = program.optimizer(torch.optim.Adam, **ADAM)
    assert program.load(resume_from, optimizer=optimizer) == STEPS
    out["resumed"] = _train(program, optimizer, x, y, MORE)[0]

    model, x, y = _gpt()
    program = _compile(model, x, shard="optimizer")
    optimizer = program.optimizer(torch.optim.Adam, **ADAM)
    out["kind"] = type(optimizer).__name__
    out["losses"], out["grads"] = _train(program, optimizer, x, y, STEPS)
    out["state"] = {k: v.clone() for k, v in program.state_dict().items()}
    program.save(save_to, optimizer=optimizer, step=STEPS)
    out["after_save"] = _train(program, optimizer, x, y, MORE)[0]
    out["report"] = program.report().text()

    torch.manual_seed(0)
    model, (x,) = mlp.build(depth=4)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, remat="never", profile="a100",
                             shard="optimizer")
    optimizer = program.optimizer(torch.optim.Adam, **ADAM)
    program.step(x, target=mlp.target((x,)))
    optimizer.step()  # the state exists, the gradients are still held
    out["held"] = _held(program, optimizer)
    return out


def _plain(steps):
    """The plain model on the whole batch with Adam: losses, gradients per step, state."""
    model, x, y = _gpt()
    optimizer = torch.optim.Adam(model.parameters(), **ADAM)
    losses, grads = [], []
    for _ in range(steps):
        loss = default_loss(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({n: p.grad.clone()  # a tied weight under each of its names
                      for n, p in model.named_parameters(remove_duplicate=False)})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, model.state_dict()


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory):
    """A plain 2 stages x 1 replica run's checkpoint after STEPS (Adam, shard="none", one
    process), and its losses over MORE steps more."""
    folder = tmp_path_factory.mktemp("shard")
    model, x, y = _gpt()
    program = _compile(model, x)
    optimizer = program.optimizer(torch.optim.Adam, **ADAM)
    _train(program, optimizer, x, y, STEPS)
    program.save(str(folder / "plain"), optimizer=optimizer, step=STEPS)
    after_plain = _train(program, optimizer, x, y, MORE)[0]
    return folder, after_plain


@pytest.fixture(scope="module")
def two_by_two(plain_checkpoint):
    """The 4-rank ZeRO-1 run, resuming the plain checkpoint first."""
    folder, after_plain = plain_checkpoint
    results = spawn(4, __name__, "sharded_ranks", str(folder / "plain"),
                    str(folder / "sharded"), timeout=120, bound=600)
    return {"ranks": results, "after_plain": after_plain, "folder": folder}


@pytest.mark.slow
@pytest.mark.distributed
def test_zero1_trains_like_the_plain_model_losses_gradients_and_parameters(two_by_two):
    losses, grads, state = _plain(STEPS)
    ranks = two_by_two["ranks"]
    for rank, out in enumerate(ranks):
        assert out["kind"] == "ZeroRedundancyOptimizer", rank
        assert out["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6), rank
        for step in range(STEPS):  # every gradient, averaged over the replicas, every step
            for name, grad in out["grads"][step].items():
                torch.testing.assert_close(grad, grads[step][name], rtol=1e-4, atol=1e-6,
                                           msg=f"rank {rank} step {step} {name}")
    for stage in (0, 1):  # each replica updated its part and broadcast it: equal copies
        a, b = ranks[stage]["state"], ranks[2 + stage]["state"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), stage
    merged = {**ranks[0]["state"], **ranks[1]["state"]}
    assert set(merged) == set(state)
    for key, value in state.items():  # the parameters after STEPS Adam steps
        # Adam divides by the gradient's running magnitude, so where an element's gradients
        # nearly cancel, their rounding (summed over micro-batches and replicas here, at once
        # there) moves the update by up to ~1e-3 of the learning rate
        torch.testing.assert_close(merged[key], value, rtol=1e-4, atol=LR * 1e-3,
                                   msg=lambda m, key=key: f"{key}: {m}")
    assert "sharded over 2 replicas" in ranks[0]["report"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_plain_two_by_one_checkpoint_resumes_into_two_by_two_zero1(two_by_two):
    for rank, out in enumerate(two_by_two["ranks"]):
        assert out["resumed"] == pytest.approx(two_by_two["after_plain"], rel=1e-5,
                                               abs=1e-6), rank


@pytest.mark.slow
@pytest.mark.distributed
def test_a_zero1_checkpoint_is_whole_and_resumes_into_two_by_one_unsharded(two_by_two):
    folder = str(two_by_two["folder"] / "sharded")
    checkpoint = fxpipe.load_checkpoint(folder)
    assert checkpoint["optimizer_class"] == "Adam"  # the format of an unsharded save
    model, _, _ = _gpt()
    assert set(checkpoint["optimizer"]["state"]) == {n for n, _ in model.named_parameters()}
    model, x, y = _gpt()
    program = _compile(model, x)  # 2 stages x 1 replica, shard="none", one process
    optimizer = program.optimizer(torch.optim.Adam, **ADAM)
    assert type(optimizer) is torch.optim.Adam
    assert program.load(folder, optimizer=optimizer) == STEPS
    resumed = _train(program, optimizer, x, y, MORE)[0]
    assert resumed == pytest.approx(two_by_two["ranks"][0]["after_save"], rel=1e-5, abs=1e-6)


@pytest.mark.slow
@pytest.mark.distributed
def test_each_rank_holds_what_the_memory_model_charges_it(two_by_two):
    held = [out["held"] for out in two_by_two["ranks"]]
    for stage in (0, 1):
        (predicted, a), (again, b) = held[stage], held[2 + stage]
        assert predicted == again
        # the replicas of a stage hold its state between them, once: the mean is the charge
        assert predicted == pytest.approx((a + b) / 2, rel=1e-6), stage
        # ZeroRedundancyOptimizer gives each replica whole tensors (largest first, to the
        # least loaded), so one may hold a little more than its share
        for measured in (a, b):
            assert measured == pytest.approx(predicted, rel=0.02), stage


# -- shard="full": FSDP2 ---------------------------------------------------------------------------


def _local_bytes(tensors) -> int:
    """Bytes of the parts of `tensors` this process holds (a DTensor's local shard)."""
    return sum(local_part(t).numel() * local_part(t).element_size() for t in tensors)


def _held_full(program, optimizer) -> tuple[float, int]:
    """(predicted held bytes of this rank's stage, measured: its shards of the weights, of
    the gradients and of the optimizer's state)."""
    (index,) = [s.index for s in program.stages if program.module_of(s.index) is not None]
    module = program.module_of(index)
    params = list(module.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    measured = _local_bytes([*params, *module.buffers(), *state,
                             *(p.grad for p in params if p.grad is not None)])
    rest = program.config.optimizer.sharded("full", 2).between_steps()  # numel(): whole
    trainable = [p for p in params if p.requires_grad]
    predicted = rest.weight_bytes(sum(t.numel() * t.element_size()
                                      for t in [*params, *module.buffers()])) \
        + rest.held_bytes(sum(p.numel() * p.element_size() for p in trainable),
                          sum(p.numel() for p in trainable))
    return predicted, measured


def _train_whole(program, optimizer, x, y, steps):
    """As _train, the gradients whole (gathered over the replicas: every rank calls it)."""
    losses, grads = [], []
    for _ in range(steps):
        losses.append(program.step(x, target=y))
        grads.append({n: whole(p.grad).clone() for n, p in program.named_parameters()
                      if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def full_ranks(rank, world, resume_from, save_to):
    """On 4 ranks under shard="full": (a) the plain 2 x 1 checkpoint resumed, MORE steps;
    (b) a fresh run: how it holds its parameters, STEPS steps with every gradient, a save,
    MORE steps; (c) one step recomputing every micro-batch, one under 1F1B; (d) a schedule
    that splits the backward, refused; (e) the held bytes of an MLP's stage with Adam; (f) one
    step of a model whose loss leaves some weights without a gradient."""
    from torch.distributed.tensor import DTensor

    out = {}
    model, x, y = _gpt()
    program = _compile(model, x, shard="full")
    optimizer = program.optimizer(torch.optim.Adam, **ADAM)
    assert program.load(resume_from, optimizer=optimizer) == STEPS
    out["resumed"] = _train(program, optimizer, x, y, MORE)[0]

    model, x, y = _gpt()
    program = _compile(model, x, shard="full")
    optimizer = program.optimizer(torch.optim.Adam, **ADAM)
    out["kind"] = type(optimizer).__name__
    params = dict(program.named_parameters())
    out["dtensors"] = all(isinstance(p, DTensor) for p in params.values())
    out["local"] = {n: local_part(p).numel() for n, p in params.items()}
    out["numel"] = {n: p.numel() for n, p in params.items()}
    out["losses"], out["grads"] = _train_whole(program, optimizer, x, y, STEPS)
    out["state_is_sharded"] = all(isinstance(v, DTensor) for s in optimizer.state.values()
                                  for v in s.values() if v.dim() > 0)
    out["state"] = {k: v.clone() for k, v in program.state_dict().items()}
    program.save(save_to, optimizer=optimizer, step=STEPS)
    out["after_save"] = _train(program, optimizer, x, y, MORE)[0]
    out["report"] = program.report().text()

    for name, options in {"remat": {"remat": "always"}, "1f1b": {"schedule": "1f1b"}}.items():
        model, x, y = _gpt()
        program = _compile(model, x, shard="full", **options)
        optimizer = program.optimizer(torch.optim.Adam, **ADAM)
        out[name] = _train_whole(program, optimizer, x, y, 1)

    model, x, y = _gpt()
    program = _compile(model, x, shard="full", schedule="zb-h1")
    try:
        program.step(x, target=y)
        out["split"] = "stepped"
    except fxpipe.FxPipeError as e:
        out["split"] = str(e)
    try:
        program.eval().evaluate(x, target=y)
        out["eval"] = "evaluated"
    except fxpipe.FxPipeError as e:
        out["eval"] = str(e)

    torch.manual_seed(0)
    model, (x,) = mlp.build(depth=4)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, remat="never", profile="a100",
                             shard="full")
    optimizer = program.optimizer(torch.optim.Adam, **ADAM)
    program.step(x, target=mlp.target((x,)))
    optimizer.step()  # the state exists, the gradients are still held
    out["held"] = _held_full(program, optimizer)

    model, x, y = early_heads()
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, profile="a100", shard="full",
                             split_points=CUTS[2])
    program.step(x, target=y, loss_fn=first_output_loss)
    out["unreached"] = {n: None if p.grad is None else whole(p.grad).clone()
                        for n, p in program.named_parameters()}
    return out


@pytest.fixture(scope="module")
def full_two_by_two(plain_checkpoint):
    """The 4-rank shard="full" run, resuming the plain checkpoint first."""
    folder, after_plain = plain_checkpoint
    results = spawn(4, __name__, "full_ranks", str(folder / "plain"), str(folder / "full"),
                    timeout=120, bound=900)
    return {"ranks": results, "after_plain": after_plain, "folder": folder}


@pytest.mark.slow
@pytest.mark.distributed
def test_full_shards_and_trains_like_the_plain_model_losses_gradients_and_parameters(
        full_two_by_two):
    losses, grads, state = _plain(STEPS)
    ranks = full_two_by_two["ranks"]
    for rank, out in enumerate(ranks):
        assert out["kind"] == "Adam" and out["dtensors"] and out["state_is_sharded"], rank
        assert out["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6), rank
        for step in range(STEPS):  # every gradient, averaged over the replicas, every step
            assert out["grads"][step].keys() == {n for n in out["numel"]}, rank
            for name, grad in out["grads"][step].items():
                torch.testing.assert_close(grad, grads[step][name], rtol=1e-4, atol=1e-6,
                                           msg=f"rank {rank} step {step} {name}")
    for stage in (0, 1):  # each replica holds its half of every parameter (dim 0 split)
        a, b = ranks[stage], ranks[2 + stage]
        for name, numel in a["numel"].items():
            assert a["local"][name] + b["local"][name] == numel, name
            assert a["local"][name] < numel or numel == 1, name
        assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"]), stage
    merged = {**ranks[0]["state"], **ranks[1]["state"]}
    assert set(merged) == set(state)
    for key, value in state.items():  # the parameters after STEPS Adam steps (see above)
        torch.testing.assert_close(merged[key], value, rtol=1e-4, atol=LR * 1e-3,
                                   msg=lambda m, key=key: f"{key}: {m}")
    assert "sharded over 2 replicas (the parameters and gradients too, between steps)" in \
        ranks[0]["report"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", ["remat", "1f1b"])
def test_full_recomputing_or_under_1f1b_trains_like_the_plain_model(full_two_by_two, run):
    """remat="always" recomputes every micro-batch's forward in its backward; 1F1B runs
    forwards after backwards within a step."""
    losses, grads, _ = _plain(1)
    for rank, out in enumerate(full_two_by_two["ranks"]):
        (loss,), (mine,) = out[run]
        assert loss == pytest.approx(losses[0], rel=1e-5, abs=1e-6), rank
        assert mine.keys() == {n for n in out["numel"]}, rank
        for name, grad in mine.items():
            torch.testing.assert_close(grad, grads[0][name], rtol=1e-4, atol=1e-6,
                                       msg=f"rank {rank} {name}")


@pytest.mark.slow
@pytest.mark.distributed
def test_full_leaves_weights_the_loss_does_not_reach_without_a_gradient(full_two_by_two):
    """Under FSDP2 too, as in the plain model: `side` (tied, on both stages), `aux` (a value
    sent back without gradient) and `gate` (read through argmax) keep none."""
    model, x, y = early_heads()
    first_output_loss(model(x), y).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    assert all(want[n] is None for n in want if n.startswith(UNREACHED))
    for rank, out in enumerate(full_two_by_two["ranks"]):
        got = out["unreached"]
        assert got, rank
        for name, grad in got.items():
            if want[name] is None:
                assert grad is None, f"rank {rank}: {name} got a gradient, the model none"
            else:
                torch.testing.assert_close(grad, want[name], msg=f"rank {rank} {name}")


@pytest.mark.slow
@pytest.mark.distributed
def test_full_refuses_a_schedule_that_splits_the_backward(full_two_by_two):
    for out in full_two_by_two["ranks"]:
        assert "shard='full' cannot run a schedule that splits the backward" in out["split"]


@pytest.mark.slow
@pytest.mark.distributed
def test_full_refuses_to_switch_the_train_eval_mode(full_two_by_two):
    for out in full_two_by_two["ranks"]:
        assert "FSDP2 shards their parameters over the replicas (shard='full')" in out["eval"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_plain_two_by_one_checkpoint_resumes_into_two_by_two_full(full_two_by_two):
    for rank, out in enumerate(full_two_by_two["ranks"]):
        assert out["resumed"] == pytest.approx(full_two_by_two["after_plain"], rel=1e-5,
                                               abs=1e-6), rank


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_a_full_checkpoint_is_whole_and_resumes_into_two_by_one(full_two_by_two, shard):
    folder = str(full_two_by_two["folder"] / "full")
    checkpoint = fxpipe.load_checkpoint(folder)
    assert checkpoint["optimizer_class"] == "Adam"  # the format of an unsharded save
    model, _, _ = _gpt()
    assert set(checkpoint["optimizer"]["state"]) == {n for n, _ in model.named_parameters()}
    for name, value in checkpoint["model"].items():  # whole tensors, the model's shapes
        assert value.shape == model.state_dict()[name].shape, name
    model, x, y = _gpt()
    program = _compile(model, x, shard=shard)  # 2 stages x 1 replica, one process
    optimizer = program.optimizer(torch.optim.Adam, **ADAM)
    assert program.load(folder, optimizer=optimizer) == STEPS
    resumed = _train(program, optimizer, x, y, MORE)[0]
    assert resumed == pytest.approx(full_two_by_two["ranks"][0]["after_save"], rel=1e-5,
                                    abs=1e-6)


@pytest.mark.slow
@pytest.mark.distributed
def test_under_full_each_rank_holds_what_the_memory_model_charges_it(full_two_by_two):
    held = [out["held"] for out in full_two_by_two["ranks"]]
    for stage in (0, 1):
        (predicted, a), (again, b) = held[stage], held[2 + stage]
        assert predicted == again
        # weights, gradients and Adam's moments, each split over the two replicas
        assert predicted == pytest.approx((a + b) / 2, rel=1e-6), stage
        for measured in (a, b):  # dim 0 split in halves: an odd one differs by a row
            assert measured == pytest.approx(predicted, rel=0.02), stage


# -- fast: the option, the memory model, the planner -------------------------------------------


def test_shard_modes_are_checked_with_a_clear_error():
    model, (x,) = mlp.build()
    with pytest.raises(ConfigError, match="unknown shard mode 'zero'"):
        fxpipe.compile(model, (x,), shard="zero")
    with pytest.raises(ConfigError, match="replicas must be an integer >= 1"):
        fxpipe.compile(model, (x,), shard="optimizer", replicas=0)


def test_sharded_state_is_charged_one_replica_s_share():
    adam = optimizer_memory("adam")
    assert adam.sharded("optimizer", 4).held_bytes(4.0 * 10, 10) == (4 + 2 * 4 / 4) * 10
    assert adam.sharded("none", 4).held_bytes(40, 10) == adam.held_bytes(40, 10)
    mixed = optimizer_memory("adam", master_weights=True).sharded("optimizer", 2)
    assert mixed.held_bytes(2.0 * 10, 10) == (2 + (4 + 2 * 4) / 2) * 10
    assert optimizer_memory(16.0).sharded("optimizer", 2).held_bytes(40, 10) == 40 + 120 / 2
    assert "sharded over 2 replicas" in mixed.describe()


def test_full_sharding_charges_one_replica_s_share_of_weights_gradients_and_state():
    adam = optimizer_memory("adam").sharded("full", 4)
    rest = adam.between_steps()  # the shards only
    assert rest.weight_bytes(40) == 10
    assert rest.held_bytes(4.0 * 10, 10) == (4 + 2 * 4) * 10 / 4  # gradients and moments
    mixed = optimizer_memory("adam", master_weights=True).sharded("full", 2)
    assert mixed.between_steps().held_bytes(2.0 * 10, 10) == (2 + 4 + 2 * 4) * 10 / 2
    assert optimizer_memory(16.0).sharded("full", 2).between_steps().held_bytes(40, 10) == 80
    # a step's peak: the shards and the stage gathered whole beside them, the state split
    assert adam.weight_bytes(40) == 40 + 10
    assert adam.held_bytes(4.0 * 10, 10) == (40 + 10) + 2 * 40 / 4
    assert mixed.held_bytes(2.0 * 10, 10) == (20 + 10) + (4 + 2 * 4) * 10 / 2
    assert optimizer_memory(16.0).sharded("full", 2).held_bytes(40, 10) == 60 + 120 / 2
    for one in (adam.sharded("full", 1), adam.sharded("full", 1).between_steps()):
        assert one.weight_bytes(40) == 40 and one.held_bytes(40, 10) == 40 + 80
    assert "sharded over 4 replicas (the parameters and gradients too, between steps)" in \
        adam.describe()


def test_the_partition_charges_a_replica_its_share_of_everything_under_full():
    model, (x,) = mlp.build(depth=4)
    options = {"stages": 2, "chunks": 2, "remat": "never", "profile": "a100", "replicas": 2}
    whole_ = fxpipe.compile(model, (x,), **{**options, "replicas": 1})
    full = fxpipe.compile(model, (x,), shard="full", **options)
    for a, b, stage in zip(whole_.plan.stages, full.plan.stages, whole_.stages):
        module = whole_.module_of(stage.index)
        assert module is not None
        weights = sum(p.numel() * p.element_size() for p in module.parameters())
        assert a.held_bytes == pytest.approx(4 * weights)  # weights, gradients, 2 moments
        # at the step's peak: weights and gradients gathered beside their halves, moments / 2
        assert b.held_bytes == pytest.approx(1.5 * weights + 1.5 * weights + 2 * weights / 2)
        assert (a.memory or 0) - (b.memory or 0) == pytest.approx(a.held_bytes - b.held_bytes)
    assert "(the parameters and gradients too, between steps)" in full.report().text()


def test_the_partition_and_the_report_charge_a_replica_its_share():
    model, (x,) = mlp.build(depth=4)
    whole = fxpipe.compile(model, (x,), stages=2, chunks=2, remat="never", profile="a100")
    sharded = fxpipe.compile(model, (x,), stages=2, chunks=2, remat="never", profile="a100",
                             shard="optimizer", replicas=2)
    for a, b, stage in zip(whole.plan.stages, sharded.plan.stages, whole.stages):
        module = whole.module_of(stage.index)
        assert module is not None
        state = 2 * sum(p.numel() * p.element_size() for p in module.parameters())
        assert a.held_bytes - b.held_bytes == pytest.approx(state / 2)  # Adam's moments / 2
    assert "adam: 2 state tensors in the parameters' dtype, sharded over 2 replicas" in \
        sharded.report().text()
    # a memory limit only the sharded charge fits
    limit = max(s.memory or 0 for s in sharded.plan.stages) * 1.01
    assert max(s.memory or 0 for s in whole.plan.stages) > limit
    fxpipe.compile(model, (x,), stages=2, chunks=2, remat="never", profile="a100",
                   shard="optimizer", replicas=2, memory_limit=limit)
    with pytest.raises(fxpipe.FxPipeError):
        fxpipe.compile(model, (x,), stages=2, chunks=2, remat="never", profile="a100",
                       memory_limit=limit)


def test_full_refuses_stages_of_one_rank_sharing_a_parameter_and_a_torch_without_fsdp2(
        monkeypatch):
    from fxpipe.runtime.execution.fsdp import FullShard, fully_shard_function

    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    second.weight = first.weight  # a tied weight in two stages of one rank
    with pytest.raises(ConfigError, match="stages 0 and 1 of this rank share a parameter"):
        FullShard([first, second], mesh=None)
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", None)
    monkeypatch.setitem(sys.modules, "torch.distributed._composable.fsdp", None)
    with pytest.raises(ConfigError, match="shard='full' needs FSDP2's fully_shard"):
        fully_shard_function()


def test_a_program_makes_the_plain_optimizer_without_replicas():
    model, (x,) = mlp.build()
    program = fxpipe.compile(copy.deepcopy(model), (x,), stages=2, chunks=2, profile="a100",
                             shard="optimizer")
    optimizer = program.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    assert type(optimizer) is torch.optim.SGD
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == \
        {id(p) for p in program.parameters()}
    with pytest.raises(ConfigError, match="torch.optim.Optimizer class"):
        program.optimizer("adam")


# -- the written program -------------------------------------------------------------------------


def _fxpipe_run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fxpipe", "run", *args], capture_output=True,
                          text=True, timeout=600, env=env)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_written_program_trains_zero1_as_two_by_two_and_resumes_as_two_by_one(tmp_path):
    model, x, y = _gpt()
    program = _compile(model, x, shard="optimizer")
    program.write(str(tmp_path / "out"), target=y, reference_steps=5)
    assert json.loads((tmp_path / "out" / "program.json").read_text())["shard"] == "optimizer"
    ckpt = str(tmp_path / "ckpt")
    first = _fxpipe_run(str(tmp_path / "out"), "--nproc", "4", "--steps", "3", "--verify",
                        "--save", ckpt)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "verify: OK" in first.stdout  # ZeRO-1's SGD with momentum steps as the plain one's
    meta = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())
    assert meta["optimizer"] == "SGD"  # the wrapped class: an unsharded checkpoint's format
    shards = [torch.load(os.path.join(ckpt, meta["folder"], e["file"]), weights_only=True)
              for e in sorted(meta["shards"], key=lambda e: e["file"])]
    # the first replica saved the whole state of its stage, gathered; the second none
    assert ["optimizer" in s for s in shards] == [True, True, False, False]
    second = _fxpipe_run(str(tmp_path / "out"), "--nproc", "2", "--steps", "2", "--verify",
                         "--resume", ckpt)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "verify: OK: steps 3..4" in second.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_the_written_program_trains_full_as_two_by_two_and_resumes_as_two_by_one(tmp_path):
    model, x, y = _gpt()
    program = _compile(model, x, shard="full")
    program.write(str(tmp_path / "out"), target=y, reference_steps=5)
    assert json.loads((tmp_path / "out" / "program.json").read_text())["shard"] == "full"
    ckpt = str(tmp_path / "ckpt")
    first = _fxpipe_run(str(tmp_path / "out"), "--nproc", "4", "--steps", "3", "--verify",
                        "--save", ckpt)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "verify: OK" in first.stdout  # FSDP2's SGD with momentum steps as the plain one's
    meta = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())
    assert meta["optimizer"] == "SGD"
    shards = [torch.load(os.path.join(ckpt, meta["folder"], e["file"]), weights_only=True)
              for e in sorted(meta["shards"], key=lambda e: e["file"])]
    # the first replica saved its stage's state, gathered whole; every one the whole weights
    assert ["optimizer" in s for s in shards] == [True, True, False, False]
    whole_model, _, _ = _gpt()
    for shard in shards:
        for name, value in shard["model"].items():
            assert value.shape == whole_model.state_dict()[name].shape, name
    second = _fxpipe_run(str(tmp_path / "out"), "--nproc", "2", "--steps", "2", "--verify",
                         "--resume", ckpt)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "verify: OK: steps 3..4" in second.stdout


def test_the_planner_weighs_sharding_the_optimizer_over_the_replicas():
    from fxpipe.planner import plan

    model, inputs = gpt.build(n_layer=2, d_model=64, n_head=4, seq_len=16, vocab_size=256,
                              batch=4, dropout=0.0)
    found = plan(model, inputs, devices=2, profile="a100", schedules=("gpipe",),
                 remats=("never",), max_chunks=1, prune=False)  # every candidate predicted
    by = {(c.replicas, c.shard): c for c in found.candidates}
    assert set(by) == {(1, "none"), (2, "none"), (2, "optimizer")}  # one rank x 2 replicas
    whole, sharded = by[2, "none"], by[2, "optimizer"]
    assert sharded.memory_bytes < whole.memory_bytes  # half of Adam's moments
    assert sharded.allreduce_s > whole.allreduce_s  # and the updated parameters broadcast
    # compile, for one replica's share of the batch, charges what the planner predicted
    (idx,) = inputs
    program = fxpipe.compile(model, (idx[:2],), profile="a100", stages=1, chunks=1,
                             remat="never", shard="optimizer", replicas=2)
    assert max(s.memory or 0 for s in program.plan.stages) == \
        pytest.approx(sharded.memory_bytes)
    # between the two, a limit leaves out the unsharded candidate of two replicas, not the
    # sharded one, whose options say so when it is the choice
    limit = sharded.memory_bytes * 1.001
    tight = plan(model, inputs, devices=2, profile="a100", schedules=("gpipe",),
                 remats=("never",), max_chunks=1, memory_per_device=limit, prune=False)
    fits = {(c.replicas, c.shard): c.fits for c in tight.candidates}
    assert fits[2, "optimizer"] and not fits[2, "none"]
    assert "optimizer" in tight.table()
    chosen = replace(tight, candidates=(sharded,))  # the options of a sharded choice
    assert chosen.options["shard"] == "optimizer" and chosen.options["replicas"] == 2


def test_the_command_line_compiles_with_shard_and_program_json_records_it(tmp_path, capsys):
    from fxpipe.cli import main
    from fxpipe.runtime.program.spec import spec_problems

    out = tmp_path / "out"
    assert main(["compile", "fxpipe.models.mlp:build", "--stages", "2", "--chunks", "2",
                 "--profile", "a100", "--shard", "optimizer", "--replicas", "2",
                 "--out", str(out)]) == 0
    assert "sharded over 2 replicas" in capsys.readouterr().out
    data = json.loads((out / "program.json").read_text())
    assert data["shard"] == "optimizer"
    assert "--shard optimizer --replicas 2" in (out / "stage_0.py").read_text()
    assert spec_problems({**data, "shard": "zero"}) == ["shard is 'zero' (allowed: none, "
                                                        "optimizer, full)"]
    full = tmp_path / "full"
    assert main(["compile", "fxpipe.models.mlp:build", "--stages", "2", "--chunks", "2",
                 "--profile", "a100", "--shard", "full", "--replicas", "2",
                 "--out", str(full)]) == 0
    assert "sharded over 2 replicas (the parameters and gradients too, between steps)" in \
        capsys.readouterr().out
    assert json.loads((full / "program.json").read_text())["shard"] == "full"


def test_remat_auto_recomputes_only_where_the_unsharded_state_leaves_no_room():
    model, (x,) = mlp.build(depth=4, batch=64)
    options = {"stages": 2, "chunks": 2, "profile": "a100"}
    whole = fxpipe.compile(model, (x,), remat="never", **options)
    kept = max((s.memory or 0) - s.held_bytes for s in whole.plan.stages)
    limit = 1.05 * (max(s.held_bytes for s in whole.plan.stages) + kept / 2)
    sharded = fxpipe.compile(model, (x,), remat="auto", memory_limit=limit, shard="optimizer",
                             replicas=2, **options)
    assert all(not s.regions for s in sharded.stages)  # Adam's moments / 2 leave room
    unsharded = fxpipe.compile(model, (x,), remat="auto", memory_limit=limit, **options)
    assert any(s.regions for s in unsharded.stages)
