"""The linear-head bridge in the pipeline: extract stores m-dim embeddings (d = K-1 > m), entries use the exact bridge,
and the matrix equals the direct path's and an fp64 brute force over the stored embeddings and heads."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tiny_scenario_helpers as tiny
import torch

import pipelines.stages.feature_store as feature_store
import pipelines.stages.pools as pools
from pipelines.config.load import validate_config
from pipelines.engine.runner import LocalExecutor
from pipelines.graph.compile import compile_scenario, describe
from pipelines.records.payloads import JunctionRef
from pipelines.stages import bridge_features
from pipelines.stages.feature_way import feature_way
from pipelines.stages.feature_store import read_features
from pipelines.store.run_store import RunStore

NUM_SLOTS = 40          # d = 39 > m = 32 (cnn4 width 4)


@pytest.fixture(autouse=True)
def _tiny(monkeypatch):
    tiny.register()
    torch.set_num_threads(1)
    monkeypatch.setattr(pools, "_POOL_CACHE", {})
    for cache in (feature_store._HEADS, feature_store._GRAMS, feature_store._EMBEDDINGS):
        cache.clear()


def _scenario(output: Path, features: str, **evaluation) -> dict:
    scenario = tiny.scenario("dsimplex-hoc", output=str(output))
    scenario["model"]["num_slots"] = NUM_SLOTS
    scenario["evaluation"].update({"features": features, "feature_dtype": "float32", **evaluation})
    return scenario


def _run(scenario: dict) -> tuple[dict, RunStore]:
    config = validate_config(scenario)
    graph = compile_scenario(config)
    store = RunStore(scenario["output"]["dir"])
    LocalExecutor(progress=False).run(graph, store)
    return graph, store


def _matrix(store: RunStore) -> list[list[float]]:
    values = json.loads(Path(store.root, "matrix.json").read_text())["values"]
    return [row[:t + 1] for t, row in enumerate(values)]      # C[t, k] for k <= t (the rest is undefined)


def _brute_force_recall(store: RunStore, graph) -> list[list[float]]:
    """Recall@1 from the stored embeddings and the models' junction weights, features A h and cosines in fp64,
    top-1 by (score desc, lowest index)."""
    from safetensors.torch import load

    def features(key: str):
        record = store.load_record(key)
        layout = record["layout"]
        embeddings = np.concatenate([store.read_array(key, name) for name in layout["shards"]]).astype(np.float64)
        head = load(store.read_blob(record["model_stage_key"], "model.safetensors"))["junction.weight"].double()
        values = embeddings @ head.numpy().T
        return values / np.linalg.norm(values, axis=1, keepdims=True), store.read_array(key, "labels.npy")

    rows = []
    for t in range(len(graph.model_stages)):
        q, q_labels = features(graph.extract_stages[(t, "query")])
        row = []
        for k in range(t + 1):
            g, g_labels = features(graph.extract_stages[(k, "gallery")])
            scores = q @ g.T
            best = np.argmax(scores, axis=1)        # first maximum: the lowest gallery index among exact ties
            row.append(float(np.mean(g_labels[best] == q_labels)))
        rows.append(row)
    return rows


def test_bridge_matrix_equals_direct_and_fp64_brute_force(tmp_path):
    graph, store = _run(_scenario(tmp_path / "bridge", "auto"))
    _, direct_store = _run(_scenario(tmp_path / "direct", "direct"))
    # auto took the bridge: embeddings of m = 32 stored, the head referenced in the model's weights
    for (task, split), key in graph.extract_stages.items():
        layout = store.load_record(key)["layout"]
        assert (layout["way"], layout["dim"], layout["feature_dim"]) == ("bridge", 32, NUM_SLOTS - 1)
        assert layout["head"]["stage_key"] == graph.model_stages[task]
    entries = [store.load_record(s.key) for s in graph if s.kind == "entry"]
    assert {e["features"]["way"] for e in entries} == {"bridge"}
    assert {e["features"]["kernel"] for e in entries} == {"bridged_recall_at_1"}
    assert {e["features"]["device"] for e in entries} == {"cpu"}  # the stages' device: this run's config says cpu
    bridged = _matrix(store)
    assert bridged == _brute_force_recall(store, graph)
    assert bridged == _matrix(direct_store)
    # the direct run stored d-dim features; the bridge extract reads back as the same features (A h)
    direct_graph = compile_scenario(validate_config(_scenario(tmp_path / "direct", "direct")))
    for slot, key in graph.extract_stages.items():
        direct_key = direct_graph.extract_stages[slot]
        assert direct_store.load_record(direct_key)["layout"]["way"] == "direct"
        stored, labels, _ = read_features(direct_store, direct_key)
        materialised, labels_b, _ = read_features(store, key)
        assert stored.shape == materialised.shape == (len(labels), NUM_SLOTS - 1)
        np.testing.assert_array_equal(labels, labels_b)
        cosine = np.sum(stored * materialised, 1) / np.linalg.norm(stored, axis=1) / np.linalg.norm(materialised,
                                                                                                     axis=1)
        assert cosine.min() > 1 - 1e-5       # same model, same images: the same feature directions


@pytest.mark.parametrize("evaluation", [{"metric": "map"}, {"gallery": "class_means"},
                                        {"metric": "verification", "verification_pairs": 40}])
def test_other_metrics_through_isometric_coordinates_equal_direct(tmp_path, evaluation):
    graph, store = _run(_scenario(tmp_path / "bridge", "bridge", **evaluation))
    _, direct_store = _run(_scenario(tmp_path / "direct", "direct", **evaluation))
    entries = [store.load_record(s.key) for s in graph if s.kind == "entry"]
    assert {e["features"]["way"] for e in entries} == {"bridge"}
    assert all(e["features"]["kernel"].startswith("isometric coordinates") for e in entries)
    for bridged_row, direct_row in zip(_matrix(store), _matrix(direct_store), strict=True):
        np.testing.assert_allclose(bridged_row, direct_row, rtol=0, atol=1e-12)


def test_isometric_coordinates_preserve_inner_products(tmp_path):
    """(L_t q).(L_k g) = (A_t q).(A_k g) in fp64 for random heads of different widths."""
    from safetensors.torch import save

    rng = np.random.default_rng(0)
    store = RunStore(tmp_path)
    heads = {"a": torch.from_numpy(rng.normal(size=(50, 8))).float(),
             "b": torch.from_numpy(rng.normal(size=(50, 12))).float()}
    for key, head in heads.items():
        store.commit(key, {"type": "model"}, {"model.safetensors": save({"junction.weight": head})})
    ref = {key: JunctionRef(key, "model.safetensors", "junction.weight") for key in heads}
    to_q, to_g = bridge_features.isometric_coordinates(store, ref["a"], ref["b"])
    q, g = torch.from_numpy(rng.normal(size=(5, 8))), torch.from_numpy(rng.normal(size=(7, 12)))
    expected = (q @ heads["a"].double().t()) @ (g @ heads["b"].double().t()).t()
    torch.testing.assert_close((q @ to_q.t()) @ (g @ to_g.t()).t(), expected, rtol=1e-10, atol=1e-10)
    same_q, same_g = bridge_features.isometric_coordinates(store, ref["b"], ref["b"])
    assert same_q.shape[0] <= 12
    norms = torch.linalg.vector_norm(g @ same_g.t(), dim=1)
    torch.testing.assert_close(norms, torch.linalg.vector_norm(g @ heads["b"].double().t(), dim=1), rtol=1e-10,
                               atol=0)


def test_fan_adapters_fall_back_to_direct_features(tmp_path):
    """auto keeps FAN on direct features; an explicit bridge materialises d-dim features where an adapter applies."""
    scenario = _scenario(tmp_path / "fan", "bridge")
    scenario["method"] = {"name": "fan", "params": {"adapter_hidden": 8}}
    scenario["model"]["head"] = "junction"      # FAN's learnable classifier on the junction: a bridge is possible
    graph, store = _run(scenario)
    ways = {(e["row"], e["column"]): e["features"]["way"] for e in (store.load_record(s.key) for s in graph
                                                                      if s.kind == "entry")}
    assert ways[(1, 0)] == "materialized" and ways[(0, 0)] == "bridge"
    auto = validate_config(_scenario(tmp_path / "auto", "auto") | {"method": {"name": "fan", "params": {}}})
    way, reason = feature_way(auto.evaluation.features, auto.method.name, "junction", NUM_SLOTS - 1,
                                              32)
    assert way == "direct" and "fan" in reason


def test_feature_way_rules():
    config = validate_config(_scenario(Path("unused"), "auto"))
    method = config.method.name
    assert feature_way("auto", method, "junction", 39, 32)[0] == "bridge"
    assert feature_way("auto", method, "junction", 9, 32)[0] == "direct"       # d <= m: nothing saved
    assert feature_way("auto", method, "backbone", 32, 32)[0] == "direct"
    with pytest.raises(ValueError, match="evaluation.features: 'bridge' is not possible"):
        feature_way("bridge", method, "backbone", 32, 32)
    # refused when the config is loaded, before anything trains
    baseline = _scenario(Path("unused"), "bridge")
    baseline["method"] = {"name": "er", "params": {}}
    with pytest.raises(ValueError, match="model has no junction"):
        compile_scenario(validate_config(baseline))
    assert feature_way("direct", method, "junction", 39, 32) == ("direct",
                                                                                "evaluation.features: direct")


def test_plan_reports_both_ways_for_celeba():
    from pipelines.config.load import load_config

    config = load_config(Path(__file__).parents[2] / "configs" / "iam-cl2r-celeba-dinov3-t16.yaml")
    text = describe(compile_scenario(config))
    assert "features: bridge (d=21999 > m=768)" in text
    assert "storage per image per model: direct 43998 B (d=21999), bridge 1536 B (m=768" in text


def test_plan_similarity_cost_both_ways_hand_computed():
    """30 query x 30 gallery rows, d = 39, m = 32: direct 2*30*30*39 FLOPs; bridge 4*d*m^2 (two m x m head
    products) + 2*Ng*m^2 (gallery map) + 2*Nq*Ng*m (search)."""
    scenario = _scenario(Path("unused"), "auto")
    scenario["evaluation"]["query_set"]["num_samples"] = 30
    scenario["evaluation"]["gallery_set"]["num_samples"] = 30
    text = describe(compile_scenario(validate_config(scenario)))
    direct = 2 * 30 * 30 * 39
    bridge = 4 * 39 * 32 * 32 + 2 * 30 * 32 * 32 + 2 * 30 * 30 * 32
    assert f"similarity cost per entry: direct {direct:.3e} FLOPs, bridge {bridge:.3e} FLOPs" in text
    assert "features: bridge (d=39 > m=32)" in text
