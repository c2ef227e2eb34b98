"""SENet-18: a CIFAR-stem ResNet-18 whose blocks carry squeeze-and-excitation gates (Hu et al. 2018).

Follows the network the IAM-CL2R reference trains as its first replacement model: pre-activation basic blocks
(BN-ReLU before each convolution), an SE gate with reduction 16 implemented with 1x1 convolutions, and no extra
normalisation after the last stage. The global pooling is adaptive (the reference's fixed 4x4 pool only fits 32x32
inputs), which gives the same value at 32x32. m = 8 * base_width (512 by default).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compat_core.validation import check_int

SE_REDUCTION = 16


class PreActSEBlock(nn.Module):
    """Pre-activation basic block with a squeeze-and-excitation gate on the residual branch."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False))
        squeezed = max(planes // SE_REDUCTION, 1)
        self.fc1 = nn.Conv2d(planes, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, planes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(x))
        # The projection shortcut sees the pre-activated input, the identity shortcut the raw one (pre-act ResNet).
        shortcut = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        gate = torch.sigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(out, 1)))))
        return out * gate + shortcut


class SENet18(nn.Module):
    """Four stages of two SE blocks (w, 2w, 4w, 8w channels) after a 3x3 stem; returns ``(B, 8w)``."""

    def __init__(self, in_chans: int = 3, base_width: int = 64) -> None:
        super().__init__()
        for field, value in (("in_chans", in_chans), ("base_width", base_width)):
            check_int(field, value, 1)
        self.conv1 = nn.Conv2d(in_chans, base_width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(base_width)
        in_planes = base_width
        stages = []
        for index in range(4):
            planes = base_width * 2**index
            first_stride = 1 if index == 0 else 2
            blocks = [PreActSEBlock(in_planes, planes, first_stride), PreActSEBlock(planes, planes, 1)]
            in_planes = planes
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.embed_dim = in_planes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)


def senet18(in_chans: int = 3, base_width: int = 64) -> SENet18:
    """SENet-18 (CIFAR stem, pre-activation SE blocks); m = 8 * base_width (512 by default)."""
    return SENet18(in_chans=in_chans, base_width=base_width)
