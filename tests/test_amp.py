"""Mixed precision: autocast in every stage (local worker threads and ranks), values crossing
stages in bf16, and loss scaling with GradScaler that every rank agrees on.

References are the plain model under the same autocast. bf16 results depend on how the work is
cut (micro-batches reorder the sums), so gradients are compared with a tolerance of 2% of their
largest element; the pipelined loss and outputs must also be bf16-like, not fp32-like (the
checks fail if a stage silently runs in fp32).
"""
from __future__ import annotations

import copy
import importlib

import pytest
import torch
from ranks import spawn
from test_p2p import _chain_case

import fxpipe
from fxpipe.losses import default_loss
from fxpipe.models import load as load_model

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def _case(name: str) -> tuple:
    if name == "chain":  # tanh(Linear) blocks: the values crossing stages are bf16
        model, x, y = _chain_case()
        return model, (x,), {}, y
    model, inputs, kwargs = load_model(name, deterministic=True)
    return model, inputs, kwargs, importlib.import_module(f"fxpipe.models.{name}").target(inputs)


def _reference(model, inputs, kwargs, target, autocast: bool = True) -> tuple[float, dict]:
    model = copy.deepcopy(model)
    with torch.autocast(**BF16, enabled=autocast):
        loss = default_loss(model(*inputs, **kwargs), target)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()
                                  if p.grad is not None}


def _assert_grads_close(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=0.02, atol=0.02 * grad.abs().max(),
                                   msg=lambda m, n=name: f"grad of {n}: {m}")


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_autocast_around_a_local_program_runs_every_stage_in_bf16(name):
    model, inputs, kwargs, target = _case(name)
    loss_ref, grads_ref = _reference(model, inputs, kwargs, target)
    loss_fp32, _ = _reference(model, inputs, kwargs, target, autocast=False)
    program = fxpipe.compile(model, inputs, example_kwargs=kwargs, stages=3, chunks=4,
                             profile="a100")
    with torch.autocast(**BF16):
        out = program(*inputs, **kwargs)
        loss = default_loss(out, target)
    loss.backward()
    assert out.dtype == torch.bfloat16  # the last stage ran under autocast, on a worker thread
    assert abs(float(loss.detach()) - loss_ref) < abs(loss_fp32 - loss_ref) / 10
    _assert_grads_close({n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                        grads_ref)


def test_a_local_call_after_one_under_autocast_runs_in_float32_again():
    model, inputs, kwargs, target = _case("chain")
    program = fxpipe.compile(model, inputs, stages=2, chunks=2, profile="a100")
    with torch.autocast(**BF16):
        assert program(*inputs).dtype == torch.bfloat16
    assert program(*inputs).dtype == torch.float32  # nothing stayed behind in the workers


def test_program_step_with_a_grad_scaler_scales_the_backward_locally():
    model, inputs, kwargs, target = _case("mlp")
    _, grads_ref = _reference(model, inputs, kwargs, target, autocast=False)
    program = fxpipe.compile(model, inputs, stages=2, chunks=2, profile="a100")
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    program.step(*inputs, target=target, scaler=scaler)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad / 256.0, grads_ref[name])


# -- distributed: 2 ranks ----------------------------------------------------------------------


def _bf16_steps(rank: int, world: int, names: list[str]) -> dict:
    results = {}
    for name in names:
        model, inputs, kwargs, target = _case(name)
        program = fxpipe.compile(model, inputs, example_kwargs=kwargs, stages=world, chunks=2,
                                 profile="a100")
        out = {}
        for step in ("learn", "known"):  # the first step learns the boundary dtypes
            program.zero_grad(set_to_none=True)
            with torch.autocast(**BF16):
                loss = program.step(*inputs, target=target, **kwargs)
            out[step] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()
                                if p.grad is not None})
        program.zero_grad(set_to_none=True)
        out["fp32"] = (program.step(*inputs, target=target, **kwargs), None)
        out["dtypes"] = sorted({str(d) for v in program._rank.executor.boundary_dtypes.values()
                                for d in v.values()})
        out["early"] = sorted(key[2] for key in program._rank.executor.plans)
        results[name] = out
    return results


@pytest.mark.parametrize("p2p", ["strict", "batched"])
def test_autocast_around_distributed_steps_sends_bf16_and_matches_the_model(p2p):
    # strict: the dtype headers of the first step follow NCCL's rules too; batched (gloo): the
    # learned step posts every message at its tick, the next posts receives early
    names = ["chain", "gpt"]
    ranks = spawn(2, __name__, "_bf16_steps", names, env={"FXPIPE_P2P": p2p})
    for name in names:
        model, inputs, kwargs, target = _case(name)
        loss_ref, grads_ref = _reference(model, inputs, kwargs, target)
        loss_fp32, _ = _reference(model, inputs, kwargs, target, autocast=False)
        for step in ("learn", "known"):
            loss = ranks[0][name][step][0]
            assert loss == ranks[1][name][step][0]
            assert abs(loss - loss_ref) < abs(loss_fp32 - loss_ref) / 10, (name, loss, loss_ref)
            _assert_grads_close({**ranks[0][name][step][1], **ranks[1][name][step][1]},
                                grads_ref)
        assert ranks[0][name]["fp32"][0] == pytest.approx(loss_fp32, rel=1e-5)  # autocast off
    # the chain's stage 1 receives tanh of a bf16 matmul, in bf16
    assert ranks[1]["chain"]["dtypes"] == ["torch.bfloat16"]
    assert ranks[1]["gpt"]["dtypes"]  # learned too (the residual stream stays float32)
    assert ranks[0]["chain"]["early"] == ([False] if p2p == "strict" else [False, True])


