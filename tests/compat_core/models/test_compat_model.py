"""CompatModel: junction, fixed d-Simplex logits, learnable growth, saving, freezing, precision helpers."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from compat_core.models import precision

from compat_core.models.backbones import create_backbone

from compat_core.models.compat_model import CompatModel, create_model, frozen_copy, load_model, save_model

from compat_core.models.precision import autocast_context, prepare_batch, prepare_for_speed
from compat_core.simplex import dsimplex


def _numpy_dsimplex(K: int) -> np.ndarray:
    """SPEC §3 recipe in float64: [I; (1 - sqrt(K))/(K-1)], subtract column means, unit rows."""
    W = np.zeros((K, K - 1))
    W[: K - 1] = np.eye(K - 1)
    W[K - 1] = (1.0 - math.sqrt(K)) / (K - 1)
    W -= W.mean(axis=0, keepdims=True)
    return W / np.linalg.norm(W, axis=1, keepdims=True)


def _tiny_model(classifier="simplex", num_slots=6, **kwargs) -> CompatModel:
    torch.manual_seed(0)
    return create_model("cnn4", num_slots, classifier=classifier, backbone_config={"width": 4}, **kwargs)


def test_simplex_logits_equal_projection_times_prototypes():
    K = 6
    model = _tiny_model(num_slots=K).eval()
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        out = model(images)
    W = _numpy_dsimplex(K)
    # pairwise cosine of the reference prototypes is -1/(K-1): the matrix itself is right before comparing
    assert np.allclose(W @ W.T, np.where(np.eye(K, dtype=bool), 1.0, -1.0 / (K - 1)))
    expected = out.projection.double().numpy() @ W.T
    assert out.logits.shape == (3, K)
    assert np.allclose(out.logits.double().numpy(), expected, atol=1e-5)
    assert np.allclose(model.prototype_rows(np.arange(K)).double().numpy(), W, atol=1e-6)


def test_junction_is_bias_free_and_features_are_unit_projection():
    model = _tiny_model(num_slots=5).eval()
    assert model.junction.bias is None
    assert tuple(model.junction.weight.shape) == (4, model.backbone.embed_dim)
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        out = model(images)
        embedding = model.embed(images)
    assert torch.allclose(out.embedding, embedding)
    expected_projection = embedding @ model.junction.weight.T
    assert torch.allclose(out.projection, expected_projection, atol=1e-5)
    norms = out.features.norm(dim=1)
    assert torch.allclose(norms, torch.ones(4), atol=1e-6)
    assert torch.allclose(out.features * out.projection.norm(dim=1, keepdim=True), out.projection, atol=1e-5)
    with torch.no_grad():
        assert torch.allclose(model.features(images), out.features, atol=1e-6)
        assert torch.allclose(model.logits(images), out.logits, atol=1e-5)


def test_prototypes_are_fixed_and_never_trained():
    model = _tiny_model(num_slots=5)
    names = {name for name, _ in model.named_parameters()}
    assert not any("prototype" in name for name in names)
    # nothing of size K x (K-1) anywhere: not a parameter, not a buffer, not in the state dict
    assert [name for name in model.state_dict() if not name.startswith("backbone.")] == ["junction.weight"]
    assert not any("prototype" in name for name, _ in model.named_buffers())
    before = model.prototype_rows(np.arange(5)).clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)).logits, torch.tensor([0, 1, 2, 4]))
    loss.backward()
    assert model.junction.weight.grad is not None
    optimizer.step()
    assert torch.equal(model.prototype_rows(np.arange(5)), before)


@pytest.mark.parametrize("K", [2, 3, 17, 1000, 4097])
@pytest.mark.parametrize("norm", ["row", "frobenius"])
def test_closed_form_head_equals_the_explicit_product(K, norm):
    """Logits and the junction's gradient of the closed-form head equal the fp64 product with the prototype matrix."""
    torch.manual_seed(K)
    backbone = create_backbone("cnn4", width=4)
    model = CompatModel(backbone, K, simplex_norm=norm)
    images = torch.randn(6, 3, 32, 32)
    labels = torch.randint(0, K, (6,))
    output = model(images)
    loss = torch.nn.functional.cross_entropy(output.logits, labels)
    loss.backward()
    prototypes = dsimplex(K, norm=norm, dtype=torch.float64)
    projection = output.projection.detach().double()
    expected = projection @ prototypes.T
    assert output.logits.dtype == torch.float32 and output.logits.shape == (6, K)
    scale = expected.abs().max().item()
    assert (output.logits.double() - expected).abs().max().item() <= 1e-5 * max(scale, 1.0)
    probs = torch.softmax(expected, dim=1)
    residual = (probs - torch.nn.functional.one_hot(labels, K).double()) / len(labels)
    embedding = output.embedding.detach().double()
    expected_grad = (residual @ prototypes).T @ embedding
    assert torch.allclose(model.junction.weight.grad.double(), expected_grad, rtol=1e-4, atol=1e-7)


