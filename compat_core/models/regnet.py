"""RegNetY-400MF backbones.

Two networks carry this name in the literature, with different embedding sizes:

- ``regnety_400mf`` (m = 384): the CIFAR-style RegNet that the IAM-CL2R reference trains as its second
  replacement model (3x3 stride-1 stem of 64 channels; stages of depth 1, 2, 7, 12 and width 32, 64, 160, 384;
  group width 16; bottleneck ratio 1; SE ratio 0.25 of the block input width). Its 384-dim output is the
  "feature size 384 before the junction" that the IAM-CL2R paper and its journal version report, so the scenario
  name maps here.
- ``regnety_400mf_tv`` (m = 440): torchvision's ``regnet_y_400mf`` (Radosavovic et al. 2020, ImageNet stem and
  widths 48, 104, 208, 440), for users who bring torchvision-layout weights.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from compat_core.validation import check_int


class SqueezeExcite(nn.Module):
    """Channel gate: global pool -> 1x1 conv (reduce) -> ReLU -> 1x1 conv (expand) -> sigmoid -> scale."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.se1 = nn.Conv2d(channels, squeezed, 1)
        self.se2 = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.se2(F.relu(self.se1(F.adaptive_avg_pool2d(x, 1)))))
        return x * gate


class RegNetBlock(nn.Module):
    """X/Y block: 1x1 conv, grouped 3x3 conv (stride), optional SE, 1x1 conv, residual add, ReLU."""

    def __init__(
        self, w_in: int, w_out: int, stride: int, group_width: int, bottleneck_ratio: float, se_ratio: float
    ) -> None:
        super().__init__()
        w_b = int(round(w_out * bottleneck_ratio))
        if w_b % group_width != 0:
            raise ValueError(f"bottleneck width {w_b} must be a multiple of group_width {group_width}")
        self.conv1 = nn.Conv2d(w_in, w_b, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(w_b)
        self.conv2 = nn.Conv2d(w_b, w_b, 3, stride=stride, padding=1, groups=w_b // group_width, bias=False)
        self.bn2 = nn.BatchNorm2d(w_b)
        # SE width follows the reference: a fraction of the block *input* width.
        self.se = SqueezeExcite(w_b, max(int(round(w_in * se_ratio)), 1)) if se_ratio > 0 else None
        self.conv3 = nn.Conv2d(w_b, w_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(w_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or w_in != w_out:
            self.shortcut = nn.Sequential(nn.Conv2d(w_in, w_out, 1, stride=stride, bias=False), nn.BatchNorm2d(w_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        if self.se is not None:
            out = self.se(out)
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class CifarRegNet(nn.Module):
    """Four-stage RegNet with a 3x3 stride-1 stem; returns the pooled output of the last stage ``(B, widths[-1])``."""

    def __init__(
        self,
        depths: Sequence[int],
        widths: Sequence[int],
        strides: Sequence[int] = (1, 1, 2, 2),
        group_width: int = 16,
        bottleneck_ratio: float = 1.0,
        se_ratio: float = 0.25,
        in_chans: int = 3,
        stem_width: int = 64,
    ) -> None:
        super().__init__()
        if not (len(depths) == len(widths) == len(strides) == 4):
            raise ValueError(
                f"depths, widths and strides must each list 4 stages, got {list(depths)}, {list(widths)}, "
                f"{list(strides)}"
            )
        for field, value in (("in_chans", in_chans), ("stem_width", stem_width), ("group_width", group_width)):
            check_int(field, value, 1)
        self.conv1 = nn.Conv2d(in_chans, stem_width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(stem_width)
        w_in = stem_width
        stages = []
        for depth, width, stride in zip(depths, widths, strides):
            blocks = []
            for index in range(depth):
                blocks.append(
                    RegNetBlock(w_in, width, stride if index == 0 else 1, group_width, bottleneck_ratio, se_ratio)
                )
                w_in = width
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.embed_dim = int(widths[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)


def regnety_400mf(
    in_chans: int = 3,
    depths: Sequence[int] = (1, 2, 7, 12),
    widths: Sequence[int] = (32, 64, 160, 384),
    group_width: int = 16,
    stem_width: int = 64,
) -> CifarRegNet:
    """IAM-CL2R's CIFAR-style RegNetY-400MF; m = widths[-1] (384 by default)."""
    return CifarRegNet(
        depths=tuple(depths), widths=tuple(widths), group_width=group_width, in_chans=in_chans, stem_width=stem_width
    )


def regnety_400mf_tv(in_chans: int = 3) -> nn.Module:
    """torchvision ``regnet_y_400mf`` with random weights and ``fc`` removed; m = 440."""
    check_int("in_chans", in_chans, 1)
    model = torchvision.models.regnet_y_400mf(weights=None)
    if in_chans != 3:
        old = model.stem[0]
        model.stem[0] = nn.Conv2d(in_chans, old.out_channels, 3, stride=2, padding=1, bias=False)
        nn.init.kaiming_normal_(model.stem[0].weight, mode="fan_out", nonlinearity="relu")
    model.embed_dim = model.fc.in_features
    model.fc = nn.Identity()
    return model
