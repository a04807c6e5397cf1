"""A small CIFAR-style ResNet: convolutions, BatchNorm running stats, downsampling shortcuts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or 1x1 conv-BN when downsampling) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Conv stem, three groups of BasicBlocks (16/32/64 channels), global pooling, linear head."""

    def __init__(self, blocks_per_group: int, width: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers, in_ch = [], width
        for i, out_ch in enumerate([width, 2 * width, 4 * width]):
            for j in range(blocks_per_group):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(BasicBlock(in_ch, out_ch, stride))
                in_ch = out_ch
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.layers(self.stem(x)))
        return self.fc(torch.flatten(x, 1))


def build(
    *,
    blocks_per_group: int = 1,
    width: int = 16,
    num_classes: int = 10,
    image_size: int = 16,
    batch: int = 8,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Return (model, (images,)) with images of shape (batch, 3, image_size, image_size)."""
    if batch < 2:
        raise ValueError(f"batch must be >= 2, got {batch}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, image_size, image_size, generator=g)
    torch.manual_seed(seed)
    model = ResNet(blocks_per_group, width, num_classes)
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
