"""Meta's published DINOv3 ViT-B/16 checkpoint layout loads whole into the product's ``dinov3_vitb16`` backbone.

The layout below is written from the structure of Meta's ``DinoVisionTransformer`` as ``dinov3_vitb16`` builds it
(embed 768, 12 blocks of 12 heads, MLP ratio 4, 4 storage tokens, qkv with a bias and Meta's key-bias mask,
layer scale, LayerNorm, RoPE periods base 100, patch 16), not derived from timm's names: every key name and shape
of the official state dict. The product's loader must fill 100 % of the backbone's parameters from it, tensor for
tensor, and the loaded backbone must give the same features as timm's own model loaded through timm's DINOv3
checkpoint conversion.
"""
from __future__ import annotations

import hashlib

import pytest
import timm
import torch
from timm.models.eva import checkpoint_filter_fn

from compat_core.models.backbones import create_backbone

from compat_core.models.compat_model import create_model

from compat_core.models.weights import load_external_weights

EMBED, HEADS, MLP_HIDDEN, STORAGE_TOKENS, PATCH, ROPE_BASE = 768, 12, 3072, 4, 16, 100.0
HEAD_DIM = EMBED // HEADS


def meta_dinov3_vitb16_shapes(depth: int = 12) -> dict[str, tuple[int, ...]]:
    """Key name -> shape of Meta's ``dinov3_vitb16`` state dict (``depth`` blocks; the release has 12)."""
    shapes: dict[str, tuple[int, ...]] = {
        "cls_token": (1, 1, EMBED),
        "storage_tokens": (1, STORAGE_TOKENS, EMBED),
        "mask_token": (1, EMBED),
        "patch_embed.proj.weight": (EMBED, 3, PATCH, PATCH),
        "patch_embed.proj.bias": (EMBED,),
        "rope_embed.periods": (HEAD_DIM // 4,),
    }
    for index in range(depth):
        block = f"blocks.{index}."
        shapes.update({
            block + "norm1.weight": (EMBED,), block + "norm1.bias": (EMBED,),
            block + "attn.qkv.weight": (3 * EMBED, EMBED), block + "attn.qkv.bias": (3 * EMBED,),
            block + "attn.qkv.bias_mask": (3 * EMBED,),
            block + "attn.proj.weight": (EMBED, EMBED), block + "attn.proj.bias": (EMBED,),
            block + "ls1.gamma": (EMBED,),
            block + "norm2.weight": (EMBED,), block + "norm2.bias": (EMBED,),
            block + "mlp.fc1.weight": (MLP_HIDDEN, EMBED), block + "mlp.fc1.bias": (MLP_HIDDEN,),
            block + "mlp.fc2.weight": (EMBED, MLP_HIDDEN), block + "mlp.fc2.bias": (EMBED,),
            block + "ls2.gamma": (EMBED,),
        })
    shapes.update({"norm.weight": (EMBED,), "norm.bias": (EMBED,)})
    return shapes


def meta_dinov3_vitb16_state(depth: int, seed: int) -> dict[str, torch.Tensor]:
    """A state dict in Meta's layout with values a trained checkpoint could hold: random weights, layer scales and
    norms away from their initial values (a failed load would show), RoPE periods from Meta's formula
    ``base ** (2 i / (D_head / 2))``, the key-bias mask (1 for q and v, 0 for k) and an all-zero qkv bias, as in the
    published distilled ViT-B (timm's ``vit_base_patch16_dinov3`` has no qkv bias for that reason)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in meta_dinov3_vitb16_shapes(depth).items():
        if name == "rope_embed.periods":
            value = ROPE_BASE ** (2 * torch.arange(HEAD_DIM // 4, dtype=torch.float32) / (HEAD_DIM // 2))
        elif name.endswith("qkv.bias_mask"):
            value = torch.ones(shape)
            value[EMBED:2 * EMBED] = 0.0
        elif name.endswith("qkv.bias"):
            value = torch.zeros(shape)
        elif name.endswith("gamma"):
            value = 0.05 + 0.25 * torch.rand(shape, generator=generator)
        elif name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
            value = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            value = 0.02 * torch.randn(shape, generator=generator)
        state[name] = value
    return state


def to_meta_name(timm_name: str) -> str:
    """The Meta key a timm Eva parameter comes from (the inverse of the documented remap)."""
    return (timm_name.replace("reg_token", "storage_tokens").replace(".gamma_1", ".ls1.gamma")
            .replace(".gamma_2", ".ls2.gamma"))


def test_the_layout_is_the_full_release():
    shapes = meta_dinov3_vitb16_shapes()
    # 8 top-level entries + 15 per block. Values: the backbone's 85,641,216 parameters (patch embedding 590,592,
    # cls + storage tokens 3,840, 12 blocks of 7,087,104, final norm 1,536) + mask token, periods, 12 bias masks
    # and 12 qkv biases
    assert len(shapes) == 8 + 12 * 15 == 188
    total = sum(torch.Size(shape).numel() for shape in shapes.values())
    assert total == 85_641_216 + EMBED + HEAD_DIM // 4 + 12 * 2 * 3 * EMBED


def test_full_size_release_loads_every_backbone_parameter_tensor_for_tensor():
    backbone = create_backbone("dinov3_vitb16")
    state = meta_dinov3_vitb16_state(depth=12, seed=0)
    report = load_external_weights(backbone, state, strict=True)
    target = backbone.state_dict()
    assert report.layout == "meta_dinov3"
    assert report.missing == [] and report.unexpected == [] and report.shape_mismatches == []
    assert sorted(report.loaded) == sorted(target)  # 100 % of the backbone's tensors
    parameters = dict(backbone.named_parameters())
    loaded_values = sum(parameters[name].numel() for name in report.loaded if name in parameters)
    assert loaded_values == sum(p.numel() for p in backbone.parameters()) == 85_641_216
    for name, value in target.items():  # every tensor, compared with the one it came from
        assert torch.equal(value, state[to_meta_name(name)]), name
    dropped = {"mask_token", "rope_embed.periods"}
    dropped |= {f"blocks.{i}.attn.qkv.{suffix}" for i in range(12) for suffix in ("bias", "bias_mask")}
    assert set(report.dropped) == dropped
    # the periods are dropped because timm recomputes them: they are the checkpoint's to the last bit
    assert torch.equal(backbone.rope.periods.float(), state["rope_embed.periods"])


def test_release_file_gives_timm_features_and_its_digest(tmp_path):
    """Depth 2 at full width (the per-block keys and shapes are those of the release): the product's model, loaded
    from the file as a pre-training ``init`` is, equals timm's model loaded with timm's own DINOv3 conversion."""
    state = meta_dinov3_vitb16_state(depth=2, seed=1)
    path = tmp_path / "dinov3_vitb16_pretrain_lvd1689m.pth"
    torch.save(state, path)
    torch.manual_seed(7)  # the product model's random start differs from the reference's: only the load matters
    model = create_model("dinov3_vitb16", 64, backbone_config={"depth": 2})
    report = load_external_weights(model, str(path))
    assert report.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    backbone_keys = sorted(k for k in model.state_dict() if k.startswith("backbone."))
    assert sorted(k for k in report.loaded if k.startswith("backbone.")) == backbone_keys
    # the junction is the compatible model's own head: kept as initialised and reported as such, never as loaded
    assert report.fresh == ["junction.weight"] and not report.missing
    assert not report.unexpected and not report.shape_mismatches

    torch.manual_seed(8)
    reference = timm.create_model("vit_base_patch16_dinov3", pretrained=False, num_classes=0, global_pool="token",
                                  depth=2)
    reference.load_state_dict(checkpoint_filter_fn(torch.load(path, weights_only=True), reference), strict=True)
    images = torch.randn(3, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    model.eval(), reference.eval()
    with torch.no_grad():
        ours, theirs = model.embed(images), reference(images)
    assert ours.shape == theirs.shape == (3, EMBED)
    assert float(theirs.std()) > 0.1  # features that depend on the weights, not a constant
    assert float((ours - theirs).abs().max()) == 0.0


def test_non_zero_query_bias_is_never_dropped_silently():
    """The product's ViT-B has no qkv bias (the release's is zero). A checkpoint whose q or v bias is not zero
    cannot be represented: it is listed as unexpected and a strict load refuses, naming it."""
    config = dict(img_size=32, depth=1, embed_dim=32, num_heads=2)
    backbone = create_backbone("dinov3_vitb16", **config)
    state = {to_meta_name(k): v.clone() for k, v in backbone.state_dict().items()}
    state["blocks.0.attn.qkv.bias"] = torch.cat([torch.zeros(32), torch.ones(32), torch.zeros(32)])  # k only
    report = load_external_weights(backbone, dict(state))
    assert report.ok and "blocks.0.attn.qkv.bias" in report.dropped  # Meta masks the key bias: nothing lost
    state["blocks.0.attn.qkv.bias"] = torch.cat([torch.full((32,), 0.5), torch.zeros(64)])
    report = load_external_weights(backbone, dict(state), strict=False)
    assert report.unexpected == ["blocks.0.attn.qkv.bias"] and not report.ok
    with pytest.raises(ValueError, match=r"1 unexpected: blocks\.0\.attn\.qkv\.bias"):
        load_external_weights(backbone, dict(state))  # strict by default