def _scaled_step(rank: int, world: int, poison: bool) -> dict:
    model, inputs, kwargs, target = _case("mlp")
    program = fxpipe.compile(model, inputs, stages=world, chunks=2, profile="a100")
    optimizer = torch.optim.SGD(program.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    if poison and rank == 1:  # a non-finite gradient on the last rank only
        param = next(iter(program.parameters()))
        param.register_hook(lambda g: g * float("inf"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    program.step(*inputs, target=target, scaler=scaler)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    scaler.step(optimizer)
    scaler.update()
    moved = {n for n, p in model.named_parameters() if n in grads and not torch.equal(p, before[n])}
    return {"grads": grads, "moved": moved, "scale": scaler.get_scale(),
            "overflow": program._rank.executor.last.overflow}


def _scaled_steps(rank: int, world: int) -> dict:
    return {poison: _scaled_step(rank, world, poison) for poison in (False, True)}


@pytest.fixture(scope="module")
def scaled() -> dict:
    ranks = spawn(2, __name__, "_scaled_steps")
    return {poison: [r[poison] for r in ranks] for poison in (False, True)}


def test_grad_scaler_scales_the_distributed_backward(scaled):
    ranks = scaled[False]
    model, inputs, kwargs, target = _case("mlp")
    _, grads_ref = _reference(model, inputs, kwargs, target, autocast=False)
    got = {**ranks[0]["grads"], **ranks[1]["grads"]}
    for name, grad in grads_ref.items():
        torch.testing.assert_close(got[name] / 256.0, grad)
    assert [r["overflow"] for r in ranks] == [False, False]
    assert all(r["moved"] == set(r["grads"]) for r in ranks)  # both stepped
    assert [r["scale"] for r in ranks] == [256.0, 256.0]


def test_every_rank_skips_the_step_when_one_rank_has_inf_gradients(scaled):
    ranks = scaled[True]
    assert [r["overflow"] for r in ranks] == [True, True]
    assert [r["moved"] for r in ranks] == [set(), set()]  # rank 0's gradients were finite
    assert [r["scale"] for r in ranks] == [128.0, 128.0]  # lowered alike: the scales agree


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_a_program_compiled_with_autocast_runs_every_stage_in_bf16(name):
    model, inputs, kwargs, target = _case(name)
    loss_ref, grads_ref = _reference(model, inputs, kwargs, target)
    loss_fp32, _ = _reference(model, inputs, kwargs, target, autocast=False)
    program = fxpipe.compile(model, inputs, example_kwargs=kwargs, stages=3, chunks=4,
                             profile="a100", autocast="bf16")
    with torch.no_grad():
        assert program(*inputs, **kwargs).dtype == torch.bfloat16  # no autocast by the caller
    loss = program.step(*inputs, target=target, **kwargs)
    assert abs(loss - loss_ref) < abs(loss_fp32 - loss_ref) / 10
    _assert_grads_close({n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                        grads_ref)


def test_an_unknown_autocast_dtype_is_refused_before_any_work():
    model, inputs, _, _ = _case("mlp")
    with pytest.raises(fxpipe.FxPipeError, match=r"unknown autocast dtype 'float8'") as info:
        fxpipe.compile(model, inputs, stages=2, autocast="float8")
    assert "bf16" in str(info.value)


@pytest.mark.slow
def test_a_written_program_compiled_with_autocast_trains_in_bf16_and_verifies(tmp_path):
    import subprocess
    import sys

    model, inputs, kwargs, target = _case("mlp")
    program = fxpipe.compile(model, inputs, stages=2, chunks=2, profile="a100",
                             autocast="bf16")
    program.write(str(tmp_path), target=target, reference_steps=2)
    fp32 = fxpipe.compile(copy.deepcopy(model), inputs, stages=2, chunks=2, profile="a100")
    fp32.write(str(tmp_path / "fp32"), target=target, reference_steps=2)
    runs = [subprocess.run([sys.executable, str(folder / "program.py"), "--steps", "2",
                            "--verify"], capture_output=True, text=True, timeout=600)
            for folder in (tmp_path, tmp_path / "fp32")]
    for run in runs:
        assert run.returncode == 0, run.stdout + run.stderr
        assert "verify: OK" in run.stdout
    bf16_loss, fp32_loss = (float(r.stdout.split("step 0 loss ")[1].split()[0]) for r in runs)
    assert bf16_loss != fp32_loss  # the written program did run under autocast


def test_a_rank_without_an_optimizer_moves_its_loss_scale_as_the_ranks_that_step():
    from fxpipe.runtime.execution.amp import ScaleFollower

    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    stepping = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    following = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    follower = ScaleFollower()
    for overflow in (False, False, False, True, False, False, True, True, False):
        for scaler in (stepping, following):
            scaler.scale(torch.ones(()))  # every rank calls loss_scale
        weight.grad = torch.full((2,), float("inf") if overflow else 1.0)
        stepping.step(optimizer)
        stepping.update()
        follower.update(following, overflow)
        assert following.get_scale() == stepping.get_scale()

