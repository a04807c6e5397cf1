"""Plain settings of a model's modules changed after compiling (fxpipe/module_settings.py): the
graph holds the values it was captured with, so a change warns once, naming it; what forward
writes itself, private names and settings put back are not warned of."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.testing.reference_step import reference_step


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(16, 4)
        self.scale = 2.0  # the model's own setting, read by forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x)))) * self.scale


class _Counting(_Net):
    """A forward that writes a public attribute: the model's state, not a setting."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


def _compiled(model: nn.Module) -> tuple[fxpipe.Program, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    return fxpipe.compile(model, (x,), stages=2, chunks=2), x, y


def _settings_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "changed after compiling" in str(w.message)]


def _mse(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((out - t) ** 2).mean()


def test_a_changed_dropout_rate_warns_once_naming_both_values_and_the_program_keeps_its_own():
    torch.manual_seed(0)
    model = _Net().train()
    compiled_copy = copy.deepcopy(model)
    program, x, y = _compiled(model)
    model.drop.p = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(1)
        loss = program.step(x, target=y, loss_fn=_mse)
        program.step(x, target=y, loss_fn=_mse)
    found = _settings_warnings(caught)
    assert len(found) == 1, found
    assert "drop.p" in found[0] and "0.5 -> 0.0" in found[0]
    assert caught[[str(w.message) for w in caught].index(found[0])].filename == __file__
    # what the warning says: the program still runs the compiled rate
    torch.manual_seed(1)
    expected = reference_step(program, compiled_copy, x, target=y, loss_fn=_mse)
    assert loss == pytest.approx(expected, rel=1e-6)


def test_a_setting_of_the_model_itself_is_named_and_calling_it_warns_too():
    program, x, _ = _compiled(_Net().eval())
    program.model.scale = 3.0
    with pytest.warns(UserWarning, match=r"the model's scale changed after compiling "
                                         r"\(2\.0 -> 3\.0\)"):
        program(x)


def test_nothing_is_warned_of_when_nothing_changed_or_a_change_was_put_back():
    model = _Net().train()
    program, x, y = _compiled(model)
    model._private = 7  # private: not watched
    model.drop.p = 0.1
    model.drop.p = 0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program.step(x, target=y, loss_fn=_mse)
        model.eval()  # followed by the program: a capture in eval mode
        program(x)
        model.train()
        program(torch.randn(8, 8))
    assert _settings_warnings(caught) == []


def test_what_forward_writes_is_state_and_a_capture_of_another_mode_does_not_warn_of_it():
    model = _Counting().train()
    program, x, _ = _compiled(model)
    # the compile's own runs of forward counted: state from the first compile on
    assert "calls" not in program._settings.keys[program._settings.names.index("")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x)  # the plain model counts too
        program(x)
        program.eval()
        program(x)  # captures the eval variant, whose runs of forward count
        program.train()
        program(x)
    assert _settings_warnings(caught) == []
    assert "calls" not in program._settings.keys[program._settings.names.index("")]
    model.scale = 5.0  # the module's other settings are still watched
    with pytest.warns(UserWarning, match="scale changed after compiling"):
        program(x)


def test_a_copied_program_watches_its_own_model():
    program, x, _ = _compiled(_Net().eval())
    clone = copy.deepcopy(program)
    program.model.drop.p = 0.2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clone(x)
    assert _settings_warnings(caught) == []
    clone.model.drop.p = 0.3
    with pytest.warns(UserWarning, match=r"drop\.p changed after compiling \(0\.5 -> 0\.3\)"):
        clone(x)


class _Masked(nn.Module):
    """A tensor kept as a plain attribute (not a buffer): the graph holds that tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.mask = torch.ones(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.mask


def test_a_tensor_attribute_changed_in_place_runs_and_one_put_in_its_place_is_warned_of():
    torch.manual_seed(0)
    model = _Masked().eval()
    x = torch.randn(8, 8)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    model.mask[::2] = 0.0  # in place: the program's own tensor
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(program(x), model(x))
    assert _settings_warnings(caught) == []
    model.mask = torch.full((8,), 3.0)
    with pytest.warns(UserWarning, match=r"the model's mask changed after compiling \(a tensor "
                                         r"of shape \(8,\) -> a tensor of shape \(8,\)\)"):
        program(x)
