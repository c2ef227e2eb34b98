"""One registry of backbone factories, keyed by name.

A factory takes keyword options only (``in_chans``, ``img_size`` where the architecture needs it, width/depth knobs)
and returns an ``nn.Module`` whose ``forward(x)`` maps images ``(B, C, H, W)`` to embeddings ``(B, m)`` and whose
attribute ``embed_dim`` is ``m``. Weights are always random: nothing is downloaded.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from compat_core.registry import Registry

BACKBONES: Registry = Registry("backbone")

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
    _ensure_registered()
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
    _ensure_registered()
    BACKBONES.get(name)  # KeyError with valid names for a typo
    return dict(_SMALL_TEST_CONFIGS.get(name, {}))


def _ensure_registered() -> None:
    """Import the modules whose decorators fill BACKBONES (cheap after the first call)."""
    from compat_core.models import lenetpp, regnet, resnet, resnet_cifar, senet, vit  # noqa: F401
