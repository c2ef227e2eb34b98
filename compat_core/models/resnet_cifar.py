"""CIFAR-style ResNets: 3x3 stride-1 stem, no max-pool, so 32x32 inputs keep spatial detail.

- ``resnet18_cifar`` / ``resnet50_cifar``: four stages (64, 128, 256, 512 channels x expansion), the layout most CIFAR
  continual-learning code uses; embeddings m = 512 and m = 2048.
- ``resnet32_cifar``: the three-stage ResNet of He et al. (2016, Sec. 4.2) for CIFAR: 6n+2 layers with n = 5,
  16/32/64 channels, parameter-free "option A" shortcuts (stride-2 subsampling plus zero-padded channels); m = 64.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compat_core.validation import check_int


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a projection shortcut when the shape changes (output channels = planes)."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4) bottleneck block (output channels = 4 * planes)."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != out_planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False), nn.BatchNorm2d(out_planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """Four-stage ResNet with a 3x3 stem; ``forward`` returns the global-average-pooled embedding ``(B, m)``."""

    def __init__(self, block: type, num_blocks: tuple[int, ...], in_chans: int = 3, base_width: int = 64) -> None:
        super().__init__()
        check_int("in_chans", in_chans, 1)
        check_int("base_width", base_width, 1)
        self.conv1 = nn.Conv2d(in_chans, base_width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(base_width)
        self._in_planes = base_width
        stages = []
        for index, blocks in enumerate(num_blocks):
            stages.append(self._make_stage(block, base_width * 2**index, blocks, stride=1 if index == 0 else 2))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.embed_dim = self._in_planes

    def _make_stage(self, block: type, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = []
        for block_stride in [stride] + [1] * (blocks - 1):
            layers.append(block(self._in_planes, planes, block_stride))
            self._in_planes = planes * block.expansion
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)


class _OptionAShortcut(nn.Module):
    """He et al.'s parameter-free CIFAR shortcut: subsample by ``stride`` and zero-pad the new channels."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.pad = planes - in_planes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        # Pad split evenly front/back over the channel axis, as in the original Torch implementation.
        return F.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))


class _ResNet32Block(BasicBlock):
    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__(in_planes, planes, stride)
        if stride != 1 or in_planes != planes:
            self.shortcut = _OptionAShortcut(in_planes, planes, stride)


class ResNet32Cifar(nn.Module):
    """6n+2-layer CIFAR ResNet (n = ``blocks_per_stage``; 5 gives ResNet-32), widths w, 2w, 4w; m = 4w."""

    def __init__(self, in_chans: int = 3, base_width: int = 16, blocks_per_stage: int = 5) -> None:
        super().__init__()
        check_int("in_chans", in_chans, 1)
        check_int("base_width", base_width, 1)
        check_int("blocks_per_stage", blocks_per_stage, 1)
        self.conv1 = nn.Conv2d(in_chans, base_width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(base_width)
        in_planes = base_width
        stages = []
        for index in range(3):
            planes = base_width * 2**index
            blocks = []
            for block_index in range(blocks_per_stage):
                stride = 2 if index > 0 and block_index == 0 else 1
                blocks.append(_ResNet32Block(in_planes, planes, stride))
                in_planes = planes
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.embed_dim = in_planes
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)


def resnet18_cifar(in_chans: int = 3, base_width: int = 64) -> CifarResNet:
    """ResNet-18 with a 3x3 stem; m = 8 * base_width (512 by default)."""
    return CifarResNet(BasicBlock, (2, 2, 2, 2), in_chans=in_chans, base_width=base_width)


def resnet50_cifar(in_chans: int = 3, base_width: int = 64) -> CifarResNet:
    """ResNet-50 (bottleneck) with a 3x3 stem; m = 32 * base_width (2048 by default)."""
    return CifarResNet(Bottleneck, (3, 4, 6, 3), in_chans=in_chans, base_width=base_width)


def resnet32_cifar(in_chans: int = 3, base_width: int = 16, blocks_per_stage: int = 5) -> ResNet32Cifar:
    """He et al.'s CIFAR ResNet-32 (16/32/64 channels, option-A shortcuts); m = 4 * base_width (64 by default)."""
    return ResNet32Cifar(in_chans=in_chans, base_width=base_width, blocks_per_stage=blocks_per_stage)
