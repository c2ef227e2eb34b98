"""Stage helpers without training: autocast modes, pre-training cache keys, verification entries, FAN entries."""
from __future__ import annotations

import numpy as np
import pytest
import tiny_scenario_helpers as tiny
import torch

tiny.register()  # the tiny-synth dataset: configs naming it validate only once it is registered
from pipelines.config.load import validate_config
from pipelines.graph.compile import compile_scenario
from pipelines.stages.entry_metrics import compute_entry, verification_pairs
from pipelines.training.autocast import precision_context
from pipelines.training.settings import TrainConfig


def test_autocast_modes_validate_and_pick_the_dtype():
    assert TrainConfig(autocast="bf16").autocast == "bf16"
    with pytest.raises(ValueError, match=r"TrainConfig\nautocast"):
        TrainConfig(autocast="bf17")
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with precision_context("cpu", "bf16"):
        assert (a @ b).dtype == torch.bfloat16
    with precision_context("cpu", "off"):
        assert (a @ b).dtype == torch.float32
    document = tiny.scenario("er")
    document["training"]["autocast"] = "fp17"
    with pytest.raises(ValueError, match="training.autocast"):
        validate_config(document)


def test_pretrain_keys_ignore_fine_tuning_settings_they_do_not_use():
    base = tiny.scenario("dsimplex-hoc")
    base["pretrain"][0]["epochs"] = 2
    keys = compile_scenario(validate_config(base), version="v").pretrain_stages
    longer = tiny.scenario("dsimplex-hoc")
    longer["pretrain"][0]["epochs"] = 2
    longer["training"]["epochs"] = 5  # the pretrain entry sets its own epochs: its model does not change
    assert compile_scenario(validate_config(longer), version="v").pretrain_stages == keys
    faster = tiny.scenario("dsimplex-hoc")
    faster["pretrain"][0]["epochs"] = 2
    faster["training"]["optimizer"]["lr"] = 0.5  # the pretrain entry falls back to this optimiser: new model
    assert compile_scenario(validate_config(faster), version="v").pretrain_stages != keys


def test_verification_pairs_are_cross_set_and_balanced():
    query_labels = np.array([0, 0, 1, 1, 2])
    gallery_labels = np.array([0, 1, 1, 2, 2, 3])
    a, b, same = verification_pairs(query_labels, gallery_labels, 50, seed=3)
    assert a.shape == b.shape == same.shape == (100,)
    assert same.sum() == 50
    np.testing.assert_array_equal(query_labels[a] == gallery_labels[b], same)


def test_verification_and_tar_entries_on_separable_features():
    config = validate_config(tiny.scenario("er"))
    labels = np.repeat(np.arange(4), 10)
    features = np.eye(4, dtype=np.float32)[labels] + 0.01 * np.random.default_rng(0).normal(size=(40, 4))
    features = features.astype(np.float32)
    protocol = {"metric": "verification", "gallery": "instances", "label_level": "fine", "far": 0.01,
                "verification_pairs": 200}
    assert compute_entry((features, labels, None), (features[::-1].copy(), labels[::-1].copy(), None), protocol,
                         config) == 1.0
    # every positive pair scores ~1 and every negative ~0: all positives accepted at FAR 1 %
    assert compute_entry((features, labels, None), (features, labels, None), {**protocol, "metric": "tar_at_far"},
                         config) == 1.0


def test_fan_entry_applies_adapters_oldest_first():
    from compat_core.upgrades.adapters import FanAdapter

    config = validate_config(tiny.scenario("fan"))
    torch.manual_seed(0)
    first, second = FanAdapter(hidden=5), FanAdapter(hidden=5)
    first.build(3, 3).eval()
    second.build(3, 3).eval()
    rng = np.random.default_rng(1)
    query, gallery = rng.normal(size=(6, 3)).astype(np.float32), rng.normal(size=(8, 3)).astype(np.float32)
    query_labels, gallery_labels = np.arange(6) % 3, np.arange(8) % 3
    protocol = {"metric": "recall_at_1", "gallery": "instances", "label_level": "fine", "far": 0.01,
                "verification_pairs": 10}

    def numpy_psi(adapter, x):
        w1, b1 = adapter.net[0].weight.detach().double().numpy(), adapter.net[0].bias.detach().double().numpy()
        w2, b2 = adapter.net[2].weight.detach().double().numpy(), adapter.net[2].bias.detach().double().numpy()
        y = np.maximum(x @ w1.T + b1, 0) @ w2.T + b2
        return y / np.linalg.norm(y, axis=1, keepdims=True)

    mapped = gallery.astype(np.float64) / np.linalg.norm(gallery, axis=1, keepdims=True)
    mapped = numpy_psi(second, numpy_psi(first, mapped))
    q = query / np.linalg.norm(query, axis=1, keepdims=True)
    expected = float(np.mean(gallery_labels[np.argmax(q @ mapped.T, axis=1)] == query_labels))
    value = compute_entry((query, query_labels, None), (gallery, gallery_labels, None), protocol, config,
                          adapters=[first, second])
    assert value == pytest.approx(expected, abs=1e-12)
    unadapted = compute_entry((query, query_labels, None), (gallery, gallery_labels, None), protocol, config)
    plain = gallery / np.linalg.norm(gallery, axis=1, keepdims=True)
    assert unadapted == pytest.approx(float(np.mean(gallery_labels[np.argmax(q @ plain.T, axis=1)] == query_labels)))
