"""One registry of backbones, keyed by name: a torch-free :class:`BackboneCard` per backbone.

A card names its factory by dotted path (imported, with torch and timm, only when a backbone is built), says how wide
its embedding is for a given set of options (``embed_dim``, so configs and plans know m without building anything),
and holds the smallest options that still exercise every layer type (``small_test_config``: CPU tests, smoke runs).

A factory takes keyword options only (``in_chans``, ``img_size`` where the architecture needs it, width/depth knobs)
and returns an ``nn.Module`` whose ``forward(x)`` maps images ``(B, C, H, W)`` to embeddings ``(B, m)`` and whose
attribute ``embed_dim`` is ``m``. Weights are always random: nothing is downloaded.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from compat_core.registry import Registry

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class BackboneCard:
    """A registered backbone. factory: ``"module:function"``; embed_dim: options -> m (the width ``factory(**options)``
    reports, a test checks both agree); small_config: options for CPU tests (empty: the defaults are small);
    convolutional: whether its layers include 2-D convolutions besides a ViT's patch embedding (what
    ``training.channels_last`` can change; a test checks it against the built model)."""

    name: str
    factory: str
    embed_dim: Callable[[Mapping[str, Any]], int]
    small_config: Mapping[str, Any] = field(default_factory=dict)
    convolutional: bool = True

    def build(self, **config: Any) -> "nn.Module":
        """The factory called with ``config`` (imports the factory's module, and so torch)."""
        module, _, attribute = self.factory.partition(":")
        return getattr(importlib.import_module(module), attribute)(**config)


def _option(name: str, default: int) -> Callable[[Mapping[str, Any]], int]:
    return lambda options: options.get(name) or default


BACKBONES: Registry = Registry("backbone")
# Convolutional nets keep their real widths in small_config (so ``embed_dim`` matches the papers) because they are
# already fast at 32x32; ViTs shrink to depth 2, width 64 (a ViT-B forward on CPU would dominate the test budget).
for _card in (
    BackboneCard("resnet18_cifar", "compat_core.models.resnet_cifar:resnet18_cifar",
                 lambda o: 8 * o.get("base_width", 64), {"base_width": 16}),
    BackboneCard("resnet50_cifar", "compat_core.models.resnet_cifar:resnet50_cifar",
                 lambda o: 32 * o.get("base_width", 64), {"base_width": 8}),
    BackboneCard("resnet32_cifar", "compat_core.models.resnet_cifar:resnet32_cifar",
                 lambda o: 4 * o.get("base_width", 16)),
    BackboneCard("resnet18", "compat_core.models.resnet:resnet18", lambda o: 512),
    BackboneCard("senet18", "compat_core.models.senet:senet18", lambda o: 8 * o.get("base_width", 64),
                 {"base_width": 16}),
    BackboneCard("regnety_400mf", "compat_core.models.regnet:regnety_400mf",
                 lambda o: int(tuple(o.get("widths", (32, 64, 160, 384)))[-1]),
                 {"widths": (8, 16, 32, 48), "depths": (1, 1, 2, 1), "stem_width": 16, "group_width": 8}),
    BackboneCard("regnety_400mf_tv", "compat_core.models.regnet:regnety_400mf_tv", lambda o: 440),
    BackboneCard("lenetpp", "compat_core.models.lenetpp:lenetpp", lambda o: o.get("embed_dim", 2), {"img_size": 32}),
    BackboneCard("cnn4", "compat_core.models.lenetpp:cnn4", lambda o: 8 * o.get("width", 32), {"width": 8}),
    BackboneCard("dinov3_vitb16", "compat_core.models.vit:dinov3_vitb16", _option("embed_dim", 768),
                 {"img_size": 32, "depth": 2, "embed_dim": 64, "num_heads": 2}, convolutional=False),
    BackboneCard("dinov3_vits16", "compat_core.models.vit:dinov3_vits16", _option("embed_dim", 384),
                 {"img_size": 32, "depth": 2, "embed_dim": 64, "num_heads": 2}, convolutional=False),
    BackboneCard("dinov2_vitb14", "compat_core.models.vit:dinov2_vitb14", _option("embed_dim", 768),
                 {"img_size": 28, "depth": 2, "embed_dim": 64, "num_heads": 2}, convolutional=False),
):
    BACKBONES.register(_card.name, _card)


def create_backbone(name: str, **config: Any) -> "nn.Module":
    """Build the backbone registered as ``name`` with random weights; the result maps ``(B, C, H, W) -> (B, m)``.

    Raises ``KeyError`` listing the valid names for an unknown ``name`` and ``TypeError`` naming the backbone when an
    option is not accepted by its factory.
    """
    card = BACKBONES.get(name)
    try:
        backbone = card.build(**config)
    except TypeError as error:
        raise TypeError(f"backbone {name!r} rejected its options {sorted(config)}: {error}") from error
    embed_dim = getattr(backbone, "embed_dim", None)
    if not isinstance(embed_dim, int) or embed_dim <= 0:
        raise ValueError(f"backbone {name!r} must expose a positive int attribute embed_dim, got {embed_dim!r}")
    return backbone


def embedding_width(name: str, config: Mapping[str, Any] | None = None) -> int:
    """m of backbone ``name`` built with ``config``, from its card (nothing is built; KeyError for an unknown name)."""
    return int(BACKBONES.get(name).embed_dim(dict(config or {})))


def small_test_config(name: str) -> dict[str, Any]:
    """Options that make backbone ``name`` small enough for a CPU unit test (a fresh dict; empty: defaults are fine)."""
    return dict(BACKBONES.get(name).small_config)


__all__ = ["BACKBONES", "BackboneCard", "create_backbone", "embedding_width", "small_test_config"]
