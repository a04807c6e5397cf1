"""Structured targets (fxpipe.targets): a multi-task loss's labels and boxes in a tuple, list or
dict, split per micro-batch and per replica as the inputs are, train and evaluate as the plain
model does, in one process and on two ranks; a part whose batch differs is refused by name."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from ranks import spawn
from torch import nn

import fxpipe
from fxpipe.errors import LossError, RuntimeInputError
from fxpipe.targets import split_target


class _TwoTasks(nn.Module):
    """Class logits and a box from one trunk."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.classes = nn.Linear(16, 3)
        self.box = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.classes(h), self.box(h)


def _case(kind: str) -> tuple[nn.Module, torch.Tensor, object]:
    torch.manual_seed(0)
    x, labels, boxes = torch.randn(8, 6), torch.randint(0, 3, (8,)), torch.randn(8, 4)
    target = {"tuple": (labels, boxes), "list": [labels, boxes, 0.5],
              "dict": {"labels": labels, "boxes": boxes}}[kind]
    return _TwoTasks(), x, target


def _parts(target: object) -> tuple[torch.Tensor, torch.Tensor, float]:
    if isinstance(target, dict):
        return target["labels"], target["boxes"], 1.0
    return target[0], target[1], target[2] if len(target) > 2 else 1.0


def two_task_loss(outputs: tuple[torch.Tensor, torch.Tensor], target: object) -> torch.Tensor:
    labels, boxes, weight = _parts(target)
    return F.cross_entropy(outputs[0], labels) + weight * F.mse_loss(outputs[1], boxes)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["tuple", "list", "dict"])
def test_a_structured_target_trains_and_evaluates_as_the_plain_model(kind):
    model, x, target = _case(kind)
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (x,), stages=2, chunks=4)
    loss = program.step(x, target=target, loss_fn=two_task_loss)
    expected = two_task_loss(plain(x), target)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    ours, theirs = _grads(model), _grads(plain)
    assert ours.keys() == theirs.keys() == dict(plain.named_parameters()).keys()
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, msg=name)
    with torch.no_grad():
        assert program.evaluate(x, target=target, loss_fn=two_task_loss) == \
            pytest.approx(two_task_loss(plain(x), target).item(), rel=1e-6)


def test_each_tensor_of_a_target_splits_and_a_number_goes_to_every_micro_batch():
    labels, boxes = torch.arange(8), torch.arange(16.0).reshape(8, 2)
    parts = split_target({"labels": labels, "boxes": boxes, "weight": 0.5}, 2, 0, 8)
    assert [p["labels"].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert torch.equal(parts[1]["boxes"], boxes[4:])
    assert [p["weight"] for p in parts] == [0.5, 0.5]


def test_a_target_part_of_another_batch_is_refused_by_name():
    model, x, target = _case("dict")
    program = fxpipe.compile(model, (x,), stages=2, chunks=4)
    target["boxes"] = target["boxes"][:7]
    with pytest.raises(RuntimeInputError, match=r"target\['boxes'\] shape \(7, 4\) has no batch "
                                                r"dimension 0 of size 8") as error:
        program.step(x, target=target, loss_fn=two_task_loss)
    assert "each tensor of a structured target" in error.value.hint
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("loss_fn", [None, "cross_entropy", "mse"])
def test_the_built_in_losses_refuse_a_structured_target_with_a_hint(loss_fn):
    model, x, target = _case("tuple")
    program = fxpipe.compile(model, (x,), stages=2, chunks=4)
    with pytest.raises(LossError, match="take one target tensor, and the target is a tuple") as e:
        program.step(x, target=target, loss_fn=loss_fn)
    assert "loss_fn=" in e.value.hint


def _ranks_step(rank: int, world: int) -> dict:
    """A pipeline of two stages and two replicas of one stage, each stepping and evaluating
    the dict target."""
    out = {}
    for stages in (2, 1):
        model, x, target = _case("dict")
        program = fxpipe.compile(model, (x,), stages=stages, chunks=2, profile="a100")
        loss = program.step(x, target=target, loss_fn=two_task_loss)
        out[stages] = {"loss": loss, "grads": _grads(model),
                       "evaluated": program.evaluate(x, target=target, loss_fn=two_task_loss)}
    return out


@pytest.mark.distributed
def test_a_dict_target_on_two_ranks_and_on_two_replicas_trains_as_the_plain_model():
    plain, x, target = _case("dict")
    expected = two_task_loss(plain(x), target)
    expected.backward()
    grads = _grads(plain)
    results = spawn(2, __name__, "_ranks_step", timeout=120, bound=300)
    for stages in (2, 1):
        merged: dict[str, torch.Tensor] = {}
        for rank, result in enumerate(results):
            got = result[stages]
            assert got["loss"] == pytest.approx(expected.item(), rel=1e-5), (stages, rank)
            assert got["evaluated"] == pytest.approx(expected.item(), rel=1e-5), (stages, rank)
            merged.update(got["grads"])
        assert merged.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(merged[name], grad, rtol=1e-4, atol=1e-6, msg=name)
