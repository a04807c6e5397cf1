"""What the loss reaches across ranks. Values it does not reach, sent from one stage to another:
their senders' weights keep no gradient, as in the plain model, under every schedule and across
steps (NOTE [Absent gradients] in fxpipe/runtime/communication/dist_comm.py). Parameters it reads
directly that another rank trains: refused, since their gradient would stay on the last rank."""
from __future__ import annotations

import copy

import pytest
import torch
from ranks import spawn
from torch import nn

import fxpipe
from fxpipe.errors import LossError, PipelineRuntimeError

pytestmark = pytest.mark.distributed

STEPS = 3
LR = 0.05
DECAY = 0.5  # AdamW moves a weight with a zero gradient, and leaves one with none


class EarlyHeads(nn.Module):
    """A trunk whose loss reads only `head`: `aux` (on the input, on the first stage), `side`
    (on the first layer's output and again on the last layer's: one weight on the first and
    the last stage) and `gate` (read through argmax) give outputs the loss ignores, so none
    of them gets a gradient in the plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(6, 2)
        self.inp = nn.Linear(6, 16)
        self.trunk = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                   for _ in range(4))
        self.side = nn.Linear(16, 2)
        self.gate = nn.Linear(16, 4)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = self.aux(x)
        h = self.inp(x)
        early = self.side(h)
        choice = self.gate(h).argmax(-1)
        for layer in self.trunk:
            h = layer(h)
        return self.head(h), a, early + self.side(h), choice


def first_output_loss(outputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(outputs[0], target)


class SometimesAux:
    """A loss that reads `aux` only once told to: a loss function whose reach changes."""

    def __init__(self) -> None:
        self.with_aux = False

    def __call__(self, outputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(outputs[0], target)
        return loss + outputs[1].square().mean() if self.with_aux else loss


CUTS = {2: ["trunk.2"], 4: ["trunk.1", "trunk.2", "trunk.3"]}
CASES = [("gpipe", 2), ("1f1b", 2), ("zb-h1", 2), ("interleaved-1f1b", 4), ("zb-v", 4),
         ("dualpipev", 4)]
UNREACHED = ("aux.", "side.", "gate.")


def early_heads() -> tuple[EarlyHeads, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return EarlyHeads(), torch.randn(8, 6), torch.randn(8, 3)


def _train(step, params) -> dict:
    """Losses, the first step's gradients (None where none) and the final state."""
    optimizer = torch.optim.AdamW(params.values(), lr=LR, weight_decay=DECAY)
    losses, grads = [], {}
    for k in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        losses.append(step())
        if k == 0:
            grads = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
        optimizer.step()
    return {"losses": losses, "grads": grads}


def _plain() -> dict:
    model, x, y = early_heads()

    def step() -> float:
        loss = first_output_loss(model(x), y)
        loss.backward()
        return float(loss.detach())

    out = _train(step, dict(model.named_parameters()))
    return {**out, "state": copy.deepcopy(model.state_dict())}


def _pipelined(rank: int, world: int) -> dict:
    results = {}
    for schedule, stages in CASES:
        model, x, y = early_heads()
        program = fxpipe.compile(model, (x,), stages=stages, chunks=4, profile="a100",
                                 split_points=CUTS[stages], schedule=schedule)
        out = _train(lambda p=program, x=x, y=y: p.step(x, target=y, loss_fn=first_output_loss),
                     dict(program.named_parameters()))
        results[schedule] = {**out, "state": program.state_dict()}
    return results


@pytest.mark.parametrize("transport", ["gloo", "strict"])
def test_weights_the_loss_does_not_reach_keep_no_gradient_under_every_schedule(transport):
    # strict: NCCL's rules (messages met in posting order, no eager buffer)
    want = _plain()
    assert all(want["grads"][n] is None for n in want["grads"] if n.startswith(UNREACHED))
    env = {"FXPIPE_P2P": "strict"} if transport == "strict" else None
    ranks = spawn(2, __name__, "_pipelined", env=env, bound=300)
    for schedule, _ in CASES:
        grads: dict = {}
        state: dict = {}
        for rank in ranks:
            got = rank[schedule]
            assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), schedule
            for name, grad in got["grads"].items():
                if grad is not None or name not in grads:
                    grads[name] = grad
            state.update(got["state"])
        assert set(grads) == set(want["grads"])
        for name, grad in want["grads"].items():
            if grad is None:
                assert grads[name] is None, f"{schedule}: {name} got a gradient, the model none"
            else:
                torch.testing.assert_close(grads[name], grad, msg=f"{schedule} {name}")
        for name, value in want["state"].items():  # weight decay moved none of them
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6,
                                       msg=f"{schedule} {name}")


def _reach_changes(rank: int, world: int) -> str:
    model, x, y = early_heads()
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, profile="a100",
                             split_points=CUTS[2])
    loss = SometimesAux()
    program.step(x, target=y, loss_fn=loss)  # learns that aux's value gets no gradient
    loss.with_aux = True
    try:
        program.step(x, target=y, loss_fn=loss)
    except PipelineRuntimeError as e:
        return str(e)
    return "no error"


def test_a_loss_that_reaches_a_value_its_first_step_did_not_is_refused_on_its_receiver():
    # rank 1 refuses; rank 0, waiting for that gradient, stops at the group's timeout
    errors = spawn(2, __name__, "_reach_changes", timeout=10, bound=120)
    assert "the loss reached 'aux', sent by stage 0 to stage 1 (micro-batch" in errors[1]
    assert "which the first step with this loss function did not reach" in errors[1]
    assert errors[0] != "no error"


def _head_penalised(model: EarlyHeads):
    def loss(outputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        penalty = sum(p.square().sum() for p in model.head.parameters())
        return first_output_loss(outputs, target) + 1e-2 * penalty
    return loss


def _all_penalised(model: EarlyHeads):
    def loss(outputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        penalty = sum(p.square().sum() for p in model.parameters())
        return first_output_loss(outputs, target) + 1e-2 * penalty
    return loss


def _reads_parameters(rank: int, world: int) -> dict:
    """A loss with an L2 penalty over the last stage's own parameters (allowed: its gradient
    is this rank's to keep) and one over every parameter (refused)."""
    out: dict = {}
    model, x, y = early_heads()
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, profile="a100",
                             split_points=CUTS[2])
    out["own"] = (program.step(x, target=y, loss_fn=_head_penalised(model)),
                  {n: p.grad.clone() for n, p in program.named_parameters()
                   if p.grad is not None})
    try:
        program.step(x, target=y, loss_fn=_all_penalised(model))
        out["every"] = "no error"
    except (LossError, PipelineRuntimeError) as e:
        out["every"] = f"{type(e).__name__}: {e}"
    return out


def test_a_loss_reading_parameters_another_rank_trains_is_refused_its_own_are_trained():
    model, x, y = early_heads()
    loss = _head_penalised(model)(model(x), y)
    loss.backward()
    ranks = spawn(2, __name__, "_reads_parameters", timeout=10, bound=120)
    grads = {**ranks[0]["own"][1], **ranks[1]["own"][1]}
    assert ranks[1]["own"][0] == pytest.approx(float(loss), rel=1e-5)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, msg=name)
    # the last rank refuses; the first, waiting for it, stops at the group's timeout
    assert ranks[1]["every"].startswith("LossError: the loss function reads the model's "
                                        "parameter 'aux.weight' and 9 more, which this "
                                        "rank's stages do not hold"), ranks[1]["every"]
    assert ranks[0]["every"] != "no error"
