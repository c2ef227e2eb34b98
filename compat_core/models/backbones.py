"""One registry of backbone factories, keyed by name, filled here from the backbone modules.

A factory takes keyword options only (``in_chans``, ``img_size`` where the architecture needs it, width/depth knobs)
and returns an ``nn.Module`` whose ``forward(x)`` maps images ``(B, C, H, W)`` to embeddings ``(B, m)`` and whose
attribute ``embed_dim`` is ``m``. Weights are always random: nothing is downloaded.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from compat_core.models.lenetpp import cnn4, lenetpp
from compat_core.models.regnet import regnety_400mf, regnety_400mf_tv
from compat_core.models.resnet import resnet18
from compat_core.models.resnet_cifar import resnet18_cifar, resnet32_cifar, resnet50_cifar
from compat_core.models.senet import senet18
from compat_core.models.vit import dinov2_vitb14, dinov3_vitb16, dinov3_vits16
from compat_core.registry import Registry

BACKBONES: Registry = Registry("backbone")
for _name, _factory in (
    ("resnet18_cifar", resnet18_cifar),
    ("resnet50_cifar", resnet50_cifar),
    ("resnet32_cifar", resnet32_cifar),
    ("resnet18", resnet18),
    ("senet18", senet18),
    ("regnety_400mf", regnety_400mf),
    ("regnety_400mf_tv", regnety_400mf_tv),
    ("lenetpp", lenetpp),
    ("cnn4", cnn4),
    ("dinov3_vitb16", dinov3_vitb16),
    ("dinov3_vits16", dinov3_vits16),
    ("dinov2_vitb14", dinov2_vitb14),
):
    BACKBONES.register(_name, _factory)

# Smallest settings that still exercise every layer type of each backbone; used by CPU tests and smoke runs.
# Convolutional nets keep their real widths (so ``embed_dim`` matches the papers) because they are already fast at
# 32x32; ViTs shrink to depth 2, width 64 (a ViT-B forward on CPU would dominate the test budget).
_SMALL_TEST_CONFIGS: dict[str, dict[str, Any]] = {
    "resnet18_cifar": {"base_width": 16},
    "resnet32_cifar": {},
    "resnet50_cifar": {"base_width": 8},
    "resnet18": {},
    "senet18": {"base_width": 16},
    "regnety_400mf": {"widths": (8, 16, 32, 48), "depths": (1, 1, 2, 1), "stem_width": 16, "group_width": 8},
    "regnety_400mf_tv": {},
    "lenetpp": {"img_size": 32},
    "cnn4": {"width": 8},
    "dinov3_vitb16": {"img_size": 32, "depth": 2, "embed_dim": 64, "num_heads": 2},
    "dinov3_vits16": {"img_size": 32, "depth": 2, "embed_dim": 64, "num_heads": 2},
    "dinov2_vitb14": {"img_size": 28, "depth": 2, "embed_dim": 64, "num_heads": 2},
}


def create_backbone(name: str, **config: Any) -> nn.Module:
    """Build the backbone registered as ``name`` with random weights; the result maps ``(B, C, H, W) -> (B, m)``.

    Raises ``KeyError`` listing the valid names for an unknown ``name`` and ``TypeError`` naming the backbone when an
    option is not accepted by its factory.
    """
    factory = BACKBONES.get(name)
    try:
        backbone = factory(**config)
    except TypeError as error:
        raise TypeError(f"backbone {name!r} rejected its options {sorted(config)}: {error}") from error
    embed_dim = getattr(backbone, "embed_dim", None)
    if not isinstance(embed_dim, int) or embed_dim <= 0:
        raise ValueError(f"backbone {name!r} must expose a positive int attribute embed_dim, got {embed_dim!r}")
    return backbone


def small_test_config(name: str) -> dict[str, Any]:
    """Options that make backbone ``name`` small enough for a CPU unit test (a fresh dict; empty: defaults are fine)."""
    BACKBONES.get(name)  # KeyError with valid names for a typo
    return dict(_SMALL_TEST_CONFIGS.get(name, {}))

