"""A model tensor or module replaced after compiling (an assignment, load_state_dict(assign=True),
a weight tied after the fact, a new head or activation) is refused by the next call, naming it,
before anything runs: the stages hold the tensors the model was compiled with and run the graph
captured from its modules (fxpipe.replaced). Values changed in place keep training as the plain
model does."""
from __future__ import annotations

import copy

import pytest
import torch
from ranks import spawn
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 12)
        self.body = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh())
        self.head = nn.Linear(12, 3)
        self.register_buffer("shift", torch.full((12,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)) + self.shift)


def _case() -> tuple[Tied, fxpipe.Program, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Tied()
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    return model, fxpipe.compile(model, (x,), stages=2, chunks=4), x, y


def _gradients(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _replace_weight(model: nn.Module) -> None:
    model.body[2].weight = nn.Parameter(model.body[2].weight.detach() * 2)


def _replace_buffer(model: nn.Module) -> None:
    model.shift = torch.zeros(12)


def _assign_state(model: nn.Module) -> None:
    model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()},
                          assign=True)


def _tie(model: nn.Module) -> None:
    model.body[2].weight = model.body[0].weight


@pytest.mark.parametrize("change, name", [(_replace_weight, "body.2.weight"),
                                          (_replace_buffer, "shift"),
                                          (_assign_state, "emb.weight"),
                                          (_tie, "body.2.weight")])
@pytest.mark.parametrize("call", ["forward", "step", "evaluate"])
def test_a_tensor_replaced_after_compiling_is_refused_before_anything_runs(change, name, call):
    model, program, x, y = _case()
    change(model)
    run = {"forward": lambda: program(x), "step": lambda: program.step(x, target=y),
           "evaluate": lambda: program.evaluate(x, target=y)}[call]
    with pytest.raises(ConfigError, match=rf"the model's {name}.* was replaced by another "
                                          r"tensor after compiling") as error:
        run()
    assert "before fxpipe.compile" in str(error.value)
    assert all(g is None for g in _gradients(model).values())


def _new_head(model: nn.Module) -> None:
    model.head = nn.Linear(12, 3)


def _other_activation(model: nn.Module) -> None:
    model.body[3] = nn.ReLU()  # no weights: only the graph knows it


@pytest.mark.parametrize("change, name", [(_new_head, "head"), (_other_activation, "body.3")])
@pytest.mark.parametrize("call", ["forward", "step", "evaluate"])
def test_a_module_replaced_after_compiling_is_refused_before_anything_runs(change, name, call):
    model, program, x, y = _case()
    change(model)
    run = {"forward": lambda: program(x), "step": lambda: program.step(x, target=y),
           "evaluate": lambda: program.evaluate(x, target=y)}[call]
    with pytest.raises(ConfigError, match=rf"the model's submodule {name} was replaced by "
                                          r"another module after compiling") as error:
        run()
    assert "before fxpipe.compile" in str(error.value)
    assert all(g is None for g in _gradients(model).values())


def test_the_compiled_module_put_back_runs_again_and_a_new_compile_runs_the_new_one():
    model, program, x, y = _case()
    compiled = model.body[3]
    _other_activation(model)
    with pytest.raises(ConfigError, match="body.3"):
        program(x)
    model.body[3] = compiled
    torch.testing.assert_close(program(x), model(x))
    _other_activation(model)
    torch.testing.assert_close(fxpipe.compile(model, (x,), stages=2, chunks=4)(x), model(x))


def test_the_compiled_tensor_put_back_runs_again():
    model, program, x, y = _case()
    compiled = model.body[2].weight
    _replace_weight(model)
    with pytest.raises(ConfigError):
        program(x)
    model.body[2].weight = compiled
    torch.testing.assert_close(program(x), model(x))


def test_values_loaded_in_place_train_as_the_plain_model():
    model, program, x, y = _case()
    plain = copy.deepcopy(model)
    torch.manual_seed(1)
    state = {k: v + 0.1 * torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    plain.load_state_dict(state)
    with torch.no_grad():  # and in place by hand
        model.head.bias.copy_(torch.arange(3.0))
        plain.head.bias.copy_(torch.arange(3.0))
    loss = program.step(x, target=y)
    expected = nn.functional.cross_entropy(plain(x), y)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    ours, theirs = _gradients(model), _gradients(plain)
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, msg=name)


def test_a_copied_program_checks_its_own_model():
    model, program, x, _ = _case()
    clone = copy.deepcopy(program)
    _replace_weight(model)  # the original's model, not the clone's
    torch.testing.assert_close(clone(x), clone.model(x))
    _replace_weight(clone.model)
    with pytest.raises(ConfigError, match="body.2.weight"):
        clone(x)


def _rank_replaces(rank: int, world: int) -> float:
    model, program, x, y = _case()
    if rank == 1:  # the head's stage: the replaced weight is this rank's
        model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    return program.step(x, target=y)


def test_under_torchrun_the_rank_holding_the_replaced_tensor_refuses():
    with pytest.raises(AssertionError, match=r"rank 1[\s\S]*ConfigError: the model's "
                                             r"head.weight was replaced"):
        spawn(2, "test_replaced", "_rank_replaces")
