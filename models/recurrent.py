"""An LSTM sequence tagger with a Python branch on a shape: export can capture it, fx cannot."""

from __future__ import annotations

import torch
from torch import nn


class Tagger(nn.Module):
    """Linear embedding, an LSTM over (seq, batch, features) (batch is dim 1), a per-step head."""

    def __init__(self, features: int, hidden: int, num_layers: int, num_classes: int) -> None:
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=num_layers, batch_first=False)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, c) = self.lstm(torch.tanh(self.embed(x)))  # out: (T, B, H); h, c: (layers, B, H)
        if x.shape[0] > 1:  # a Python branch on a shape: symbolic_trace cannot evaluate it
            # residual mix of each step with the previous one (the first step sees itself)
            out = out + 0.5 * torch.cat([out[:1], out[:-1]], dim=0)
        else:
            out = out + c[-1].unsqueeze(0)  # single step: add the final cell state
        return self.head(out)  # (T, B, num_classes)


def build(
    *,
    seq_len: int = 12,
    features: int = 16,
    hidden: int = 32,
    num_layers: int = 1,
    num_classes: int = 5,
    batch: int = 8,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Return (model, (x,)): x of shape (seq_len, batch, features); batch is dimension 1."""
    if batch < 2:
        raise ValueError(f"batch must be >= 2, got {batch}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(seq_len, batch, features, generator=g)
    torch.manual_seed(seed)
    model = Tagger(features, hidden, num_layers, num_classes)
    return model.train(), (x,)


def target(
    example_inputs: tuple[torch.Tensor, ...], *, seed: int = 0, num_classes: int = 5,
    **_config: object,
) -> torch.Tensor:
    """Integer tags of shape (seq_len, batch) for cross-entropy."""
    (x,) = example_inputs
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(num_classes, (x.shape[0], x.shape[1]), generator=g)


# nn.Module.__call__ is annotated as returning Any, so each forward that returns a submodule's
# output would need a cast or an ignore; its lines are quoted, with their numbers, in generated
# stage code (and the golden files), so they stay plain Python and the check is off here.
# mypy: disable-error-code="no-any-return"
