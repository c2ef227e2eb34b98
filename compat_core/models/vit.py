"""Vision transformers through timm, always with random weights (``pretrained=False``; the hub is never touched).

The factory returns the timm model itself (classifier removed with ``num_classes=0``) so that parameter names are
exactly timm's: timm-layout checkpoints load without renaming, and Meta's DINOv2/DINOv3 layouts are remapped by
``compat_core.models.weights``. The embedding is the CLS token after the final norm (``global_pool="token"``),
as upstream DINOv2/DINOv3 use it; timm's own default for DINOv3 is the patch-token average.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from compat_core.validation import check_int

# registry name -> (timm model name, default image side in pixels)
TIMM_NAMES: dict[str, tuple[str, int]] = {
    "dinov3_vitb16": ("vit_base_patch16_dinov3", 224),
    "dinov3_vits16": ("vit_small_patch16_dinov3", 224),
    "dinov2_vitb14": ("vit_base_patch14_dinov2", 224),
}


def _create_timm_vit(
    name: str,
    in_chans: int,
    img_size: int | None,
    global_pool: str,
    depth: int | None,
    embed_dim: int | None,
    num_heads: int | None,
    drop_path_rate: float,
) -> nn.Module:
    import timm  # imported here so that `import compat_core.models` stays light for CNN-only users

    timm_name, default_size = TIMM_NAMES[name]
    for field, value in (("in_chans", in_chans), ("img_size", img_size), ("depth", depth),
                         ("embed_dim", embed_dim), ("num_heads", num_heads)):
        if value is not None:
            check_int(f"{name}: {field}", value, 1)
    if global_pool not in ("token", "avg"):
        raise ValueError(f"{name}: global_pool must be 'token' (CLS) or 'avg', got {global_pool!r}")
    overrides: dict[str, Any] = {}
    if depth is not None:
        overrides["depth"] = depth
    if embed_dim is not None:
        overrides["embed_dim"] = embed_dim
    if num_heads is not None:
        overrides["num_heads"] = num_heads
    if embed_dim is not None and num_heads is None:
        raise ValueError(f"{name}: a custom embed_dim={embed_dim} needs num_heads too (a divisor of it)")
    if embed_dim is not None and num_heads is not None and embed_dim % num_heads != 0:
        raise ValueError(f"{name}: num_heads={num_heads} must divide embed_dim={embed_dim}")
    model = timm.create_model(
        timm_name,
        pretrained=False,
        num_classes=0,
        in_chans=in_chans,
        img_size=img_size or default_size,
        global_pool=global_pool,
        # Lets one model take other image sizes than it was built for (RoPE for DINOv3, interpolated
        # absolute position embeddings for DINOv2).
        dynamic_img_size=True,
        drop_path_rate=drop_path_rate,
        **overrides,
    )
    model.embed_dim = int(model.num_features)
    return model


def dinov3_vitb16(in_chans: int = 3, img_size: int | None = None, global_pool: str = "token",
                  depth: int | None = None, embed_dim: int | None = None, num_heads: int | None = None,
                  drop_path_rate: float = 0.0) -> nn.Module:
    """DINOv3 ViT-B/16 architecture (timm ``vit_base_patch16_dinov3``); m = 768 unless ``embed_dim`` is given."""
    return _create_timm_vit("dinov3_vitb16", in_chans, img_size, global_pool, depth, embed_dim, num_heads,
                            drop_path_rate)


def dinov3_vits16(in_chans: int = 3, img_size: int | None = None, global_pool: str = "token",
                  depth: int | None = None, embed_dim: int | None = None, num_heads: int | None = None,
                  drop_path_rate: float = 0.0) -> nn.Module:
    """DINOv3 ViT-S/16 architecture (timm ``vit_small_patch16_dinov3``); m = 384 unless ``embed_dim`` is given."""
    return _create_timm_vit("dinov3_vits16", in_chans, img_size, global_pool, depth, embed_dim, num_heads,
                            drop_path_rate)


def dinov2_vitb14(in_chans: int = 3, img_size: int | None = None, global_pool: str = "token",
                  depth: int | None = None, embed_dim: int | None = None, num_heads: int | None = None,
                  drop_path_rate: float = 0.0) -> nn.Module:
    """DINOv2 ViT-B/14 architecture (timm ``vit_base_patch14_dinov2``); m = 768 unless ``embed_dim`` is given.

    ``img_size`` (default 224, Meta trained at 518) fixes the stored position-embedding grid; checkpoints with
    another grid are resampled by the weight loader.
    """
    return _create_timm_vit("dinov2_vitb14", in_chans, img_size, global_pool, depth, embed_dim, num_heads,
                            drop_path_rate)
