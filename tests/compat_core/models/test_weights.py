"""External weight loading: round trips, integrity, key reports, prefixes, Meta DINOv3 layout, slots, resolvers."""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import pytest
import timm
import torch
from safetensors.torch import save_file

from compat_core.models.backbones import BACKBONES, create_backbone, small_test_config

from compat_core.models.compat_model import create_model, load_model, save_model

from compat_core.models.weights import load_external_weights, register_uri_resolver


def _side(name: str, config: dict) -> int:
    return config.get("img_size", 28 if name in ("dinov2_vitb14", "lenetpp") else 32)


def _randomise_norm_statistics(module: torch.nn.Module) -> None:
    # Fresh BatchNorm statistics are 0/1 in every model, which would hide a buffer that failed to load.
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
                sub.running_mean.uniform_(-0.5, 0.5)
                sub.running_var.uniform_(0.5, 1.5)


@pytest.mark.parametrize("name", BACKBONES.names())
def test_every_backbone_round_trips(tmp_path, name):
    config = small_test_config(name)
    torch.manual_seed(1)
    source = create_backbone(name, **config)
    _randomise_norm_statistics(source)
    path = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    torch.manual_seed(2)
    target = create_backbone(name, **config)
    report = load_external_weights(target, str(path))
    assert report.ok, report.summary()
    assert report.format == "safetensors" and report.layout == "none"
    assert report.loaded == sorted(source.state_dict())
    in_chans = 1 if name == "lenetpp" else 3
    images = torch.randn(2, in_chans, _side(name, config), _side(name, config))
    source.eval(), target.eval()
    with torch.no_grad():
        assert torch.equal(source(images), target(images))

    # The same backbone inside a CompatModel through save_model / load_model.
    model = create_model(name, num_slots=5, backbone_config=config)
    model.backbone.load_state_dict(source.state_dict())
    save_model(model, str(tmp_path / "model"))
    reloaded = load_model(str(tmp_path / "model"))
    model.eval(), reloaded.eval()
    with torch.no_grad():
        assert torch.equal(model(images).logits, reloaded(images).logits)


@pytest.fixture()
def tiny_model():
    torch.manual_seed(0)
    return create_model("cnn4", 6, backbone_config={"width": 4})


def test_torch_checkpoint_container_and_wrapper_prefixes(tmp_path, tiny_model):
    state = OrderedDict(("module." + k, v) for k, v in tiny_model.state_dict().items())
    path = tmp_path / "ckpt.pth"
    torch.save({"epoch": 3, "state_dict": state}, path)
    torch.manual_seed(5)
    target = create_model("cnn4", 6, backbone_config={"width": 4})
    report = load_external_weights(target, str(path))
    assert report.format == "torch" and report.ok
    assert torch.equal(target.junction.weight, tiny_model.junction.weight)


def test_backbone_prefix_is_matched_both_ways(tmp_path, tiny_model):
    # A bare backbone state dict loads into a CompatModel: the junction keeps its initialisation, reported as fresh.
    torch.manual_seed(3)
    target = create_model("cnn4", 6, backbone_config={"width": 4})
    report = load_external_weights(target, dict(tiny_model.backbone.state_dict()))
    assert report.fresh == ["junction.weight"] and not report.missing and not report.unexpected
    # A full CompatModel state dict loads into a bare backbone: the junction is unexpected.
    bare = create_backbone("cnn4", width=4)
    with pytest.raises(ValueError, match="1 unexpected: junction.weight"):
        load_external_weights(bare, dict(tiny_model.state_dict()))
    report = load_external_weights(bare, dict(tiny_model.state_dict()), ignore=["junction.*"])
    assert report.ignored == ["junction.weight"] and not report.missing and not report.unexpected
    assert torch.equal(bare.features[0].weight, tiny_model.backbone.features[0].weight)


def test_sha256_is_verified(tmp_path, tiny_model):
    path = tmp_path / "w.safetensors"
    save_file(dict(tiny_model.state_dict()), str(path))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    report = load_external_weights(tiny_model, str(path), sha256=digest.upper())
    assert report.sha256 == digest
    wrong = "0" * 64
    with pytest.raises(ValueError) as error:
        load_external_weights(tiny_model, str(path), sha256=wrong)
    assert wrong in str(error.value) and digest in str(error.value)


