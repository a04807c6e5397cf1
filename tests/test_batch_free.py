"""Outputs computed from the weights alone (a learned temperature, a penalty on the weights):
the same on every micro-batch, so a program of several micro-batches returns them and its loss
reads them as the plain model's does (fxpipe.passes.batch_free); an output without a batch
dimension that the batch or a random draw reaches stays refused."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from ranks import spawn
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError, LossError
from fxpipe.runtime.program.spec import signature_from_json, spec_problems

BATCH = 8


class Tempered(nn.Module):
    """Logits scaled by a learned temperature, returned apart, and a penalty on the first
    layer's weight, both for the loss to read."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.body = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                    for _ in range(3)))
        self.head = nn.Linear(16, 3)
        self.log_scale = nn.Parameter(torch.tensor(0.3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.head(self.body(self.inp(x))), self.log_scale.exp(),
                self.inp.weight.square().sum())


def tempered_loss(outputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    logits, scale, penalty = outputs
    return nn.functional.cross_entropy(logits * scale, target) + 1e-2 * penalty


def summed_loss(outputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    logits, scale, penalty = outputs
    return nn.functional.cross_entropy(logits * scale, target, reduction="sum") + penalty


def proportional_loss(outputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    logits, scale, penalty = outputs
    return nn.functional.cross_entropy(logits * scale, target, reduction="sum") + \
        penalty * len(target) / BATCH


def _case() -> tuple[Tempered, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return Tempered(), torch.randn(BATCH, 6), torch.randint(0, 3, (BATCH,))


def _plain(loss_fn=tempered_loss) -> tuple[float, dict[str, torch.Tensor]]:
    model, x, y = _case()
    loss = loss_fn(model(x), y)
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


def test_outputs_of_the_weights_alone_are_marked_and_others_are_not():
    model, x, _ = _case()
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    assert program.built.signature.out_batch_free == (False, True, True)


def test_a_program_of_micro_batches_returns_them_and_trains_like_the_plain_model():
    want_loss, want = _plain()
    model, x, y = _case()
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (x,), stages=2, chunks=4, split_points=["body.1"])
    for got, expected in zip(program(x), plain(x)):
        torch.testing.assert_close(got, expected)
    assert program.step(x, target=y, loss_fn=tempered_loss) == pytest.approx(want_loss, rel=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], msg=name)


class BatchStatistic(nn.Module):
    """An output without a batch dimension that the batch computes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return self.b(h), h.square().mean()


class DroppedWeight(nn.Module):
    """An output of the weights alone through a dropout: one mask per micro-batch would differ
    from the plain model's one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.b(self.a(x)), self.drop(self.a.weight).sum()


@pytest.mark.parametrize("model", [BatchStatistic(), DroppedWeight()],
                         ids=["batch statistic", "dropout on a weight"])
def test_an_output_the_batch_or_a_random_draw_reaches_is_refused(model):
    x = torch.randn(8, 6)
    with pytest.raises(ConfigError, match=r"output\[1\] of the model has no batch dimension"):
        fxpipe.compile(model, (x,), stages=2, chunks=2)
    program = fxpipe.compile(model, (x,), stages=2, chunks=1)  # one micro-batch: returned
    assert program.built.signature.out_batch_free == (False, False)


def test_program_json_keeps_them_and_checks_them(tmp_path):
    model, x, _ = _case()
    fxpipe.compile(model, (x,), stages=2, chunks=2).write(str(tmp_path))
    data = json.loads((tmp_path / "program.json").read_text())
    signature = data["signature"]
    assert signature["out_batch_free"] == [False, True, True] and spec_problems(data) == []
    assert signature_from_json(signature).out_batch_free == (False, True, True)
    older = {k: v for k, v in signature.items() if k != "out_batch_free"}  # written before
    assert signature_from_json(older).out_batch_free == (False, False, False)
    assert spec_problems({**data, "signature": older}) == []
    for bad in ([True, True, True], [False, "yes", True], [False, True]):
        problems = spec_problems({**data, "signature": {**signature, "out_batch_free": bad}})
        assert len(problems) == 1 and problems[0].startswith("signature.out_batch_free is "), \
            problems


def _ranks(rank: int, world: int) -> dict:
    out = {}
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        model, x, y = _case()
        program = fxpipe.compile(model, (x,), stages=2, chunks=4, profile="a100",
                                 split_points=["body.1"], schedule=schedule)
        loss = program.step(x, target=y, loss_fn=tempered_loss)
        own = {id(p) for p in program.parameters()}
        out[schedule] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()
                                if id(p) in own and p.grad is not None})
    try:  # summed over examples, the penalty once: no sum nor mean of micro-batch losses
        program.step(x, target=y, loss_fn=summed_loss)
        out["summed"] = "stepped"
    except LossError as e:
        out["summed"] = str(e)
    model, x, y = _case()  # as the refusal's hint says: the term in proportion to the examples
    program = fxpipe.compile(model, (x,), stages=2, chunks=4, profile="a100",
                             split_points=["body.1"])
    loss = program.step(x, target=y, loss_fn=proportional_loss)
    own = {id(p) for p in program.parameters()}
    out["proportional"] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()
                                  if id(p) in own and p.grad is not None})
    return out


@pytest.mark.distributed
def test_under_torchrun_every_schedule_trains_like_the_plain_model():
    """And a summed loss with the penalty added whole is refused, its hint naming the outputs
    and the way out, which then trains like the plain model."""
    want_loss, want = _plain()
    ranks = spawn(2, __name__, "_ranks", bound=300)
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        grads = {}
        for rank in ranks:
            loss, mine = rank[schedule]
            assert loss == pytest.approx(want_loss, rel=1e-5), schedule
            grads.update(mine)
        assert grads.keys() == want.keys(), schedule
        for name, grad in want.items():
            torch.testing.assert_close(grads[name], grad, msg=f"{schedule} {name}")
    want_loss, want = _plain(proportional_loss)
    grads = {}
    for rank in ranks:
        assert "The loss is neither a mean nor a sum over examples" in rank["summed"]
        assert "output[1], output[2] of the model is the same on every micro-batch, so a term " \
            "of it added to the loss counts once per micro-batch" in rank["summed"]
        loss, mine = rank["proportional"]
        assert loss == pytest.approx(want_loss, rel=1e-5)
        grads.update(mine)
    assert grads.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, msg=f"proportional {name}")
