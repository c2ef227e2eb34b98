"""Small convolutional nets: LeNet++ (the papers' toy model) and a 4-layer CNN for the offline demo.

- ``lenetpp``: LeNet++ of Wen et al. (ECCV 2016, centre loss), used by CoReS Fig. 2 and IAM-CL2R Fig. 3: three
  stages of two 5x5 convolutions (32, 64, 128 channels, padding 2, PReLU) each followed by 2x2 max-pooling, then a
  fully connected layer to an ``embed_dim``-dimensional embedding (2 in the papers, for plotting).
- ``cnn4``: four 3x3 conv-BN-ReLU-maxpool blocks of width w, 2w, 4w, 8w, global average pooling; m = 8w
  (256 with the default w = 32), the "4-layer CNN, m=256" of the demo prototypes.
"""
from __future__ import annotations

import torch
from torch import nn

from compat_core.validation import check_int


class LeNetPlusPlus(nn.Module):
    """LeNet++ for ``img_size`` x ``img_size`` inputs; returns ``(B, embed_dim)`` (no activation after the FC)."""

    def __init__(self, in_chans: int = 1, img_size: int = 28, embed_dim: int = 2) -> None:
        super().__init__()
        check_int("in_chans", in_chans, 1)
        check_int("embed_dim", embed_dim, 1)
        if check_int("img_size", img_size, 1) < 8:
            raise ValueError(f"img_size must be >= 8 (three 2x2 poolings), got {img_size}")
        layers: list[nn.Module] = []
        channels = in_chans
        for width in (32, 64, 128):
            layers += [nn.Conv2d(channels, width, 5, padding=2), nn.PReLU(width)]
            layers += [nn.Conv2d(width, width, 5, padding=2), nn.PReLU(width), nn.MaxPool2d(2)]
            channels = width
        self.features = nn.Sequential(*layers)
        side = img_size // 8
        self.fc = nn.Linear(128 * side * side, embed_dim)
        self.embed_dim = embed_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


class CNN4(nn.Module):
    """Four conv-BN-ReLU-maxpool blocks and global average pooling; returns ``(B, 8 * width)``."""

    def __init__(self, in_chans: int = 3, width: int = 32) -> None:
        super().__init__()
        check_int("in_chans", in_chans, 1)
        check_int("width", width, 1)
        blocks: list[nn.Module] = []
        channels = in_chans
        for multiplier in (1, 2, 4, 8):
            out = width * multiplier
            blocks += [nn.Conv2d(channels, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            blocks.append(nn.MaxPool2d(2))
            channels = out
        self.features = nn.Sequential(*blocks)
        self.embed_dim = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Global pooling makes m independent of the input size (any side >= 16 survives the four 2x2 poolings).
        return torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1)


def lenetpp(in_chans: int = 1, img_size: int = 28, embed_dim: int = 2) -> LeNetPlusPlus:
    """LeNet++ (Wen et al. 2016); defaults: grayscale 28x28 (MNIST), m = 2 as in the papers' toy figures."""
    return LeNetPlusPlus(in_chans=in_chans, img_size=img_size, embed_dim=embed_dim)


def cnn4(in_chans: int = 3, width: int = 32) -> CNN4:
    """Fast 4-layer CNN for the offline demo; m = 8 * width (256 by default)."""
    return CNN4(in_chans=in_chans, width=width)