def test_missing_unexpected_and_shape_mismatch_are_named(tiny_model):
    state = dict(tiny_model.state_dict())
    del state["backbone.features.1.bias"]
    state["bogus.weight"] = torch.zeros(3)
    state["junction.weight"] = torch.zeros(7, 32)
    torch.manual_seed(9)
    target = create_model("cnn4", 6, backbone_config={"width": 4})
    before = target.junction.weight.detach().clone()
    with pytest.raises(ValueError) as error:
        load_external_weights(target, state)  # strict by default: nothing is loaded
    message = str(error.value)
    assert "2 missing: backbone.features.1.bias, junction.weight" in message
    assert "1 unexpected: bogus.weight" in message
    assert "1 shape mismatches" in message and "junction.weight" in message
    assert torch.equal(target.junction.weight, before)
    report = load_external_weights(target, state, strict=False)
    assert report.missing == ["backbone.features.1.bias", "junction.weight"]
    assert report.unexpected == ["bogus.weight"]
    assert report.shape_mismatches == [("junction.weight", (7, 32), (5, 32))]
    assert torch.equal(target.junction.weight, before)  # a mis-shaped tensor is never half-loaded
    assert torch.equal(target.backbone.features[0].weight, tiny_model.backbone.features[0].weight)
    with pytest.raises(ValueError) as error:
        load_external_weights(target, state, strict=True)
    for name in ("backbone.features.1.bias", "bogus.weight", "junction.weight"):
        assert name in str(error.value)


