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


def test_a_region_lost_by_export_is_refused_not_trained():
    """torch.export drops a no_grad nested in an autocast region: the values agree, but the
    graph would train `side`, which the model does not; capture says so instead."""
    torch.manual_seed(0)
    with pytest.raises(fxpipe.FxPipeError) as err:
        capture(NoGradInAutocast(), (_batch(),), method="export")
    message = str(err.value)
    assert "gives gradients to other parameters than the model" in message, message
    assert "only the graph to side.bias, side.weight" in message, message


def test_fx_records_the_region_it_runs_through():
    """torch.fx runs `with torch.no_grad():` while tracing; its operations are marked with it,
    and the operations after it are not."""
    gm = capture(_model("no_grad", True), (_batch(),), method="fx")
    modes = {n.name: ir.mode(n) for n in gm.graph.nodes}
    assert modes["gate"] == (ir.GradMode(False),)
    assert modes["mix"] == () and modes["head"] == ()


# --- buffers filled on the first forward ----------------------------------------------------------

class LazyPositions(nn.Module):
    """Attention whose relative positions are built on the first forward, once the number of
    tokens is known (as timm's ConViT builds `rel_indices`)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rel", torch.zeros(1, 1, 2), persistent=False)
        self.register_buffer("table", None)
        self.qk = nn.Linear(D, 2 * D)
        self.pos = nn.Linear(2, 1)
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if self.rel.shape[1] != n:
            i = torch.arange(n, dtype=x.dtype)
            self.rel = torch.stack(torch.broadcast_tensors(i[:, None] - i, (i[:, None] - i) ** 2),
                                   dim=-1)
        if self.table is None:
            self.table = torch.linspace(0, 1, D)
        q, k = self.qk(x).chunk(2, dim=-1)
        scores = q @ k.transpose(-1, -2) / D ** 0.5 + self.pos(self.rel).squeeze(-1)
        h = scores.softmax(-1) @ (x + self.table)
        return self.out(self.norm(h))


class KeyCache(LazyPositions):
    """LazyPositions that also keeps the last keys in a buffer on every call (a KV cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(4, 5, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.k_cache[: x.shape[0]] = self.qk(x).chunk(2, dim=-1)[1].detach()
        return out


def _lazy(model_type: type[nn.Module], train: bool) -> nn.Module:
    torch.manual_seed(0)
    return model_type().train(train)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("remat", ["never", "always"])
def test_a_buffer_filled_on_the_first_forward_is_filled_before_capture(train, remat):
    check_transparent(_lazy(LazyPositions, train), (_batch(),), None, 2, 2, remat)


def test_compiling_leaves_the_model_as_its_first_forward_would():
    """The filled buffers as the model's own first call fills them; parameters, BatchNorm
    statistics and the other buffers untouched."""
    torch.manual_seed(0)
    model = nn.Sequential(LazyPositions(), nn.BatchNorm1d(5)).train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    statistics = {n: b.clone() for n, b in model[1].named_buffers()}
    eager = LazyPositions()
    with torch.no_grad():
        eager(_batch())
    fxpipe.compile(model, _batch(), stages=2, chunks=2)
    assert torch.equal(model[0].rel, eager.rel) and model[0].rel.shape == (5, 5, 2)
    assert torch.equal(model[0].table, eager.table)
    assert "0.rel" not in model.state_dict()  # still the non-persistent buffer it was
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]), name
    for name, b in model[1].named_buffers():
        assert torch.equal(b, statistics[name]), name


def test_a_buffer_written_on_every_forward_is_still_refused():
    model = _lazy(KeyCache, True)
    with pytest.raises(fxpipe.FxPipeError) as err:
        fxpipe.compile(model, _batch(), stages=2, chunks=2)
    message = str(err.value)
    assert "KeyCache updates its buffer k_cache in forward" in message, message
    assert "buffer rel" not in message, message  # filled once: not refused
    assert not model.k_cache.any()  # put back as it was
    assert model.rel.shape == (5, 5, 2)  # as after the model's own first call
