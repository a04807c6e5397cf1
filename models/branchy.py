"""An inception-like net: two inputs, an optional keyword input, parallel branches, dict outputs."""

from __future__ import annotations

import torch
from torch import nn


def _stack(in_features: int, width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(in_features if i == 0 else width, width), nn.ReLU()]
    return nn.Sequential(*layers)


class Branchy(nn.Module):
    """Parallel x-branches (depth 1, 2, 3) concatenated, added to a y-branch, optionally gated."""

    def __init__(
        self, x_features: int, y_features: int, width: int, num_classes: int, aux_classes: int
    ) -> None:
        super().__init__()
        self.branch1 = _stack(x_features, width, 1)
        self.branch2 = _stack(x_features, width, 2)
        self.branch3 = _stack(x_features, width, 3)
        self.y_branch = _stack(y_features, 3 * width, 1)
        self.trunk = _stack(3 * width, width, 1)
        self.head = nn.Linear(width, num_classes)
        self.aux_head = nn.Linear(width + 3 * width, aux_classes)

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, *, gate: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        xs = torch.cat([self.branch1(x), self.branch2(x), self.branch3(x)], dim=1)  # concat merge
        ys = self.y_branch(y)
        merged = xs + ys  # add merge
        if gate is not None:
            merged = merged * torch.sigmoid(gate)
        h = self.trunk(merged)
        return {
            "logits": self.head(h),
            "aux": self.aux_head(torch.cat([h, ys], dim=1)),  # ys skips the trunk
        }


def build(
    *,
    x_features: int = 24,
    y_features: int = 8,
    width: int = 32,
    num_classes: int = 10,
    aux_classes: int = 4,
    batch: int = 8,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Return (model, (x, y)): x (batch, x_features), y (batch, y_features); see example_kwargs."""
    if batch < 2:
        raise ValueError(f"batch must be >= 2, got {batch}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, x_features, generator=g)
    y = torch.randn(batch, y_features, generator=g)
    torch.manual_seed(seed)
    model = Branchy(x_features, y_features, width, num_classes, aux_classes)
    return model.train(), (x, y)


def example_kwargs(example_inputs: tuple[torch.Tensor, ...], *, seed: int = 0,
                   **_config: object) -> dict[str, torch.Tensor]:
    """Keyword inputs for forward: {"gate": (batch, 1)}."""
    g = torch.Generator().manual_seed(seed + 2)
    return {"gate": torch.randn(example_inputs[0].shape[0], 1, generator=g)}


def target(
    example_inputs: tuple[torch.Tensor, ...], *, seed: int = 0, num_classes: int = 10,
    **_config: object,
) -> torch.Tensor:
    """Integer class labels of shape (batch,) for cross-entropy on the "logits" output."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(num_classes, (example_inputs[0].shape[0],), generator=g)
