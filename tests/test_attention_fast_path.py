"""nn.TransformerEncoder with a padding mask, in eval mode without gradients, takes torch's fast
path, which returns zeros at the padded positions where the layers (and the plain model with
gradients) compute values. The capture's runs take the path its graph takes, so such a model
compiles in eval mode and validates between training steps; a program returns what the layers
compute everywhere, the plain model's numbers at every position that is not padded. (And
nn.MultiheadAttention with a padding mask compiles without torch's fallback traceback.)"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)  # enable_nested_tensor by default
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x), src_key_padding_mask=padded))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 6, 8)
    padded = torch.zeros(4, 6, dtype=torch.bool)
    padded[1, 4:] = True
    padded[3, 2:] = True
    return x, padded


@pytest.mark.parametrize("compiled_in", ["train", "eval"])
def test_an_encoder_with_a_padding_mask_trains_and_validates_as_the_plain_model(compiled_in):
    torch.manual_seed(0)
    model, plain = _Encoder(), _Encoder()
    plain.load_state_dict(model.state_dict())
    x, padded = _batch()
    model.train(compiled_in == "train")
    program = fxpipe.compile(model, (x, padded), stages=2, chunks=2)
    program.train()
    y = torch.randn(4, 6, 4)
    loss = program.step(x, padded, target=y, loss_fn="mse")
    expected = nn.functional.mse_loss(plain(x, padded), y)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)

    program.eval()
    plain.eval()
    with torch.no_grad():
        got, fast = program(x, padded), plain(x, padded)
    kept = ~padded
    torch.testing.assert_close(got[kept], fast[kept], rtol=1e-4, atol=1e-5)
    zeros = plain.head.bias.detach().expand_as(fast[padded])  # the head of the fast path's 0s
    torch.testing.assert_close(fast[padded], zeros)  # which no graph computes
    torch.testing.assert_close(got, plain(x, padded), rtol=1e-4, atol=1e-5)  # with gradients
    assert torch.backends.mha.get_fastpath_enabled()  # compiling put the switch back


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.attention(h, h, h, key_padding_mask=padded)[0] + h)


def test_attention_with_a_padding_mask_compiles_without_torchs_fallback_traceback(caplog):
    # its baddbmm has no meta kernel for a symbolic batch: torch logs a traceback at ERROR
    # level, then runs it another way; the compile keeps that log quiet
    torch.manual_seed(0)
    model = _Attention().eval()
    x, padded = _batch()
    program = fxpipe.compile(model, (x, padded), stages=2, chunks=2)
    torch.testing.assert_close(program(x, padded), model(x, padded))
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