def test_learnable_classifier_grows_and_keeps_old_rows():
    model = _tiny_model("learnable", num_slots=6, num_active_classes=3)
    old_rows = model.classifier.weight.detach().clone()
    assert model(torch.randn(2, 3, 32, 32)).logits.shape == (2, 3)
    model.expand_classes(5)
    assert tuple(model.classifier.weight.shape) == (5, 5)
    assert torch.equal(model.classifier.weight[:3], old_rows)
    assert model.config["num_active_classes"] == 5
    assert model(torch.randn(2, 3, 32, 32)).logits.shape == (2, 5)
    with pytest.raises(ValueError, match="n_total"):
        model.expand_classes(4)
    with pytest.raises(ValueError, match="learnable"):
        _tiny_model().expand_classes(10)


def test_invalid_arguments_are_named():
    backbone = create_backbone("cnn4", width=4)
    with pytest.raises(ValueError, match="num_slots"):
        CompatModel(backbone, 1)
    with pytest.raises(ValueError, match="classifier"):
        CompatModel(backbone, 4, classifier="cosine")
    with pytest.raises(ValueError, match="embed_dim"):
        CompatModel(torch.nn.Identity(), 4)


def test_frozen_copy_is_independent_and_frozen():
    model = _tiny_model()
    old = frozen_copy(model)
    assert not old.training
    assert all(not p.requires_grad for p in old.parameters())
    assert all(p.requires_grad for p in model.parameters())
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        reference = old.features(images)
        model.junction.weight.add_(1.0)
        assert torch.equal(old.features(images), reference)


@pytest.mark.parametrize("classifier", ["simplex", "learnable"])
def test_save_and_load_model_round_trip(tmp_path, classifier):
    extra = {"num_active_classes": 2} if classifier == "learnable" else {}
    model = _tiny_model(classifier, num_slots=5, **extra)
    if classifier == "learnable":
        model.expand_classes(4)
    with torch.no_grad():
        model.backbone.features[1].running_mean.uniform_()  # non-trivial BN statistics must travel too
    model.eval()
    folder = tmp_path / "m"
    save_model(model, str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    assert config["backbone"] == "cnn4" and config["num_slots"] == 5 and config["classifier"] == classifier
    loaded = load_model(str(folder)).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        a, b = model(images), loaded(images)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features)
    assert loaded.config == model.config


def test_load_model_names_missing_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(str(tmp_path))


def test_autocast_context_follows_device_capability(monkeypatch):
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    monkeypatch.setattr(precision, "autocast_dtype", lambda device: None)
    with autocast_context("cpu"):
        assert layer(x).dtype == torch.float32
    monkeypatch.setattr(precision, "autocast_dtype", lambda device: torch.bfloat16)
    with autocast_context("cpu"):
        assert layer(x).dtype == torch.bfloat16
    with autocast_context("cpu", enabled=False):
        assert layer(x).dtype == torch.float32


def test_simplex_logits_under_autocast_are_fp32_of_the_half_projection(monkeypatch):
    monkeypatch.setattr(precision, "autocast_dtype", lambda device: torch.bfloat16)
    model = _tiny_model(num_slots=5).eval()
    with torch.no_grad(), autocast_context("cpu"):
        out = model(torch.randn(2, 3, 32, 32))
    assert out.projection.dtype == torch.bfloat16
    assert out.logits.shape == (2, 5) and out.logits.dtype == torch.float32
    expected = out.projection.double() @ dsimplex(5, dtype=torch.float64).T
    assert torch.allclose(out.logits.double(), expected, atol=1e-6)


def test_prepare_for_speed_uses_channels_last_only_where_it_pays(monkeypatch):
    monkeypatch.setattr(precision, "autocast_dtype", lambda device: None)
    plain = prepare_for_speed(_tiny_model(), "cpu")
    conv = plain.backbone.features[0].weight
    assert conv.is_contiguous() and not conv.is_contiguous(memory_format=torch.channels_last)
    monkeypatch.setattr(precision, "autocast_dtype", lambda device: torch.bfloat16)
    fast = prepare_for_speed(_tiny_model(), "cpu")
    assert fast.backbone.features[0].weight.is_contiguous(memory_format=torch.channels_last)
    batch = prepare_batch(torch.randn(2, 3, 8, 8), fast)
    assert batch.is_contiguous(memory_format=torch.channels_last)
    vit = create_backbone("dinov3_vits16", img_size=32, depth=1, embed_dim=32, num_heads=2)
    assert not precision.has_convolutions(vit)  # a patch embedding alone does not make a conv net


