"""The conv net users bring (fxpipe.testing.user_models.SkipNet), small: BatchNorm and a long
skip over four blocks, where a high stage count used to give stages with nothing to do.

    model, inputs = build()   # also a factory for `fxpipe compile tests.skip_cnn:build`
"""
from __future__ import annotations

import torch
from torch import nn

from fxpipe.testing.user_models import SkipNet

__all__ = ["build", "target"]

CLASSES = 3


def build(batch: int = 4) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return SkipNet(channels=4, classes=CLASSES), (torch.randn(batch, 3, 8, 8),)


def target(inputs: tuple[torch.Tensor], **_settings: object) -> torch.Tensor:
    """Class labels for the written program's batch."""
    return torch.arange(inputs[0].shape[0]) % CLASSES
