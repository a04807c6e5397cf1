"""Train/eval flags of the model's modules: a module in another mode than the model (a
BatchNorm frozen for fine-tuning) is captured in its own."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
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


def test_a_batchnorm_frozen_in_a_training_model_stays_frozen():
    """Fine-tuning with frozen statistics: the capture keeps bn's own eval flag, so bn
    normalises with its running statistics and leaves them alone."""
    model, plain, x, y = _case()
    model.bn.eval()
    plain.bn.eval()
    before = model.bn.running_mean.clone()
    program = _compile(model, x)
    torch.manual_seed(3)
    loss = program.step(x, target=y)
    torch.manual_seed(3)
    assert loss == pytest.approx(reference_step(program, plain, x, target=y), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    torch.testing.assert_close(model.bn.running_mean, before, rtol=0, atol=0)
    assert model.training and not model.bn.training
