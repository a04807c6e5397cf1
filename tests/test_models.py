"""Tests for the reference models in fxpipe.models: the build/target contract, fx, export."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from fxpipe.models import MODELS

FX_TRACEABLE = [name for name in MODELS if name != "recurrent"]

# torch warns that nn.LSTM re-assigns its _flat_weights list while being exported; harmless.
ignore_lstm_export_warning = pytest.mark.filterwarnings(
    "ignore:The tensor attributes self.lstm._flat_weights"
)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def load(name: str):
    return importlib.import_module(f"fxpipe.models.{name}")


def batch_dim(name: str) -> int:
    return 1 if name == "recurrent" else 0


def kwargs_for(mod, inputs: tuple, **config) -> dict:
    return mod.example_kwargs(inputs, **config) if hasattr(mod, "example_kwargs") else {}


def outputs(out) -> list[torch.Tensor]:
    return list(out.values()) if isinstance(out, dict) else [out]


def default_loss(out, target: torch.Tensor) -> torch.Tensor:
    first = outputs(out)[0]
    if target.dtype == torch.int64:
        return F.cross_entropy(first.flatten(0, -2), target.flatten())
    return F.mse_loss(first, target)


def narrow(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    return t.narrow(dim, start, stop - start)


def assert_outputs_close(actual, expected) -> None:
    actual, expected = outputs(actual), outputs(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


def test_models_tuple_names_every_model_module_in_order():
    assert MODELS == ("mlp", "gpt", "resnet", "unet", "branchy", "recurrent")


@pytest.mark.parametrize("name", MODELS)
def test_every_module_and_model_class_has_a_docstring(name):
    mod = load(name)
    assert mod.__doc__ and mod.__doc__.strip()
    members = inspect.getmembers(mod, inspect.isclass)
    classes = [c for _, c in members if c.__module__ == mod.__name__]
    assert classes
    for cls in classes:
        if issubclass(cls, nn.Module):
            assert cls.__doc__ and cls.__doc__.strip(), cls.__name__


@pytest.mark.parametrize("name", MODELS)
def test_build_returns_a_train_mode_model_and_a_tuple_of_tensors(name):
    model, inputs = load(name).build()
    assert isinstance(model, nn.Module)
    assert model.training and all(m.training for m in model.modules())
    assert isinstance(inputs, tuple) and inputs
    assert all(isinstance(t, torch.Tensor) for t in inputs)
    assert all(t.shape[batch_dim(name)] == 8 for t in inputs)


@pytest.mark.parametrize("name", MODELS)
def test_batch_is_configurable_and_must_be_at_least_two(name):
    mod = load(name)
    _, inputs = mod.build(batch=4)
    assert all(t.shape[batch_dim(name)] == 4 for t in inputs)
    assert all(v.shape[0] == 4 for v in kwargs_for(mod, inputs).values())
    with pytest.raises(ValueError):
        mod.build(batch=1)


@pytest.mark.parametrize("name", MODELS)
def test_forward_and_backward_give_every_parameter_a_finite_gradient(name):
    mod = load(name)
    model, inputs = mod.build()
    out = model(*inputs, **kwargs_for(mod, inputs))
    loss = default_loss(out, mod.target(inputs))
    # the secondary outputs join the loss so that their heads get gradients too
    loss = loss + sum(o.float().mean() for o in outputs(out)[1:])
    assert torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", MODELS)
def test_target_fits_the_default_loss(name):
    mod = load(name)
    model, inputs = mod.build(batch=4, seed=3)
    target = mod.target(inputs, batch=4, seed=3)
    first = outputs(model(*inputs, **kwargs_for(mod, inputs, seed=3)))[0]
    if target.dtype == torch.int64:
        assert target.shape == first.shape[:-1]
        assert 0 <= target.min() and target.max() < first.shape[-1]
    else:
        assert target.dtype == first.dtype and target.shape == first.shape
    assert torch.isfinite(default_loss(first, target))
    torch.testing.assert_close(target, mod.target(inputs, batch=4, seed=3), rtol=0, atol=0)


def test_gpt_target_is_the_input_shifted_by_one():
    gpt = load("gpt")
    _, (idx,) = gpt.build()
    target = gpt.target((idx,))
    assert target.dtype == torch.int64 and target.shape == idx.shape
    assert torch.equal(target[:, :-1], idx[:, 1:])


@pytest.mark.parametrize("name", MODELS)
def test_model_is_batch_separable_in_eval_mode(name):
    mod = load(name)
    model, inputs = mod.build()
    model.eval()
    assert_batch_separable(name, model, inputs, kwargs_for(mod, inputs))


@pytest.mark.parametrize("name", MODELS)
def test_deterministic_load_gives_a_batch_separable_model_in_its_training_mode(name):
    from fxpipe.models import load as load_model

    model, inputs, kwargs = load_model(name, deterministic=True)
    assert_batch_separable(name, model, inputs, kwargs)


def test_deterministic_load_keeps_explicit_settings():
    from fxpipe.models import load as load_model

    model, _, _ = load_model("gpt", deterministic=True, dropout=0.1)
    assert model.training
    assert any(isinstance(m, nn.Dropout) and m.p == 0.1 for m in model.modules())
    resnet, _, _ = load_model("resnet", deterministic=True)
    assert not resnet.training


def assert_batch_separable(name: str, model: nn.Module, inputs: tuple, kwargs: dict) -> None:
    """The model's output on the whole batch equals its outputs on the two halves, joined."""
    bd, n = batch_dim(name), inputs[0].shape[batch_dim(name)]
    with torch.no_grad():
        whole = outputs(model(*inputs, **kwargs))
        halves = []
        for start, stop in [(0, n // 2), (n // 2, n)]:
            args = [narrow(t, bd, start, stop) for t in inputs]
            kw = {k: narrow(v, 0, start, stop) for k, v in kwargs.items()}
            halves.append(outputs(model(*args, **kw)))
    for i, expected in enumerate(whole):
        torch.testing.assert_close(torch.cat([h[i] for h in halves], dim=bd), expected)


@pytest.mark.parametrize("name", MODELS)
def test_same_seed_gives_identical_weights_and_inputs_and_different_seeds_differ(name):
    mod = load(name)
    (m1, in1), (m2, in2), (m3, in3) = mod.build(seed=5), mod.build(seed=5), mod.build(seed=6)
    s1, s2, s3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    for key in s1:
        torch.testing.assert_close(s1[key], s2[key], rtol=0, atol=0)
    assert any(not torch.equal(s1[k], s3[k]) for k in s1 if s1[k].is_floating_point())
    for a, b, c in zip(in1, in2, in3):
        assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(mod.target(in1, seed=5), mod.target(in2, seed=5))
    for k, v in kwargs_for(mod, in1, seed=5).items():
        assert torch.equal(v, kwargs_for(mod, in2, seed=5)[k])
        assert not torch.equal(v, kwargs_for(mod, in3, seed=6)[k])


@pytest.mark.parametrize("name", FX_TRACEABLE)
def test_symbolic_trace_matches_eager(name):
    mod = load(name)
    model, inputs = mod.build()
    kwargs = kwargs_for(mod, inputs)
    model.eval()
    traced = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        assert_outputs_close(traced(*inputs, **kwargs), model(*inputs, **kwargs))


def test_branchy_runs_without_its_gate_and_traces_that_path_with_concrete_args():
    branchy = load("branchy")
    model, (x, y) = branchy.build()
    model.eval()
    with torch.no_grad():
        ungated = model(x, y)
        gated = model(x, y, **branchy.example_kwargs((x, y)))
        assert set(ungated) == {"logits", "aux"}
        assert ungated["logits"].shape == (8, 10) and ungated["aux"].shape == (8, 4)
        assert not torch.allclose(ungated["logits"], gated["logits"])
        traced = torch.fx.symbolic_trace(model, concrete_args={"gate": None})
        assert_outputs_close(traced(x, y), ungated)


@ignore_lstm_export_warning
def test_recurrent_is_not_fx_traceable_but_exportable_with_a_dynamic_batch():
    recurrent = load("recurrent")
    model, (x,) = recurrent.build()
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)
    model.eval()
    batch = Dim("batch", min=1)
    exported = torch.export.export(model, (x,), dynamic_shapes=({1: batch},)).module()
    _, (x3,) = recurrent.build(batch=3, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(exported(x), model(x))
        torch.testing.assert_close(exported(x3), model(x3))
        assert exported(x3).shape == (12, 3, 5)


@ignore_lstm_export_warning
@pytest.mark.parametrize("name", MODELS)
def test_export_with_a_dynamic_batch_matches_eager_at_other_batch_sizes(name):
    mod = load(name)
    model, inputs = mod.build()
    kwargs = kwargs_for(mod, inputs)
    model.eval()
    bd, batch = batch_dim(name), Dim("batch", min=1)
    signature = inspect.signature(model.forward).parameters
    dynamic_shapes = {p: {bd if i < len(inputs) else 0: batch} for i, p in enumerate(signature)}
    exported = torch.export.export(model, inputs, kwargs=kwargs, dynamic_shapes=dynamic_shapes)
    module = exported.module()
    _, inputs3 = mod.build(batch=3, seed=1)
    kwargs3 = kwargs_for(mod, inputs3, seed=1)
    inputs1 = tuple(narrow(t, bd, 0, 1) for t in inputs3)
    kwargs1 = {k: v[:1] for k, v in kwargs3.items()}
    with torch.no_grad():
        assert_outputs_close(module(*inputs3, **kwargs3), model(*inputs3, **kwargs3))
        assert_outputs_close(module(*inputs1, **kwargs1), model(*inputs1, **kwargs1))


def test_gpt_lm_head_weight_is_the_token_embedding_weight():
    model, _ = load("gpt").build()
    assert model.lm_head.weight is model.wte.weight
    params = list(model.parameters())
    assert sum(p is model.wte.weight for p in params) == 1
    assert len({id(p) for p in params}) == len(params)


def test_gpt_dropout_lives_in_modules_and_is_active_only_in_train_mode():
    model, (idx,) = load("gpt").build()
    assert any(isinstance(m, nn.Dropout) and m.p == 0.1 for m in model.modules())
    with torch.no_grad():
        assert not torch.equal(model(idx), model(idx))
        model.eval()
        assert torch.equal(model(idx), model(idx))


def test_gpt_benchmark_config_builds_and_runs_one_forward():
    config = dict(d_model=256, n_layer=8, n_head=4, seq_len=128, vocab_size=4096, batch=16)
    gpt = load("gpt")
    model, (idx,) = gpt.build(**config)
    assert idx.shape == (16, 128) and idx.dtype == torch.int64
    with torch.no_grad():
        logits = model(idx)
    assert logits.shape == (16, 128, 4096)
    assert torch.isfinite(logits).all()
    assert gpt.target((idx,), **config).max() < 4096

