"""Under torchrun, what a rank's stages hold under one plan (train mode) stays that rank's while
another plan (eval mode) is installed: a layer used in training only, or BatchNorm's counter of
batches, is named, saved and loaded by the rank that trains it, not read from another rank's
untrained copy of the model (fxpipe.program_state: _holders, _unused_state)."""
from __future__ import annotations

import torch
from ranks import spawn
from torch import nn

import fxpipe


class _TrainNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(),
                                  nn.Linear(96, 12), nn.Tanh())  # stage 0: the rest on stage 1
        self.bn = nn.BatchNorm1d(12)
        self.noise = nn.Linear(12, 12)  # a layer of the training-mode graph only
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.body(x))
        if self.training:
            h = h + 0.1 * self.noise(h)
        return self.head(h)


def _trained(steps: int = 2) -> tuple[_TrainNoise, fxpipe.Program, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _TrainNoise()
    x = torch.randn(8, 6)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    optimizer = torch.optim.SGD(program.parameters(), lr=0.1)
    for step in range(steps):
        torch.manual_seed(10 + step)
        program.step(torch.randn(8, 6), target=torch.randint(0, 3, (8,)))
        optimizer.step()
        optimizer.zero_grad()
    return model, program, optimizer


def _rank_state(rank: int, world: int, folder: str) -> dict[str, torch.Tensor]:
    _, program, optimizer = _trained()
    program.eval()  # installs the eval-mode plan, which reads neither noise nor the counter
    program.evaluate(torch.randn(8, 6), target=torch.randint(0, 3, (8,)))
    state = {k: v.clone() for k, v in program.state_dict().items()}
    program.save(folder, optimizer=optimizer, step=2)
    return state


def test_a_rank_names_and_saves_what_it_trained_while_an_eval_plan_is_installed(tmp_path):
    states = spawn(2, "test_state_across_plans", "_rank_state", str(tmp_path / "ckpt"))
    model, program, _ = _trained()  # the same training in one process
    expected = model.state_dict()
    assert set(states[0]).isdisjoint(states[1]), "a key reported by both ranks"
    merged = {**states[0], **states[1]}
    assert set(merged) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, msg=key)
    assert "noise.weight" in states[1] and "bn.num_batches_tracked" in states[1]  # rank 1's
    fresh = fxpipe.compile(_TrainNoise(), (torch.randn(8, 6),), stages=2, chunks=2)
    fresh.load(str(tmp_path / "ckpt"))
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, expected[key], msg=key)
