"""ImageNet-stem ResNet-18 from torchvision (7x7 stride-2 stem + max-pool), classifier removed.

The public IAM-CL2R reference uses exactly this network even on 32x32 inputs (the stem leaves a 1x1 map after
layer4); parameter names equal torchvision's (without ``fc``), so torchvision and reference checkpoints load as is.
"""
from __future__ import annotations

import torchvision
from torch import nn

from compat_core.validation import check_int


def resnet18(in_chans: int = 3) -> nn.Module:
    """torchvision ResNet-18 with random weights and ``fc`` replaced by identity; m = 512."""
    check_int("in_chans", in_chans, 1)
    model = torchvision.models.resnet18(weights=None)
    if in_chans != 3:
        model.conv1 = nn.Conv2d(in_chans, 64, kernel_size=7, stride=2, padding=3, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.embed_dim = model.fc.in_features
    model.fc = nn.Identity()
    return model
