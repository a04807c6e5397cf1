"""Two models of the kinds users bring, beside the bundled ones: a small ViT (a class token, a
boolean attention-mask keyword, dropout, a dict output) and a conv net (BatchNorm, a long skip
over four blocks). fxpipe.tools.step_check predicts and measures their steps too."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["USER_MODELS", "SkipNet", "load_user_model"]


class _Vit(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4, patches: int = 16, classes: int = 10
                 ) -> None:
        super().__init__()
        self.patch = nn.Linear(48, width)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.zeros(1, patches + 1, width))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.1,
                                                               batch_first=True)
                                    for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, *, attention_mask: torch.Tensor) -> dict[str, Any]:
        h = self.patch(x)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1) + self.pos
        pad = torch.cat([torch.zeros_like(attention_mask[:, :1]), ~attention_mask], dim=1)
        for block in self.blocks:
            h = block(h, src_key_padding_mask=pad)
        return {"logits": self.head(h[:, 0]), "tokens": h}


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(self.norm(self.conv(x)))
        return out


class SkipNet(nn.Module):
    """The conv net: BatchNorm counters (num_batches_tracked.add_(1)) and parameterless
    operations (the skip's addition, the pooling) are where a high stage count once gave
    stages with nothing to do."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.stem_bn = nn.BatchNorm2d(channels)
        self.blocks = nn.Sequential(*[_Block(channels) for _ in range(4)])
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem_bn(self.stem(x)))
        h = self.blocks(h) + h  # the long skip over four blocks
        out: torch.Tensor = self.fc(h.mean(dim=(2, 3)))
        return out


def load_user_model(name: str, batch: int = 8
                    ) -> tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """(model, example inputs, example keyword inputs) of `name` (one of USER_MODELS), in
    training mode, seeded."""
    torch.manual_seed(0)
    if name == "vit":
        mask = torch.ones(batch, 16, dtype=torch.bool)
        mask[0, -3:] = False  # one example's last patches are padding
        return _Vit().train(), (torch.randn(batch, 16, 48),), {"attention_mask": mask}
    if name == "skipnet":
        return SkipNet().train(), (torch.randn(batch, 3, 16, 16),), {}
    raise ValueError(f"unknown user model {name!r}; one of {USER_MODELS}")


USER_MODELS = ("vit", "skipnet")
