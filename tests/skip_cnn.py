"""A small conv net with BatchNorm and a long skip over four blocks, as users write them: its
BatchNorm counters (num_batches_tracked.add_(1)) and its parameterless operations (the skip's
addition, the pooling) are where a high stage count used to give stages with nothing to do.

    model, inputs = build()   # also a factory for `fxpipe compile tests.skip_cnn:build`
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["SkipCNN", "build", "target"]


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class SkipCNN(nn.Module):
    def __init__(self, channels: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.stem_bn = nn.BatchNorm2d(channels)
        self.blocks = nn.Sequential(*[Block(channels) for _ in range(4)])
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.relu(self.stem_bn(self.stem(x)))
        h = self.blocks(skip) + skip
        return self.fc(h.mean(dim=(2, 3)))


def build(batch: int = 4) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return SkipCNN(), (torch.randn(batch, 3, 8, 8),)


def target(inputs: tuple[torch.Tensor], **_settings: object) -> torch.Tensor:
    """Class labels for the written program's batch."""
    return torch.arange(inputs[0].shape[0]) % 3
