"""A program among other modules: inside a parent (a head after a pipelined body, a training
wrapper) its tensors are in the parent's state_dict under the model's keys and load back from
it, as a plain submodule's would; before its first call, its state is the model's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError


def _body() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16),
                         nn.Tanh(), nn.Linear(16, 4))


def _wrapped(stages: int) -> nn.Module:
    program = fxpipe.compile(_body(), (torch.randn(8, 8),), stages=stages, chunks=2)
    torch.manual_seed(1)
    return nn.Sequential(program, nn.Linear(4, 2))


def test_a_parents_state_dict_holds_the_programs_tensors_under_the_models_keys():
    parent, body = _wrapped(2), _body()
    state = parent.state_dict()
    expected = [f"0.{k}" for k in body.state_dict()] + ["1.weight", "1.bias"]
    assert sorted(state) == sorted(expected)
    for key, value in body.state_dict().items():
        torch.testing.assert_close(state[f"0.{key}"], value)
    assert not any(v.requires_grad for v in state.values())
    kept = parent.state_dict(keep_vars=True)
    assert {id(p) for p in parent[0].model.parameters()} <= {id(v) for v in kept.values()}


def test_a_parent_loads_the_programs_tensors_back_whatever_its_cut():
    saved, other = _wrapped(2), _wrapped(3)
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.randn_like(p))
    x = torch.randn(8, 8)
    assert not torch.allclose(other(x), saved(x))
    result = other.load_state_dict(saved.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    torch.testing.assert_close(other(x), saved(x))


def test_a_parents_strict_load_names_missing_unexpected_and_mismatched_keys_as_the_model_does():
    parent = _wrapped(2)
    state = parent.state_dict()
    del state["0.3.weight"]
    state["0.9.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as error:
        parent.load_state_dict(state)
    message = str(error.value)
    assert 'Missing key(s) in state_dict: "0.3.weight"' in message
    assert 'Unexpected key(s) in state_dict: "0.9.weight"' in message
    assert "stage_modules" not in message
    result = parent.load_state_dict(state, strict=False)
    assert result.missing_keys == ["0.3.weight"] and result.unexpected_keys == ["0.9.weight"]
    state = parent.state_dict()
    state["0.5.weight"] = torch.zeros(3, 16)
    with pytest.raises(RuntimeError, match=r"size mismatch for 0\.5\.weight: copying a param with "
                                           r"shape \(3, 16\) from checkpoint, the shape in "
                                           r"current model is \(4, 16\)"):
        parent.load_state_dict(state)


def test_a_program_before_its_first_call_has_the_models_state():
    body = _body()
    program = fxpipe.compile(body, stages=2, chunks=2)
    assert list(program.state_dict(prefix="p.")) == [f"p.{k}" for k in body.state_dict()]
    zeros = {k: torch.zeros_like(v) for k, v in body.state_dict().items()}
    program.load_state_dict(zeros)
    assert all(not v.any() for v in body.state_dict().values())
    assert not program(torch.randn(8, 8)).any()  # built from the zeroed model


def _zero_linears(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.zeros_(module.weight)
        nn.init.constant_(module.bias, 0.5)


def test_apply_reaches_the_models_layers_whose_tensors_the_stages_hold():
    program = fxpipe.compile(_body(), (torch.randn(8, 8),), stages=2, chunks=2)
    reached: list[str] = []
    assert program.apply(lambda m: reached.append(type(m).__name__)) is program
    assert reached.count("Linear") == 3 and "Program" in reached
    program.apply(_zero_linears)
    torch.testing.assert_close(program(torch.randn(8, 8)), torch.full((8, 4), 0.5))
    for key in ("0.bias", "3.bias", "5.bias"):  # the Linears' (2 is the LayerNorm)
        assert (program.state_dict()[key] == 0.5).all(), key


def test_apply_is_refused_where_the_stages_hold_weights_the_model_has_not():
    with torch.device("meta"):
        model = _body()
    program = fxpipe.compile(model, (torch.randn(8, 8),), stages=2, chunks=2, check="shapes")
    program.init_weights(seed=0)
    with pytest.raises(ConfigError, match="the stages hold 8 tensors that are not the model's") \
            as error:
        program.apply(_zero_linears)
    assert "init_weights()" in error.value.hint
