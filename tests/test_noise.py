"""A model that draws noise over the batch in eval mode too (a VAE's reparameterization, a
diffusion model's noise and timesteps) has no dimension whose halves reproduce the whole batch's
numbers, though no example reads another. The batch-dimension search then runs it with every
draw as zeros (fxpipe.frontend.zero_noise): such a model compiles and trains as the plain model
run over the same micro-batches, with the same draws; one whose random draw mixes examples is
still refused."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import CaptureError
from fxpipe.testing.reference_step import reference_forward, reference_step


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 8))
        self.decode = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 12))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.encode(x).chunk(2, dim=-1)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)  # in eval mode too
        return self.decode(z), mu, logvar


class NoisedSteps(nn.Module):  # a diffusion step: random timesteps and noise per example
    def __init__(self) -> None:
        super().__init__()
        self.steps = nn.Embedding(10, 12)
        self.net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                 nn.Linear(16, 12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.randint(0, 10, (x.shape[0],))
        return self.net(x + torch.randn_like(x) + self.steps(t))


class RandomPartner(nn.Module):  # mixes each example with a random other one of the batch
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x + x[torch.randperm(x.shape[0])])


def _first(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _vae_loss(out: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
    recon, mu, logvar = out
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1).mean()
    return nn.functional.mse_loss(recon, x) + kl


@pytest.mark.parametrize("make, loss_fn", [(VAE, _vae_loss), (NoisedSteps, "mse")])
@pytest.mark.parametrize("capture", ["auto", "export"])
def test_a_model_drawing_noise_over_the_batch_trains_as_the_plain_model(make, loss_fn, capture):
    torch.manual_seed(0)
    model, plain = make(), make()
    plain.load_state_dict(model.state_dict())
    x = torch.randn(8, 12)
    torch.manual_seed(5)
    program = fxpipe.compile(model, (x,), stages=2, chunks=4, capture=capture)
    after_compile = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_compile, torch.rand(3))  # compiling left the caller's stream as is
    torch.manual_seed(3)
    loss = program.step(x, target=x, loss_fn=loss_fn)
    torch.manual_seed(3)
    expected = reference_step(program, plain, x, target=x, loss_fn=loss_fn)
    assert loss == pytest.approx(expected, rel=1e-5)
    theirs = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, msg=name)
    program.eval()  # noise in eval mode too: other draws each call, the reference's alike
    plain.eval()
    torch.manual_seed(4)  # the first call in eval mode captures again, drawing nothing of ours
    first = program(x)
    torch.manual_seed(4)
    torch.testing.assert_close(first, reference_forward(program, plain, x))
    assert not torch.equal(_first(first), _first(program(x)))


def test_a_random_draw_that_mixes_examples_is_still_refused():
    with pytest.raises(CaptureError, match="found no batch dimension along which RandomPartner "
                                           "is separable"):
        fxpipe.compile(RandomPartner(), (torch.randn(8, 12),), stages=2, chunks=2)


class _OwnGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(12, 12)
        self.noise = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x + torch.randn(x.shape, generator=self.noise))


@pytest.mark.parametrize("capture", ["auto", "fx", "export"])
def test_a_model_drawing_from_a_generator_of_its_own_is_refused_naming_it(capture):
    with pytest.raises(CaptureError) as error:
        fxpipe.compile(_OwnGenerator(), (torch.randn(8, 12),), stages=2, chunks=2,
                       capture=capture)
    assert "holds a torch.Generator of its own (noise)" in error.value.hint
