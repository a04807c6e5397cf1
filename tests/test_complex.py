"""Complex values (an FFT token mixer, FNet's): a complex constant is written as code, and a
complex or FFT-derived value crossing a stage boundary carries its gradient back, in one process
and over 2 gloo ranks, as in the plain model (autograd tracks complex dtypes as it does floating
ones: fxpipe.ir.differentiable)."""
from __future__ import annotations

import copy

import pytest
import torch
from ranks import spawn
from torch import nn

import fxpipe
from fxpipe.errors import PipelineRuntimeError


class Spectral(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft(h, dim=-1)


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.phase = nn.Parameter(torch.randn(16))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return torch.fft.ifft(c * torch.exp(1j * self.phase), dim=-1).real


class FNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.spec = Spectral()
        self.mix = Mix()
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.spec(self.inp(x))))).mean(1)


CUTS = {"complex": ["mix"], "after the inverse": ["out"]}


def _case() -> tuple[FNet, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return FNet(), torch.randn(8, 5, 8), torch.randint(0, 3, (8,))


def _compile(model: nn.Module, x: torch.Tensor, cut: str) -> fxpipe.Program:
    return fxpipe.compile(model, (x,), stages=2, chunks=4, split_points=CUTS[cut])


def _plain() -> tuple[float, dict[str, torch.Tensor]]:
    model, x, y = _case()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _rank_step(rank: int, world: int, cut: str) -> tuple[float, dict[str, torch.Tensor]]:
    model, x, y = _case()
    program = _compile(model, x, cut)
    loss = program.step(x, target=y)
    own = {id(p) for p in program.parameters()}
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()
                  if id(p) in own and p.grad is not None}


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_an_fft_mixer_trains_as_the_plain_model_in_one_process(cut):
    model, x, y = _case()
    plain = copy.deepcopy(model)
    program = _compile(model, x, cut)
    if cut == "complex":
        assert program.stages[1].recvs[0].value.dtype == torch.complex64
    assert "1j" in program.stages[0 if cut == "after the inverse" else 1].source
    torch.testing.assert_close(program(x), plain(x))
    loss, grads = _plain()
    assert program.step(x, target=y) == pytest.approx(loss, rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_an_fft_mixer_trains_as_the_plain_model_on_two_ranks(cut):
    ranks = spawn(2, __name__, "_rank_step", cut)
    loss, grads = _plain()
    assert set().union(*(g for _, g in ranks)) == set(grads)
    for rank_loss, rank_grads in ranks:
        assert rank_loss == pytest.approx(loss, rel=1e-6)
        for name, grad in rank_grads.items():
            torch.testing.assert_close(grad, grads[name], msg=name)


class Spectrum(nn.Module):
    """Returns a complex spectrum: the loss reads its magnitude."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(self.b(torch.tanh(self.a(x))), dim=-1)


def _magnitude(out: torch.Tensor) -> torch.Tensor:
    return out.abs().mean()


def _spectrum_step(rank: int, world: int) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model, x = Spectrum(), torch.randn(8, 6)
    program = fxpipe.compile(model, (x,), stages=2, chunks=4)
    loss = program.step(x, loss_fn=_magnitude)
    own = {id(p) for p in program.parameters()}
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()
                  if id(p) in own and p.grad is not None}


def test_a_complex_output_compiles_and_trains_as_the_plain_model():
    """The partition's estimate of the default loss reads the first floating output, as the
    default loss does: a complex one (which it used to take) is no prediction."""
    local = _spectrum_step(0, 1)
    torch.manual_seed(0)
    plain, x = Spectrum(), torch.randn(8, 6)
    expected = _magnitude(plain(x))
    expected.backward()
    for loss, grads in [local, *spawn(2, __name__, "_spectrum_step")]:
        assert loss == pytest.approx(expected.item(), rel=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, dict(plain.named_parameters())[name].grad)


def test_the_finite_check_names_the_first_complex_value_that_is_not():
    model, x, _ = _case()
    program = fxpipe.compile(model, (x,), stages=2, chunks=4, split_points=CUTS["complex"],
                             check_finite=True)
    program(x)
    with torch.no_grad():
        model.mix.phase[3] = float("nan")
    with pytest.raises(PipelineRuntimeError,
                       match="first appear in stage 1, micro-batch 0 at node mix_mul "):
        program(x)
