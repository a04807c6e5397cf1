"""A deep residual MLP: the simplest long chain of identical blocks to cut into pipeline stages."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm residual feed-forward block: x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class MLP(nn.Module):
    """Input projection, a stack of residual blocks, a final LayerNorm and a classifier head."""

    def __init__(self, in_features: int, width: int, depth: int, num_classes: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, width)
        self.blocks = nn.Sequential(*[Block(width, 4 * width) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(self.blocks(self.proj(x))))


def build(
    *,
    in_features: int = 32,
    width: int = 64,
    depth: int = 8,
    num_classes: int = 10,
    batch: int = 8,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Return (model, (x,)) with x of shape (batch, in_features)."""
    if batch < 2:
        raise ValueError(f"batch must be >= 2, got {batch}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, in_features, generator=g)
    torch.manual_seed(seed)
    model = MLP(in_features, width, depth, num_classes)
    return model.train(), (x,)


def target(
    example_inputs: tuple[torch.Tensor, ...], *, seed: int = 0, num_classes: int = 10,
    **_config: object,
) -> torch.Tensor:
    """Integer class labels of shape (batch,) for cross-entropy."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(num_classes, (example_inputs[0].shape[0],), generator=g)


# nn.Module.__call__ is annotated as returning Any, so each forward that returns a submodule's
# output would need a cast or an ignore; its lines are quoted, with their numbers, in generated
# stage code (and the golden files), so they stay plain Python and the check is off here.
# mypy: disable-error-code="no-any-return"
