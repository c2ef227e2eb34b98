"""Contract tests for every registered backbone, plus published sizes of the reference architectures."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from compat_core.models.backbones import BACKBONES, create_backbone, small_test_config

from compat_core.models.compat_model import create_model
from compat_core.models.backbones import embedding_width
from compat_core.models.resnet_cifar import _OptionAShortcut

# Embedding width m of each backbone at its default configuration (papers / torchvision / timm model cards).
EXPECTED_EMBED_DIM = {
    "resnet18_cifar": 512,
    "resnet32_cifar": 64,
    "resnet50_cifar": 2048,
    "resnet18": 512,
    "senet18": 512,
    "regnety_400mf": 384,  # IAM-CL2R: "feature sizes 512 and 384"
    "regnety_400mf_tv": 440,
    "lenetpp": 2,
    "cnn4": 256,
    "dinov3_vitb16": 768,
    "dinov3_vits16": 384,
    "dinov2_vitb14": 768,
}

NAMES = sorted(EXPECTED_EMBED_DIM)


def _input_side(name: str, config: dict) -> int:
    # ViT-B/14 needs a multiple of 14; LeNet++ defaults to MNIST's 28.
    return config.get("img_size", 28 if name in ("dinov2_vitb14", "lenetpp") else 32)


def test_every_registered_backbone_is_covered():
    assert BACKBONES.names() == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_default_embed_dim(name):
    # Full-size ViTs take seconds to initialise; the meta device builds them without allocating weights.
    device = "meta" if name.startswith("dino") else "cpu"
    with torch.device(device):
        backbone = create_backbone(name)
    assert backbone.embed_dim == EXPECTED_EMBED_DIM[name]


@pytest.mark.parametrize("name", NAMES)
def test_card_width_is_the_published_width_and_the_built_width(name):
    # the card answers without building (compat plan); it must agree with the papers' width and with the module
    assert embedding_width(name) == EXPECTED_EMBED_DIM[name]
    config = small_test_config(name)
    with torch.device("cpu" if name == "regnety_400mf_tv" else "meta"):  # torchvision's RegNet needs real tensors
        built = create_backbone(name, **config)
    assert embedding_width(name, config) == built.embed_dim


def test_card_width_follows_the_width_options():
    # hand-worked: cnn4 ends with 8w channels, CIFAR ResNet-18 with 8 * base_width, ResNet-50 with 4 * 8 * base_width
    assert embedding_width("cnn4", {"width": 5}) == 40
    assert embedding_width("resnet18_cifar", {"base_width": 3}) == 24
    assert embedding_width("resnet50_cifar", {"base_width": 3}) == 96
    assert embedding_width("dinov3_vits16", {"embed_dim": 96, "num_heads": 3}) == 96
    with pytest.raises(KeyError, match="valid backbone names: cnn4"):
        embedding_width("cnn5")


@pytest.mark.parametrize("name", NAMES)
def test_backbone_contract(name):
    torch.manual_seed(0)
    config = small_test_config(name)
    backbone = create_backbone(name, **dict(config, in_chans=3))
    side = _input_side(name, config)
    images = torch.randn(2, 3, side, side)
    embedding = backbone(images)
    assert embedding.shape == (2, backbone.embed_dim)
    assert torch.isfinite(embedding).all()
    embedding.square().mean().backward()
    without_grad = [n for n, p in backbone.named_parameters() if p.grad is None]
    assert without_grad == []
    not_finite = [n for n, p in backbone.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not_finite == []
    assert any(p.grad.abs().sum() > 0 for p in backbone.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_compat_model_dimensions_for_every_backbone_on_grayscale(name):
    config = small_test_config(name)
    model = create_model(name, num_slots=7, backbone_config=dict(config, in_chans=1))
    side = _input_side(name, config)
    with torch.no_grad():
        out = model(torch.randn(2, 1, side, side))
    assert out.embedding.shape == (2, model.backbone.embed_dim)
    assert out.projection.shape == (2, 6)  # K - 1
    assert out.features.shape == (2, 6)
    assert out.logits.shape == (2, 7)


@pytest.mark.parametrize("name", NAMES)
def test_backward_through_the_junction(name):
    # The training path: images -> backbone -> junction -> d-Simplex logits -> cross-entropy -> every weight.
    torch.manual_seed(0)
    num_slots = 5
    config = small_test_config(name)
    model = create_model(name, num_slots, backbone_config=config)
    in_chans = 1 if name == "lenetpp" else 3
    side = _input_side(name, config)
    labels = torch.tensor([0, 3])
    out = model(torch.randn(2, in_chans, side, side))
    assert out.embedding.shape == (2, model.backbone.embed_dim) and model.embed_dim == model.backbone.embed_dim
    assert out.features.shape == (2, num_slots - 1)
    assert torch.allclose(out.features.norm(dim=1), torch.ones(2), atol=1e-5)
    assert model.junction.weight.shape == (num_slots - 1, model.backbone.embed_dim)
    torch.nn.functional.cross_entropy(out.logits, labels).backward()

    assert model.junction.weight.grad is not None and torch.isfinite(model.junction.weight.grad).all()
    without_grad = [n for n, p in model.backbone.named_parameters() if p.grad is None]
    assert without_grad == []
    not_finite = [n for n, p in model.backbone.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not_finite == []
    assert any(p.grad.abs().sum() > 0 for p in model.backbone.parameters())
    # Junction gradient by hand in fp64: logits = (E W^T) P^T, so dL/dW = ((softmax - onehot) P)^T E / B.
    embedding = out.embedding.detach().double()
    prototypes = model.prototype_rows(np.arange(num_slots)).double()
    probs = torch.softmax(out.logits.detach().double(), dim=1)
    residual = probs - torch.nn.functional.one_hot(labels, num_slots).double()
    expected = (residual @ prototypes).T @ embedding / len(labels)
    assert torch.allclose(model.junction.weight.grad.double(), expected, rtol=1e-4, atol=1e-6)


def test_resnet32_matches_he_et_al():
    backbone = create_backbone("resnet32_cifar")
    # 6n+2 = 32 weighted layers with n=5: 31 convolutions + the classifier (here the junction).
    convs = [m for m in backbone.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 31
    assert [convs[0].out_channels, convs[-1].out_channels] == [16, 64]
    # He et al. 2016, Table 6: ResNet-32 has 0.46M parameters (with its 10-way FC of 64*10+10).
    params = sum(p.numel() for p in backbone.parameters()) + 64 * 10 + 10
    assert round(params / 1e6, 2) == 0.46


def test_option_a_shortcut_subsamples_and_zero_pads():
    shortcut = _OptionAShortcut(in_planes=2, planes=4, stride=2)
    x = torch.arange(2 * 4 * 4, dtype=torch.float32).reshape(1, 2, 4, 4).repeat(2, 1, 1, 1)
    out = shortcut(x)
    assert out.shape == (2, 4, 2, 2)
    # channels 0 and 3 are the zero padding (one each side); 1 and 2 are the inputs at even rows/columns
    assert torch.equal(out[:, 0], torch.zeros(2, 2, 2))
    assert torch.equal(out[:, 3], torch.zeros(2, 2, 2))
    assert out[0, 1].tolist() == [[0.0, 2.0], [8.0, 10.0]]
    assert out[0, 2].tolist() == [[16.0, 18.0], [24.0, 26.0]]


def test_torchvision_backbones_match_published_parameter_counts():
    # torchvision model cards: resnet18 11,689,512 and regnet_y_400mf 4,344,144 parameters with the 1000-way fc.
    resnet = create_backbone("resnet18")
    assert sum(p.numel() for p in resnet.parameters()) == 11_689_512 - (512 * 1000 + 1000)
    regnet = create_backbone("regnety_400mf_tv")
    assert sum(p.numel() for p in regnet.parameters()) == 4_344_144 - (440 * 1000 + 1000)


def test_resnet18_keeps_imagenet_stem():
    backbone = create_backbone("resnet18")
    assert backbone.conv1.kernel_size == (7, 7) and backbone.conv1.stride == (2, 2)
    assert isinstance(backbone.maxpool, nn.MaxPool2d)
    cifar = create_backbone("resnet18_cifar", base_width=8)
    assert cifar.conv1.kernel_size == (3, 3) and cifar.conv1.stride == (1, 1)


def test_vit_embedding_is_the_normed_cls_token():
    torch.manual_seed(0)
    backbone = create_backbone("dinov3_vits16", **small_test_config("dinov3_vits16")).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        tokens = backbone.forward_features(images)  # (B, 1 + 4 registers + 4 patches, D), after the final norm
        assert tokens.shape == (2, 1 + 4 + 4, 64)
        assert torch.allclose(backbone(images), tokens[:, 0], atol=1e-6)


def test_lenetpp_embedding_size_and_input_size():
    backbone = create_backbone("lenetpp", embed_dim=3)
    assert backbone(torch.randn(2, 1, 28, 28)).shape == (2, 3)
    assert backbone.fc.in_features == 128 * 3 * 3  # 28 -> 14 -> 7 -> 3 after three 2x2 poolings


def test_cnn4_width_sets_embedding():
    assert create_backbone("cnn4", width=8).embed_dim == 64


def test_unknown_name_and_bad_option_are_explained():
    with pytest.raises(KeyError, match="resnet18_cifar"):
        create_backbone("resnet19")
    with pytest.raises(TypeError, match="cnn4"):
        create_backbone("cnn4", depth=3)
    with pytest.raises(ValueError, match="in_chans"):
        create_backbone("resnet18", in_chans=0)
    with pytest.raises(ValueError, match="num_heads"):
        create_backbone("dinov3_vits16", embed_dim=48)