def _meta_dinov3_layout(timm_state: dict, head_dim: int) -> dict:
    """Inverse of the timm conversion: how Meta's DINOv3 release names the same tensors (plus its extra keys)."""
    meta = {}
    for key, value in timm_state.items():
        key = key.replace("reg_token", "storage_tokens").replace("gamma_1", "ls1.gamma").replace("gamma_2", "ls2.gamma")
        meta[key] = value.clone()
    dim = timm_state["cls_token"].shape[-1]
    meta["mask_token"] = torch.randn(1, dim)
    meta["rope_embed.periods"] = torch.arange(1, head_dim // 4 + 1, dtype=torch.float32)
    for block in sorted({k.split(".")[1] for k in timm_state if k.startswith("blocks.")}):
        meta[f"blocks.{block}.attn.qkv.bias"] = torch.zeros(3 * dim)  # Meta's distilled ViTs: all-zero qkv bias
        meta[f"blocks.{block}.attn.qkv.bias_mask"] = torch.ones(3 * dim)
    return meta


def test_meta_dinov3_checkpoint_is_remapped(tmp_path):
    config = small_test_config("dinov3_vitb16")
    torch.manual_seed(0)
    source = create_backbone("dinov3_vitb16", **config)
    with torch.no_grad():
        for name, parameter in source.named_parameters():
            if "gamma" in name or "token" in name:
                parameter.normal_()  # layer scales start at 1e-5 and would hide a failed gamma load
    meta = _meta_dinov3_layout(source.state_dict(), head_dim=32)
    assert "storage_tokens" in meta and "blocks.0.ls1.gamma" in meta and "reg_token" not in meta
    path = tmp_path / "dinov3_vitb16_pretrain.pth"
    torch.save(meta, path)

    torch.manual_seed(1)
    model = create_model("dinov3_vitb16", 9, backbone_config=config)
    report = load_external_weights(model, str(path), slot_map=["a", "b", "c"])
    assert report.layout == "meta_dinov3"
    assert report.fresh == ["junction.weight"] and report.ok  # a backbone checkpoint: the junction starts fresh
    assert {"mask_token", "rope_embed.periods", "blocks.0.attn.qkv.bias", "blocks.1.attn.qkv.bias_mask"} <= set(
        report.dropped
    )
    assert "WARNING" not in report.dropped["blocks.0.attn.qkv.bias"]
    images = torch.randn(2, 3, 32, 32)
    source.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(source(images), model.embed(images))
    assert report.slot_assignment == {"a": 0, "b": 1, "c": 2}
    assert model.config["pretrained_slots"] == ["a", "b", "c"]


def test_meta_dinov3_qkv_bias_is_split_for_timm_qkvb_models():
    kwargs = dict(pretrained=False, num_classes=0, img_size=32, depth=1, embed_dim=32, num_heads=2)
    target = timm.create_model("vit_small_patch16_dinov3_qkvb", **kwargs)
    state = {k: v.clone() for k, v in target.state_dict().items() if not k.endswith(("q_bias", "v_bias"))}
    q, v = torch.arange(32.0), -torch.arange(32.0)
    state["blocks.0.attn.qkv.bias"] = torch.cat([q, torch.zeros(32), v])
    state["storage_tokens"] = state.pop("reg_token")
    report = load_external_weights(target, {"teacher": state})  # DINO training checkpoints nest the weights
    assert report.layout == "meta_dinov3" and report.ok, report.summary()
    assert torch.equal(target.blocks[0].attn.q_bias, q) and torch.equal(target.blocks[0].attn.v_bias, v)


def test_dinov2_position_embedding_is_resampled():
    small = dict(depth=1, embed_dim=32, num_heads=2)
    source = create_backbone("dinov2_vitb14", img_size=56, **small)  # 4x4 patch grid
    target = create_backbone("dinov2_vitb14", img_size=28, **small)  # 2x2 patch grid
    state = dict(source.state_dict())
    cls_position = torch.randn(1, 1, 32)
    # Interpolating a constant field must give the same constant; the CLS position is carried over untouched.
    state["pos_embed"] = torch.cat([cls_position, torch.full((1, 16, 32), 0.25)], dim=1)
    report = load_external_weights(target, state)
    assert report.resampled == ["pos_embed"] and report.ok
    assert target.pos_embed.shape == (1, 1 + 4, 32)
    assert torch.equal(target.pos_embed[:, :1], cls_position)
    assert torch.allclose(target.pos_embed[:, 1:], torch.full((1, 4, 32), 0.25), atol=1e-5)


def test_iamcl2r_reference_checkpoint_maps_to_compat_model():
    torch.manual_seed(0)
    reference = create_model("senet18", 11, backbone_config={"base_width": 16})
    state = {}
    for key, value in reference.state_dict().items():
        # the reference wraps each stage's blocks in a ModuleList called "blocks" and names the junction fc1
        key = key.replace("junction.weight", "fc1.weight")
        for layer in range(1, 5):
            key = key.replace(f"layer{layer}.", f"layer{layer}.blocks.")
        state[key] = value
    state["fc2.weight"] = torch.randn(11, 10)  # its (fixed) d-Simplex classifier weights
    torch.manual_seed(1)
    target = create_model("senet18", 11, backbone_config={"base_width": 16})
    report = load_external_weights(target, {"net": state})
    assert report.layout == "iamcl2r" and report.ok, report.summary()
    assert "fc2.weight" in report.dropped
    assert torch.equal(target.junction.weight, reference.junction.weight)


def test_custom_key_map_prefixes_and_callable(tiny_model):
    state = {k.replace("backbone.features.", "trunk.body."): v for k, v in tiny_model.state_dict().items()}
    target = create_model("cnn4", 6, backbone_config={"width": 4})
    report = load_external_weights(target, state, key_map={"trunk.body.": "backbone.features."})
    assert report.layout == "custom" and report.ok
    report = load_external_weights(target, state, key_map=lambda k: None if k.startswith("trunk.") else k,
                                   strict=False)
    assert report.missing == sorted(k for k in tiny_model.state_dict() if k != "junction.weight")
    with pytest.raises(ValueError, match="key_map"):
        load_external_weights(target, state, key_map="caffe")


def test_slot_map_validation(tiny_model):
    state = dict(tiny_model.state_dict())
    report = load_external_weights(tiny_model, state, slot_map=3)
    assert report.slot_assignment == {"0": 0, "1": 1, "2": 2}
    with pytest.raises(ValueError, match="K=6"):
        load_external_weights(tiny_model, state, slot_map=list(range(7)))
    with pytest.raises(ValueError, match="twice"):
        load_external_weights(tiny_model, state, slot_map=[4, 4])


def test_registered_uri_resolver_and_unknown_scheme(tmp_path, tiny_model):
    from compat_core.models import weight_sources

    save_model(tiny_model, str(tmp_path / "registered"))
    with pytest.MonkeyPatch.context() as patch:  # the resolvers as they are now, restored at the end of the block
        patch.setattr(weight_sources, "_URI_RESOLVERS", dict(weight_sources._URI_RESOLVERS))
        register_uri_resolver("testmodels", lambda uri: str(tmp_path / uri.split(":/", 1)[1]))
        target = create_model("cnn4", 6, backbone_config={"width": 4})
        report = load_external_weights(target, "testmodels:/registered")  # a folder: its model.safetensors is used
        assert report.ok and report.source.endswith("model.safetensors")
    with pytest.raises(ValueError, match="testmodels"):
        load_external_weights(target, "testmodels:/registered")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_external_weights(target, str(tmp_path / "nowhere.safetensors"))


class _Payload:
    pass


def test_pickled_code_is_refused(tmp_path, tiny_model):
    path = tmp_path / "unsafe.pt"
    torch.save({"state_dict": dict(tiny_model.state_dict()), "extra": _Payload()}, path)
    with pytest.raises(ValueError, match="weights_only"):
        load_external_weights(tiny_model, str(path))


def test_unrelated_weights_fail_before_anything_is_loaded(tmp_path, tiny_model):
    """A file that matches nothing (or a third of the model) is refused with counts and names, the model untouched."""
    path = tmp_path / "unrelated.safetensors"
    save_file({"totally.unrelated": torch.zeros(3)}, str(path))
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    with pytest.raises(ValueError) as error:
        load_external_weights(tiny_model, str(path))
    message = str(error.value)
    target_count = len(before)
    backbone_count = len(tiny_model.backbone.state_dict())
    assert f"0 of {target_count} target keys matched" in message
    assert "1 unexpected: totally.unrelated" in message and f"{backbone_count} missing" in message
    assert all(torch.equal(v, tiny_model.state_dict()[k]) for k, v in before.items())

    state = dict(tiny_model.backbone.state_dict())
    part = {k: v for i, (k, v) in enumerate(sorted(state.items())) if i % 3 == 0}
    with pytest.raises(ValueError, match=rf"{len(state) - len(part)} missing: "):
        load_external_weights(create_model("cnn4", 6, backbone_config={"width": 4}), part)


def test_ignore_lists_known_extras_explicitly(tiny_model):
    state = dict(tiny_model.state_dict())
    state["dino_head.mlp.0.weight"] = torch.zeros(4, 4)
    state["dino_head.last_layer.weight"] = torch.zeros(4)
    with pytest.raises(ValueError, match="2 unexpected: dino_head.last_layer.weight, dino_head.mlp.0.weight"):
        load_external_weights(tiny_model, state)
    report = load_external_weights(tiny_model, state, ignore=["dino_head.*", "ibot_head.*"])
    assert report.ok and report.ignored == ["dino_head.last_layer.weight", "dino_head.mlp.0.weight"]
    assert report.unused_ignore == ["ibot_head.*"]
    assert report.to_json()["ignored_count"] == 2 and report.to_json()["loaded"] == len(tiny_model.state_dict())
    # a target key may be ignored too: it keeps its initialisation and is listed, not reported missing
    del state["backbone.features.1.bias"]
    report = load_external_weights(tiny_model, state, ignore=["dino_head.*", "backbone.features.1.bias"])
    assert report.ok and "backbone.features.1.bias" in report.ignored


def test_meta_dinov3_layout_loads_every_key_and_extras_need_ignoring():
    """Meta's layout (storage tokens, ls gammas, qkv bias, rope periods, mask token) loads every timm key strictly;
    a training checkpoint's extra heads are refused until listed in ``ignore``."""
    kwargs = dict(pretrained=False, num_classes=0, img_size=32, depth=1, embed_dim=32, num_heads=2)
    torch.manual_seed(4)
    source = timm.create_model("vit_small_patch16_dinov3", **kwargs)
    target = timm.create_model("vit_small_patch16_dinov3", **kwargs)
    meta = _meta_dinov3_layout(dict(source.state_dict()), head_dim=16)
    report = load_external_weights(target, meta)
    assert report.ok and len(report.loaded) == report.target_keys == len(target.state_dict())
    assert set(report.dropped) >= {"mask_token", "rope_embed.periods"}
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in target.state_dict().items())
    meta["dino_head.last_layer.weight_g"] = torch.ones(1)
    with pytest.raises(ValueError, match="1 unexpected: dino_head.last_layer.weight_g"):
        load_external_weights(target, meta)
    assert load_external_weights(target, meta, ignore=["dino_head.*"]).ignored == ["dino_head.last_layer.weight_g"]
