"""The bundled GPT stepped on batches of several shapes, on ranks and as the plain model: what
tests of uneven batches and of other lengths compare (spawned by tests.ranks.spawn)."""
from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.models import gpt

Shapes = Sequence[tuple[int, int]]  # (batch, length) of each step's tokens


def tokens(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets of one batch."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 512, (batch, length), generator=g),
            torch.randint(0, 512, (batch, length), generator=g))


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The plain model's loss on the whole batch, its gradients accumulated."""
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return float(loss)


def steps_on_ranks(rank: int, world: int, schedule: str, stages: int, shapes: Shapes,
                   in_eval: bool) -> list[dict]:
    """The GPT compiled for 8 x 32 tokens in 4 chunks, one step and one evaluate() (after
    program.eval() when `in_eval`) per shape: the losses and this rank's gradients."""
    torch.manual_seed(0)
    model, (idx,) = gpt.build(batch=8, dropout=0.0)
    program = fxpipe.compile(model, (idx,), stages=stages, chunks=4, schedule=schedule,
                             profile="a100")
    out = []
    for i, (batch, length) in enumerate(shapes):
        x, y = tokens(batch, length, i)
        program.zero_grad()
        loss = program.step(x, target=y)
        evaluated = (program.eval() if in_eval else program).evaluate(x, target=y)
        out.append({"loss": loss, "evaluated": evaluated,
                    "grads": {n: p.grad.clone() for n, p in program.named_parameters()}})
        program.train()
    return out


def assert_ranks_match_plain(ranks: list[list[dict]], shapes: Shapes) -> None:
    """Every rank's loss and evaluation are the plain model's on the whole batch, and the
    ranks' gradients together are every one of its gradients."""
    torch.manual_seed(0)
    plain, _ = gpt.build(batch=8, dropout=0.0)
    for i, (batch, length) in enumerate(shapes):
        x, y = tokens(batch, length, i)
        plain.zero_grad()
        want = plain_step(plain, x, y)
        grads = {n: p.grad for n, p in plain.named_parameters()}
        seen = set()
        for result in ranks:
            run = result[i]
            assert [run["loss"], run["evaluated"]] == pytest.approx([want] * 2, rel=1e-5)
            for name, grad in run["grads"].items():
                torch.testing.assert_close(grad, grads[name], msg=f"{batch} x {length}: {name}")
                seen.add(name)
        assert seen == set(grads)
