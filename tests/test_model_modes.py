"""The model put in another mode after compiling (fxpipe.model_modes): `model.eval()` before
validating and `model.train()` after switch the program as program.eval() and program.train()
do, whichever came last counting; a module put in another mode alone is refused, naming it,
unless the modes are again those compiled."""
from __future__ import annotations

import pytest
import torch
from ranks import spawn
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError
from fxpipe.testing.reference_step import reference_step


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.5)
        self.bn = nn.BatchNorm1d(16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.bn(self.drop(self.inp(x))))


def _case() -> tuple[Net, Net, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    plain = Net()
    plain.load_state_dict(model.state_dict())
    return model, plain, torch.randn(8, 6), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])


def _compile(model: nn.Module, x: torch.Tensor) -> fxpipe.Program:
    return fxpipe.compile(model, (x,), stages=2, chunks=2)


def _assert_steps_as_plain(program: fxpipe.Program, model: nn.Module, plain: nn.Module,
                           x: torch.Tensor, y: torch.Tensor) -> None:
    """A seeded step equals the seeded plain step: the loss and every gradient."""
    torch.manual_seed(3)
    loss = program.step(x, target=y)
    torch.manual_seed(3)
    assert loss == pytest.approx(reference_step(program, plain, x, target=y), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_model_eval_switches_the_program_and_model_train_switches_it_back():
    model, plain, x, y = _case()
    program = _compile(model, x)
    model.eval()  # validation, as written for the plain model
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(program(x), plain(x))  # no dropout, running statistics
    assert not program.training
    expected = nn.functional.cross_entropy(plain(x), y).item()
    assert program.evaluate(x, target=y) == pytest.approx(expected, rel=1e-6)
    model.train()
    plain.train()
    _assert_steps_as_plain(program, model, plain, x, y)
    assert program.training


def test_the_last_of_program_and_model_mode_changes_counts():
    model, plain, x, _ = _case()
    program = _compile(model, x)
    program.eval()
    model.train()  # the model's flags did not change: the program stays in eval
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(program(x), plain(x))
    model.eval()
    program.train()  # after the model's change: the program trains
    program(x)
    assert program.training and not model.training


def test_one_module_put_in_another_mode_is_refused_naming_it():
    model, _, x, _ = _case()
    program = _compile(model, x)
    model.drop.eval()
    with pytest.raises(ConfigError, match=r"another mode after compiling: 'drop' \(eval\)"):
        program(x)
    model.drop.train()
    program(x)


def test_a_model_compiled_with_a_frozen_batchnorm_keeps_it_frozen():
    model, plain, x, y = _case()
    model.bn.eval()  # fine-tuning with frozen statistics
    plain.bn.eval()
    program = _compile(model, x)
    model.eval()
    program(x)
    assert not program.training
    model.train()  # unfreezes bn too: the program has no graph for that
    with pytest.raises(ConfigError, match=r"'bn' \(train\)"):
        program(x)
    model.bn.eval()  # the compiled modes again
    _assert_steps_as_plain(program, model, plain, x, y)


def test_a_batchnorm_frozen_in_a_training_model_stays_frozen():
    """Fine-tuning with frozen statistics: the capture keeps bn's own eval flag, so bn
    normalises with its running statistics and leaves them alone."""
    model, plain, x, y = _case()
    model.bn.eval()
    plain.bn.eval()
    before = model.bn.running_mean.clone()
    program = _compile(model, x)
    _assert_steps_as_plain(program, model, plain, x, y)
    torch.testing.assert_close(model.bn.running_mean, before, rtol=0, atol=0)
    assert model.training and not model.bn.training


def _rank_validates(rank: int, world: int) -> float:
    model, _, x, y = _case()
    program = _compile(model, x)
    model.eval()
    return program.evaluate(x, target=y)


def test_under_torchrun_model_eval_switches_every_rank():
    losses = spawn(2, __name__, "_rank_validates")
    _, plain, x, y = _case()
    plain.eval()  # no dropout, running statistics
    expected = nn.functional.cross_entropy(plain(x), y).item()
    assert losses == [pytest.approx(expected, rel=1e-5)] * 2