def test_backbone_head_retrieves_on_the_backbone_output(tmp_path):
    """head='backbone' (the papers' ER/BCT baselines): no junction, feature = unit backbone output (d = m), the
    learnable classifier sits on it; the head travels with the weights; the d-Simplex refuses it."""
    model = _tiny_model("learnable", num_slots=6, num_active_classes=3, head="backbone")
    images = torch.rand(5, 3, 16, 16)
    output = model(images)
    embedding = model.backbone(images)
    assert model.feature_dim == embedding.shape[1] == output.features.shape[1]
    expected = embedding.double() / embedding.double().norm(dim=1, keepdim=True)
    assert torch.allclose(output.features.double(), expected, atol=1e-6)
    assert torch.allclose(output.logits, embedding @ model.classifier.weight.T, atol=1e-6)
    assert not any("junction" in name for name, _ in model.named_parameters())
    save_model(model, str(tmp_path / "m"))
    again = load_model(str(tmp_path / "m"))
    assert again.head == "backbone" and torch.allclose(again(images).features, output.features, atol=1e-6)
    with pytest.raises(ValueError, match="head='backbone' needs classifier='learnable'"):
        _tiny_model("simplex", head="backbone")


@pytest.mark.parametrize("head", ["backbone", "junction"])
def test_learnable_from_simplex_keeps_the_logits_of_the_pretrained_slots(head):
    """fp64 reference built by hand: logits of slot c = <J e, p_c> with p_c the d-Simplex prototype (SPEC §3)."""
    from compat_core.models.compat_model import learnable_from_simplex
    from compat_core.simplex import dsimplex

    torch.manual_seed(3)
    model = create_model("cnn4", 12, backbone_config={"in_chans": 1, "width": 4})
    model.config["pretrained_classes"] = 5
    images = torch.randn(6, 1, 16, 16)
    converted = learnable_from_simplex(model, 5, head)
    with torch.no_grad():
        embedding = model.embed(images).double()
        expected = embedding @ model.junction.weight.double().T @ dsimplex(12).double()[:5].T
        actual = converted.logits(images).double()
    assert converted.classifier_kind == "learnable" and converted.num_active_classes == 5
    assert converted.head == head and converted.config["pretrained_classes"] == 5
    assert torch.allclose(actual, expected, atol=1e-5, rtol=1e-5)
    # the backbone is copied, not shared: training the converted model leaves the source unchanged
    first = next(converted.backbone.parameters())
    assert first.data_ptr() != next(model.backbone.parameters()).data_ptr()


def test_learnable_from_simplex_refuses_other_models():
    from compat_core.models.compat_model import learnable_from_simplex

    learnable = create_model("cnn4", 12, classifier="learnable", num_active_classes=3,
                             backbone_config={"in_chans": 1, "width": 4})
    with pytest.raises(ValueError, match="needs a d-Simplex CompatModel, got classifier 'learnable'"):
        learnable_from_simplex(learnable, 3)
    simplex = create_model("cnn4", 12, backbone_config={"in_chans": 1, "width": 4})
    with pytest.raises(ValueError, match="num_classes 13 exceeds the model's K=12 slots"):
        learnable_from_simplex(simplex, 13)


def _tiny_files() -> tuple[dict, dict]:
    from compat_core.models.compat_model import model_to_bytes

    torch.manual_seed(0)
    model = create_model("cnn4", 10, backbone_config={"in_chans": 1, "width": 4})
    files = model_to_bytes(model)
    return json.loads(files["config.json"]), {k: v.clone() for k, v in model.state_dict().items()}


def test_a_config_with_a_huge_num_slots_is_refused_from_the_header_before_anything_is_built(monkeypatch):
    from safetensors.torch import save

    from compat_core.models import compat_model

    config, state = _tiny_files()
    built = []
    monkeypatch.setattr(compat_model, "model_from_config", lambda c: built.append(c))
    huge = json.dumps({**config, "num_slots": 100_000_000}).encode()
    with pytest.raises(ValueError, match=r"/m/config.json: num_slots=100000000 .* junction.weight of shape "
                                         r"\(99999999, 32\), but /m/model.safetensors holds shape \(9, 32\)"):
        compat_model.model_from_bytes(huge, save(state), "/m")
    assert built == []  # refused from the numbers alone: no model, no junction of 99999999 x 32 floats


@pytest.mark.parametrize("damage, message", [
    ("zeros", r"/m/model.safetensors: not a safetensors file \(header length 0 in a file of 1000 bytes\)"),
    ("nan", r"/m/model.safetensors: tensor 'junction.weight' holds 2 non-finite value\(s\) \(NaN or inf\) of 288"),
    ("int8", r"/m/model.safetensors: tensor 'junction.weight' has dtype int8; expected floating-point weights"),
])
def test_weights_that_are_not_finite_floats_are_refused_naming_file_and_key(damage, message):
    from safetensors.torch import save

    from compat_core.models.compat_model import model_from_bytes

    config, state = _tiny_files()
    if damage == "nan":
        state["junction.weight"][0, :2] = torch.tensor([math.nan, math.inf])
    elif damage == "int8":
        state["junction.weight"] = state["junction.weight"].to(torch.int8)
    weights = bytes(1000) if damage == "zeros" else save(state)
    with pytest.raises(ValueError, match=message):
        model_from_bytes(json.dumps(config).encode(), weights, "/m")
