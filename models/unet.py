"""A small U-Net: long skip connections (torch.cat) that span many layers and pipeline stages."""

from __future__ import annotations

import torch
from torch import nn


class ConvBlock(nn.Module):
    """(3x3 conv -> GroupNorm -> SiLU) twice."""

    def __init__(self, in_channels: int, out_channels: int, groups: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, padding=1),
            nn.GroupNorm(groups, out_channels),
            nn.SiLU(),
            nn.Conv2d(out_channels, out_channels, 3, padding=1),
            nn.GroupNorm(groups, out_channels),
            nn.SiLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Down(nn.Module):
    """Encoder level: a ConvBlock whose output is kept as the skip, then a stride-2 conv."""

    def __init__(self, in_channels: int, out_channels: int, groups: int) -> None:
        super().__init__()
        self.block = ConvBlock(in_channels, out_channels, groups)
        self.down = nn.Conv2d(out_channels, out_channels, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        skip = self.block(x)
        return self.down(skip), skip


class Up(nn.Module):
    """Decoder level: 2x transposed-conv upsample, concat with the encoder skip, ConvBlock."""

    def __init__(self, in_channels: int, out_channels: int, groups: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, out_channels, 2, stride=2)
        self.block = ConvBlock(2 * out_channels, out_channels, groups)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.block(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    """Three encoder levels, a bottleneck, three decoder levels and a 1x1 output conv."""

    def __init__(self, in_channels: int, out_channels: int, channels: int, groups: int) -> None:
        super().__init__()
        c1, c2, c3, c4 = channels, 2 * channels, 4 * channels, 8 * channels
        self.enc1 = Down(in_channels, c1, groups)
        self.enc2 = Down(c1, c2, groups)
        self.enc3 = Down(c2, c3, groups)
        self.bottleneck = ConvBlock(c3, c4, groups)
        self.dec3 = Up(c4, c3, groups)
        self.dec2 = Up(c3, c2, groups)
        self.dec1 = Up(c2, c1, groups)
        self.out = nn.Conv2d(c1, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, s1 = self.enc1(x)  # s1: full resolution
        x, s2 = self.enc2(x)  # s2: 1/2
        x, s3 = self.enc3(x)  # s3: 1/4
        x = self.bottleneck(x)  # 1/8
        x = self.dec3(x, s3)
        x = self.dec2(x, s2)
        x = self.dec1(x, s1)
        return self.out(x)


def build(
    *,
    in_channels: int = 3,
    out_channels: int = 3,
    channels: int = 8,
    groups: int = 4,
    image_size: int = 32,
    batch: int = 8,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Return (model, (images,)): images of shape (batch, in_channels, image_size, image_size)."""
    if batch < 2:
        raise ValueError(f"batch must be >= 2, got {batch}")
    if image_size % 8:
        raise ValueError(f"image_size must be divisible by 8, got {image_size}")
    if channels % groups:
        raise ValueError(f"channels ({channels}) must be divisible by groups ({groups})")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, in_channels, image_size, image_size, generator=g)
    torch.manual_seed(seed)
    model = UNet(in_channels, out_channels, channels, groups)
    return model.train(), (x,)


def target(
    example_inputs: tuple[torch.Tensor, ...], *, seed: int = 0, out_channels: int = 3,
    **_config: object,
) -> torch.Tensor:
    """A float image of the output's shape (batch, out_channels, H, W) for mean squared error."""
    (x,) = example_inputs
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(x.shape[0], out_channels, x.shape[2], x.shape[3], generator=g)


# nn.Module.__call__ is annotated as returning Any, so each forward that returns a submodule's
# output would need a cast or an ignore; its lines are quoted, with their numbers, in generated
# stage code (and the golden files), so they stay plain Python and the check is off here.
# mypy: disable-error-code="no-any-return"
