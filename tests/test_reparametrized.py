"""torch's hook-based reparametrizations (`torch.nn.utils.weight_norm`, `torch.nn.utils.prune`,
the old `spectral_norm`) set a weight derived from parameters before every forward: the graph
derives it as the plain model does, so a pipeline trains the model's own parameters, with no
refusal of a stored tensor, no warning of a hook and none of a changed setting
(fxpipe.reparametrized)."""
from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import fxpipe
from fxpipe.errors import CaptureError


def _weight_norm(layer: nn.Linear) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still widely used
        nn.utils.weight_norm(layer)


def _pruned(layer: nn.Linear) -> None:
    prune.l1_unstructured(layer, "weight", amount=0.5)


def _pruned_twice(layer: nn.Linear) -> None:  # a PruningContainer of both masks
    prune.l1_unstructured(layer, "weight", amount=0.3)
    prune.random_unstructured(layer, "weight", amount=0.3)


def _model(reparametrize) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    reparametrize(model[2])
    reparametrize(model[6])  # one in each stage
    return model


def _ours(message: warnings.WarningMessage) -> bool:
    return "fxpipe" in message.filename or "hook" in str(message.message) \
        or "after compiling" in str(message.message)


@pytest.mark.parametrize("reparametrize", [_weight_norm, _pruned, _pruned_twice])
@pytest.mark.parametrize("capture", ["auto", "fx", "export"])
def test_a_reparametrized_model_trains_as_the_plain_model(reparametrize, capture):
    model, plain = _model(reparametrize), _model(reparametrize)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = fxpipe.compile(model, (x,), stages=2, chunks=4, capture=capture)
        torch.testing.assert_close(program(x), plain(x))
        model(x)  # the plain model's forward sets the derived weight anew
        loss = program.step(x, target=y, loss_fn=nn.functional.mse_loss)
    assert [str(w.message) for w in caught if _ours(w)] == []
    expected = nn.functional.mse_loss(plain(x), y)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    theirs = dict(plain.named_parameters())
    assert sorted(dict(model.named_parameters())) == sorted(theirs)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, msg=name)


def test_spectral_norm_runs_in_eval_mode_and_is_refused_in_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    nn.utils.spectral_norm(model[2])
    x = torch.randn(8, 8)
    model.eval()
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    torch.testing.assert_close(program(x), model(x))
    model.train()  # its power iteration updates two buffers in place, once per call
    with pytest.raises(CaptureError, match=r"updates its buffer 2.weight_u, buffer 2.weight_v"):
        fxpipe.compile(model, (x,), stages=2, chunks=2)


def test_pruning_after_compiling_is_refused_naming_the_weight():
    model = _model(lambda layer: None)
    x = torch.randn(8, 8)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    _pruned(model[2])  # moves the weight to weight_orig: the program's graph has no mask
    with pytest.raises(fxpipe.errors.ConfigError, match=r"the model's 2.weight was replaced"):
        program(x)


@pytest.mark.parametrize("reparametrize", [_weight_norm, _pruned])
def test_a_reparametrized_program_copies_and_writes_a_program_that_verifies(reparametrize,
                                                                            tmp_path):
    # torch refuses to deep-copy the derived weight (a tensor with a history): the copies
    # behind copy.deepcopy(program) and the written program's reference losses must not
    model = _model(reparametrize)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    clone = copy.deepcopy(program)
    torch.testing.assert_close(clone(x), model(x))
    program.write(str(tmp_path / "out"), target=y, loss_fn="mse")
    result = subprocess.run([sys.executable, str(tmp_path / "out" / "program.py"), "--steps",
                             "2", "--verify"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verify: OK: steps 0..1" in result.stdout
