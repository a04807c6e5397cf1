"""Grad-mode and autocast regions inside forward, and buffers a model fills on its first forward.

Regions: `with torch.no_grad():` (Speech2Text builds its sinusoidal positions so),
`torch.enable_grad()` and `torch.autocast(...)` inside forward are carried into the stage code,
so the pipeline computes the outputs, the loss and every parameter's gradient (none for a
parameter read only under no_grad) of the plain model, wherever a stage boundary or a remat
region falls.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe import ir
from fxpipe.frontend.capture import capture
from fxpipe.testing.transparency import check_transparent

D = 8


class NoGradPositions(nn.Module):
    """Positions and a gate computed under torch.no_grad(): `scale` and `gate` are read only
    there, so the plain model gives them no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.ones(1))
        self.gate = nn.Linear(D, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        with torch.no_grad():
            pos = torch.arange(x.shape[1], dtype=x.dtype, device=x.device)
            freq = torch.exp(torch.arange(0, D, 2, dtype=x.dtype) * (-4.0 / D)) * self.scale
            angle = pos[:, None] * freq[None, :]
            table = torch.cat([angle.sin(), angle.cos()], dim=-1)
            g = torch.sigmoid(self.gate(h))
        h = torch.relu(self.mix(h + table)) * g
        return self.head(h)


class EnableGradInside(nn.Module):
    """torch.enable_grad() inside torch.no_grad(): only the inner part is differentiated."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.frozen = nn.Linear(D, D)
        self.inner = nn.Linear(D, D)
        self.b = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            f = torch.tanh(self.frozen(h))
            with torch.enable_grad():
                k = self.inner(f) * h
        return self.b(k + f)


class AutocastRegion(nn.Module):
    """A bfloat16 autocast region beside a no_grad region."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.side = nn.Linear(D, D)
        self.low = nn.Linear(D, D)
        self.b = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            s = self.side(h)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            k = self.low(h) * torch.sigmoid(s)
        return self.b(torch.relu(k.to(h.dtype)))


class NoGradInAutocast(AutocastRegion):
    """A no_grad region nested in an autocast region (which torch.export loses, torch.fx
    keeps)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                s = self.side(h)
            k = self.low(h) * torch.sigmoid(s)
        return self.b(torch.relu(k.to(h.dtype)))


REGION_MODELS = {"no_grad": (NoGradPositions, "gate"), "enable_grad": (EnableGradInside, "inner"),
                 "autocast": (AutocastRegion, "low")}


def _model(kind: str, train: bool) -> nn.Module:
    torch.manual_seed(0)
    model = REGION_MODELS[kind][0]()
    return model.train(train)


def _batch() -> torch.Tensor:
    return torch.randn(4, 5, D, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", sorted(REGION_MODELS))
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("method", ["auto", "export"])
def test_a_region_computes_what_the_plain_model_computes(kind, train, method):
    check_transparent(_model(kind, train), (_batch(),), None, 2, 2, "never", capture=method)


@pytest.mark.parametrize("kind", sorted(REGION_MODELS))
@pytest.mark.parametrize("method", ["auto", "export"])
def test_a_stage_boundary_inside_a_region_under_remat(kind, method):
    """The second stage starts inside the region and both stages recompute in backward."""
    inside = REGION_MODELS[kind][1]
    check_transparent(_model(kind, True), (_batch(),), None, 2, 2, "always", capture=method,
                      split_points=[inside])


def test_the_stage_code_enters_the_region_as_the_model_does():
    program = fxpipe.compile(_model("autocast", True), _batch(), stages=2, chunks=2,
                             capture="export", split_points=["b"])
    code = program.stages[0].source
    assert "with torch.no_grad():" in code
    assert "with torch.autocast('cpu', dtype=torch.bfloat16" in code


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_a_region_nested_in_another(train):
    torch.manual_seed(0)
    model = NoGradInAutocast().train(train)
    check_transparent(model, (_batch(),), None, 2, 2, "always", split_points=["low"])
    program = fxpipe.compile(model, _batch(), stages=2, chunks=2, split_points=["b"])
    assert "    with torch.no_grad():" in program.stages[0].source  # inside the autocast


def test_fx_records_the_region_it_runs_through():
    """torch.fx runs `with torch.no_grad():` while tracing; its operations are marked with it,
    and the operations after it are not."""
    gm = capture(_model("no_grad", True), (_batch(),), method="fx")
    modes = {n.name: ir.mode(n) for n in gm.graph.nodes}
    assert modes["gate"] == (ir.GradMode(False),)
    assert modes["mix"] == () and modes["head"] == ()

