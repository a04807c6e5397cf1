"""copy.deepcopy(program): an independent program over a copy of the model, as a deep copy of
the model would be, that trains like the plain model and leaves the original untouched; and
pickling, which a built program refuses with what to save instead."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import fxpipe
from fxpipe.errors import ConfigError
from fxpipe.losses import default_loss
from fxpipe.models import gpt
from fxpipe.storage.state import graph_tensors

CONFIG = {"vocab_size": 128, "seq_len": 16, "d_model": 32, "n_layer": 2, "n_head": 4,
          "dropout": 0.0}
IDX = torch.randint(128, (8, 16), generator=torch.Generator().manual_seed(0))
TARGET = IDX.roll(-1, dims=1)  # the next token


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def test_a_copy_trains_like_the_plain_model_and_leaves_the_original_alone():
    torch.manual_seed(0)
    model = gpt.GPT(**CONFIG)
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (IDX,), stages=2, chunks=4, profile="a100")
    clone = copy.deepcopy(program)

    own = {id(t) for t in clone.model.state_dict(keep_vars=True).values()}
    assert {id(p) for p in clone.parameters()} <= own  # the copy's model's tensors
    assert not {id(p) for p in clone.parameters()} & {id(p) for p in program.parameters()}
    assert {id(t) for t in graph_tensors(clone.built.captured).values()} <= own
    assert [s.index for s in clone.stages] == [s.index for s in program.stages]

    loss = clone.step(IDX, target=TARGET)
    expected = default_loss(plain(IDX), TARGET)
    expected.backward()
    assert loss == float(expected)
    grads = _grads(clone.model)
    for name, want in _grads(plain).items():
        torch.testing.assert_close(grads[name], want, msg=name)
    assert all(p.grad is None for p in program.parameters())  # the original did not step

    with torch.no_grad():  # the copy's weights are its own
        next(clone.parameters()).add_(1.0)
    torch.testing.assert_close(program(IDX), plain(IDX))


def test_a_lazy_program_copies_and_builds_on_its_own_first_call():
    torch.manual_seed(0)
    model = gpt.GPT(**CONFIG)
    program = fxpipe.compile(model, stages=2, chunks=4, profile="a100")
    clone = copy.deepcopy(program)
    torch.testing.assert_close(clone(IDX), model(IDX))
    assert clone.is_built and not program.is_built


def test_a_meta_models_copy_keeps_the_weights_its_stages_were_given():
    with torch.device("meta"):
        model = gpt.GPT(**CONFIG)
    program = fxpipe.compile(model, (IDX,), stages=2, chunks=2, profile="a100", check="shapes")
    program.init_weights(seed=3)
    clone = copy.deepcopy(program)
    state, copied = program.state_dict(), clone.state_dict()
    assert copied.keys() == state.keys()
    for key, value in state.items():
        assert not copied[key].is_meta, key
        torch.testing.assert_close(copied[key], value, rtol=0, atol=0, msg=key)
    torch.testing.assert_close(clone(IDX), program(IDX), rtol=0, atol=0)


def test_a_lazy_program_pickles_and_a_built_one_says_what_to_save_instead():
    torch.manual_seed(0)
    model = gpt.GPT(**CONFIG)
    buffer = io.BytesIO()
    torch.save(fxpipe.compile(model, stages=2, chunks=4, profile="a100"), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(IDX), model(IDX))

    with pytest.raises(ConfigError, match=r"not pickled.*\n.*program.save\(dir\).*deepcopy"):
        torch.save(loaded, io.BytesIO())
