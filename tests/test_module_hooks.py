"""Hooks on the model's modules (fxpipe.frontend.module_hooks): what a forward hook returns is
captured and trains as in the plain model; the capture warns that anything else a hook does
happens only while compiling, and a call warns once of each hook added after compiling, which
no call runs. Backward hooks, which could change gradients no program step would change, are
refused at compile and when added after it."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxpipe


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


X, Y = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)), torch.tensor(
    [0, 1, 2, 0, 1, 2, 0, 1])


def _hook_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "forward hook" in str(w.message)]


def _compile(model: nn.Module) -> tuple[fxpipe.Program, list[str]]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        program = fxpipe.compile(model, (X,), stages=2, chunks=4)
    return program, _hook_warnings(record)


def _called(run) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run()
    return _hook_warnings(record)


def _assert_trains_as(model: nn.Module, plain: nn.Module, program: fxpipe.Program) -> None:
    loss = program.step(X, target=Y)
    expected = nn.functional.cross_entropy(plain(X), Y)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_hook_that_changes_an_output_trains_as_in_the_plain_model_and_is_named():
    model, plain = _model(), _model()
    for m in (model, plain):
        m[2].register_forward_hook(lambda module, inputs, out: out * 2)
    program, said = _compile(model)
    assert len(said) == 1 and said[0].startswith("forward hooks on '2' ran while compiling")
    torch.testing.assert_close(program(X), plain(X))
    _assert_trains_as(model, plain, program)


def test_a_hook_that_keeps_activations_is_warned_of_at_compile():
    model, kept = _model(), []
    model[2].register_forward_hook(lambda module, inputs, out: kept.append(out))
    model[0].register_forward_pre_hook(lambda module, inputs: None)
    program, said = _compile(model)
    assert len(said) == 1 and "'0', '2'" in said[0] and "only in the compile's trial runs" \
        in said[0]
    compiled = len(kept)
    assert _called(lambda: program(X)) == []  # warned once, at compile
    assert len(kept) == compiled  # what the warning says: the calls keep nothing


def test_a_hook_added_after_compiling_is_warned_of_once():
    model = _model()
    program, said = _compile(model)
    assert said == []
    assert _called(lambda: program(X)) == []
    handle = model[4].register_forward_hook(lambda module, inputs, out: None)
    said = _called(lambda: program.step(X, target=Y))
    assert len(said) == 1 and said[0].startswith("a forward hook added to '4' after compiling")
    assert _called(lambda: program(X)) == []  # once per hook
    handle.remove()
    model[2].register_forward_pre_hook(lambda module, inputs: None)
    assert "'2'" in _called(lambda: program.evaluate(X, target=Y))[0]


def test_a_global_hook_added_after_compiling_is_warned_of():
    program, _ = _compile(_model())
    handle = nn.modules.module.register_module_forward_hook(lambda module, inputs, out: None)
    try:
        said = _called(lambda: program(X))
    finally:
        handle.remove()
    assert len(said) == 1 and "(every module)" in said[0]


def _halves_gradient(module: nn.Module, grad_input: tuple, grad_output: tuple) -> tuple:
    return (grad_input[0] * 0.5,)


@pytest.mark.parametrize("register", ["register_full_backward_hook",
                                      "register_full_backward_pre_hook"])
def test_a_backward_hook_is_refused_at_compile(register):
    model = _model()
    hook = _halves_gradient if register == "register_full_backward_hook" else \
        (lambda module, grad_output: None)
    getattr(model[2], register)(hook)
    with pytest.raises(fxpipe.errors.CaptureError,
                       match=r"backward hooks on '2' cannot run in a program") as error:
        fxpipe.compile(model, (X,), stages=2, chunks=4)
    assert "p.register_hook" in str(error.value)


def test_a_backward_hook_added_after_compiling_is_refused_until_removed():
    model, plain = _model(), _model()
    program, _ = _compile(model)
    handle = model[2].register_full_backward_hook(_halves_gradient)
    for _ in range(2):  # every call, not once
        with pytest.raises(fxpipe.errors.ConfigError,
                           match=r"backward hooks on '2' added after compiling"):
            program.step(X, target=Y)
    assert all(p.grad is None for p in model.parameters())
    handle.remove()
    _assert_trains_as(model, plain, program)
