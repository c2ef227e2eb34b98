"""Every registered method runs end to end through the stages on the tiny scenario, and every stored matrix entry
equals an fp64 brute force computed here from the stored features (FAN: with the stored adapters applied to the
older gallery; PSP/LSP: logits projected into the gallery model's class space). Also: herding replay, model
selection ``compatibility``, the data-level open-set guard and ``--executor ray`` dispatch."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tiny_scenario_helpers as tiny
import torch
import yaml
from safetensors.numpy import load_file

from cluster.ray import task_backend as ray_executor
from pipelines.config.load import ConfigError, validate_config
from pipelines.engine.runner import LocalExecutor
from pipelines.engine.events import StageEvent
from pipelines.graph.compile import compile_scenario
from pipelines.methods import METHODS
from pipelines.stages.feature_store import read_features
from pipelines.store.run_store import RunStore
from pipelines.training.records import TrainRecord


def run_scenario(document: dict, emit=None):
    tiny.register()
    torch.set_num_threads(1)
    config = validate_config(document)
    graph = compile_scenario(config)
    store = RunStore(document["output"]["dir"])
    executor = LocalExecutor(emit=emit) if emit is not None else LocalExecutor(progress=False)
    summary = executor.run(graph, store)
    return config, graph, store, summary


def unit_rows(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    return values / np.linalg.norm(values, axis=1, keepdims=True)


def numpy_adapter(store: RunStore, model_key: str):
    """The FAN adapter psi (Linear-ReLU-Linear) from its safetensors blob, applied in fp64 numpy."""
    weights = load_file(str(Path(store.base) / "artifacts" / model_key / "extra-adapter.safetensors"))
    w1, b1, w2, b2 = (weights[name].astype(np.float64) for name in ("0.weight", "0.bias", "2.weight", "2.bias"))
    return lambda x: np.maximum(x @ w1.T + b1, 0.0) @ w2.T + b2


def brute_force_entry(method: str, store: RunStore, graph, row: int, column: int, gallery_kind: str = "instances"
                      ) -> float:
    query, query_labels, _ = read_features(store, graph.extract_stages[(row, "query")])
    gallery, gallery_labels, _ = read_features(store, graph.extract_stages[(column, "gallery")])
    query = query.astype(np.float64)
    gallery = gallery.astype(np.float64)
    if method in ("psp", "lsp"):
        old_classes = gallery.shape[1]  # stored logits of the gallery model: its own class count

        def project(logits):
            if method == "lsp":
                return unit_rows(logits[:, :old_classes])
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs = probs / probs.sum(axis=1, keepdims=True)  # softmax over all of the model's classes
            kept = probs[:, :old_classes]
            return unit_rows(kept - kept.mean(axis=1, keepdims=True))

        query, gallery = project(query), project(gallery)
    gallery = unit_rows(gallery)
    if method == "fan":
        for task in range(column + 1, row + 1):  # psi_{k+1} first, psi_t last
            gallery = unit_rows(numpy_adapter(store, graph.model_stages[task])(gallery))
    if gallery_kind == "class_means":  # one template per class: the re-normalised mean of its unit features
        classes = np.unique(gallery_labels)
        gallery = unit_rows(np.stack([gallery[gallery_labels == c].mean(axis=0) for c in classes]))
        gallery_labels = classes
    scores = unit_rows(query) @ gallery.T
    return float(np.mean(gallery_labels[np.argmax(scores, axis=1)] == query_labels))


@pytest.mark.parametrize("method", sorted(METHODS.names()))
def test_method_runs_end_to_end_and_matrix_matches_fp64_brute_force(tmp_path, method):
    config, graph, store, summary = run_scenario(tiny.method_scenario(method, tmp_path))
    T = config.num_tasks
    values = summary.matrix["values"]
    assert len(values) == T and all(len(row) == T for row in values)
    for row in range(T):
        for column in range(T):
            if column > row:
                assert values[row][column] is None
            else:
                expected = brute_force_entry(method, store, graph, row, column)
                assert values[row][column] == pytest.approx(expected, abs=1e-12), (method, row, column)
    # `compat eval` after `compat run`: the run's own protocol computes nothing and gives the same matrix; another
    # protocol runs only its new entry nodes, through the same entry function (FAN: with the adapters)
    from app.cli import main

    before = set(store.stage_keys())
    assert (tmp_path / "matrix.json").is_file() and not (tmp_path / "report.md").exists()  # the engine: results only
    assert main(["eval", str(tmp_path)]) == 0
    assert set(store.stage_keys()) == before
    assert (tmp_path / "report.md").is_file() and (tmp_path / "matrix.png").is_file()  # the command: the reports
    assert json.loads((tmp_path / "matrix.json").read_text())["values"] == values
    assert main(["eval", str(tmp_path), "--gallery", "class_means"]) == 0
    variant = json.loads((tmp_path / "eval-recall_at_1-class_means-fine" / "matrix.json").read_text())["values"]
    for row in range(T):
        for column in range(row + 1):
            expected = brute_force_entry(method, store, graph, row, column, "class_means")
            assert variant[row][column] == pytest.approx(expected, abs=1e-12), (method, row, column)
    if method not in ("psp", "lsp"):
        # d-Simplex methods retrieve on the K-1 junction output; learnable-classifier baselines on the backbone
        # output (m = cnn4's embedding width), as the papers' reference ER
        from compat_core.models.backbones import create_backbone

        width = (config.model.num_slots - 1 if METHODS.get(method).classifier == "simplex"
                 else create_backbone("cnn4", in_chans=1, width=4).embed_dim)
        dims = {store.load_record(graph.extract_stages[(t, "gallery")])["layout"]["dim"] for t in range(T)}
        assert dims == {width}, method
    if method == "fan":
        # tasks 1 and 2 trained with an old model, so each stored an adapter; task 0 had none
        assert [bool(store.load_record(k)["extra_blobs"]) for k in graph.model_stages] == [False, True, True]
    if method in ("psp", "lsp"):
        # logits of models that learned 4, 5 and 6 classes (retrained from scratch on all data so far)
        widths = [store.load_record(graph.extract_stages[(t, "gallery")])["layout"]["dim"] for t in range(T)]
        assert widths == [4, 5, 6]
    if method == "cores":
        # every task retrains on all data seen so far
        assert [store.load_record(k)["positions_seen"] for k in graph.model_stages] == [2, 4, 6]


def test_retraining_methods_refuse_replacements(tmp_path):
    document = tiny.scenario("cores", output=str(tmp_path))
    with pytest.raises(ConfigError, match="replacements.*cores"):
        validate_config(document)


def test_herding_memory_matches_icarl_herding_on_the_trained_model(tmp_path):
    from compat_core.data.transforms import make_transforms
    from compat_core.models.compat_model import load_model
    from pipelines.stages.pools import load_pool, scenario_task_classes

    document = tiny.method_scenario("er", tmp_path, replay={"per_class": 3, "strategy": "herding"})
    config, graph, store, summary = run_scenario(document)
    record = store.load_record(graph.model_stages[0])
    stored = store.read_array(graph.model_stages[0], record["memory"]["indices_blob"])
    pool = load_pool(config.data)
    model = load_model(store.uri(record["uri"])).eval()
    labels = np.asarray(pool.labels)
    expected = []
    for class_id in scenario_task_classes(config)[0]:
        rows = np.flatnonzero(labels == class_id)
        with torch.no_grad():
            images = make_transforms(pool, train=False)(torch.from_numpy(pool.read(rows)))
            features = unit_rows(model(images).features.numpy())
        mean = features.mean(axis=0)
        running = np.zeros_like(mean)
        picked: list[int] = []
        for k in range(1, 4):  # iCaRL Alg. 4 written out: keep the running mean closest to the class mean
            distance = np.linalg.norm(mean - (running + features) / k, axis=1)
            distance[picked] = np.inf
            picked.append(int(np.argmin(distance)))
            running += features[picked[-1]]
        expected.extend(rows[picked].tolist())
    assert sorted(stored.tolist()) == sorted(expected)
    assert stored.size == 3 * len(scenario_task_classes(config)[0])


def test_compatibility_model_selection_keeps_the_best_qualifying_epoch(tmp_path):
    records: dict[str, list[TrainRecord]] = {}
    current = {"label": None}

    def emit(record):
        if isinstance(record, StageEvent) and record.status == "started":
            current["label"] = record.label
        elif isinstance(record, TrainRecord):
            records.setdefault(current["label"], []).append(record)

    document = tiny.method_scenario("dsimplex-hoc", tmp_path)
    document["training"] = {**document["training"], "epochs": 3, "model_selection": "compatibility",
                            "selection_holdout": 0.2}
    config, graph, store, summary = run_scenario(document, emit=emit)
    assert summary.matrix is not None
    checked_with_old_model = 0
    for task, key in enumerate(graph.model_stages):
        epochs = records[graph[key].label]
        assert [r.epoch for r in epochs] == [0, 1, 2]
        selves = [r.metrics["selection_self"] for r in epochs]
        if "selection_cross" in epochs[0].metrics:
            checked_with_old_model += 1
            old_self = epochs[0].metrics["selection_old_self"]
            qualifying = [e for e in range(3) if epochs[e].metrics["selection_cross"] > old_self]
        else:
            qualifying = [0, 1, 2]  # no previous model: every epoch qualifies
        expected = max(qualifying, key=lambda e: (selves[e], -e)) if qualifying else 2
        assert store.load_record(key)["training"]["selected_epoch"] == expected, task
    assert checked_with_old_model == 2  # tasks 2 and 3 (1-based) compared against an old model


def test_data_level_open_set_guard_refuses_a_leaking_test_pool(tmp_path):
    tiny.register()
    document = tiny.method_scenario("er", tmp_path)
    # another root of the same dataset: the config-level guard cannot see that the classes are the fine-tuning ones
    document["evaluation"]["query_set"] = {"dataset": "tiny-synth", "root": "elsewhere", "split": "finetune"}
    with pytest.raises(ValueError, match="open-set violation.*tiny-synth.*data.*evaluation.query_set"):
        run_scenario(document)


def test_open_set_guard_compares_ids_only_within_one_dataset(tmp_path):
    """Class ids of different datasets live in different spaces (CIFAR-100 id 3 is not CIFAR-10 id 3): a test pool
    of another dataset whose ids coincide with the training ids is not a violation."""
    from compat_core.data.datasets import DATASETS
    from pipelines.stages.pools import check_pools_open_set

    tiny.register()
    if "tiny-synth-other" not in DATASETS:  # same ids, another dataset (as CIFAR-10 next to CIFAR-100)
        DATASETS.register("tiny-synth-other", tiny.make_source)
    document = tiny.method_scenario("er", tmp_path)
    document["evaluation"]["query_set"] = {"dataset": "tiny-synth-other", "split": "finetune"}
    check_pools_open_set(validate_config(document))  # no error: ids 10..15 of two datasets are different classes


def test_run_dispatches_to_the_ray_executor(tmp_path, monkeypatch):
    tiny.register()
    calls = {}

    class FakeRayExecutor:
        def __init__(self, address=None, emit=None, progress=True, setup=None):
            calls["address"], calls["progress"] = address, progress
            assert setup is None  # no models:/ source in this config

        def run(self, graph, store):
            calls["stages"] = len(graph)
            from pipelines.engine.runner import Invocation

            return Invocation(run_id="fake")

    # `compat run` imports the Ray executor's module when --executor ray is chosen, and builds its class from there
    monkeypatch.setattr(ray_executor, "RayExecutor", FakeRayExecutor)
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(tiny.scenario("er", output=str(tmp_path / "run"))))
    from app.cli import main

    assert main(["run", str(config_path), "--executor", "ray", "--address", "ray://head:10001", "--no-progress",
                 "--tracking-uri", "none"]) == 0
    # 1 pretrain + 3 tasks + 6 extractions + 3 rows
    assert calls == {"address": "ray://head:10001", "progress": False, "stages": 13 + 6}  # + the 6 entry nodes


@pytest.mark.parametrize("method, anchored", [("dsimplex-hoc", True), ("er", False)])
def test_first_task_from_a_third_party_model_anchors_to_it(tmp_path, method, anchored):
    records: dict[str, list[TrainRecord]] = {}
    current = {"label": None}

    def emit(record):
        if isinstance(record, StageEvent) and record.status == "started":
            current["label"] = record.label
        elif isinstance(record, TrainRecord):
            records.setdefault(current["label"], []).append(record)

    document = tiny.method_scenario(method, tmp_path)
    document["initial_model"] = "pretrain:p1"
    run_scenario(document, emit=emit)
    parts = records["finetune[t=0]"][-1].loss_parts
    # HOC's InfoNCE term exists only when the stage handed it an old model (the loaded p1); ER never asks for one
    assert ("info_nce" in parts) is anchored
    assert ("sce" if method == "dsimplex-hoc" else "ce") in parts


def test_replacement_anchored_to_the_replaced_model(tmp_path):
    """``replacements[].anchor: replaced`` trains the replacement's first task against the model it replaces: the
    tasks before it are the same stages (same keys, same bytes), the replacement's weights differ from the reference
    anchor's (the loaded model), and a learnable-classifier method is refused before any stage, naming the key."""
    document = tiny.method_scenario("dsimplex-hoc", tmp_path / "loaded")
    _, loaded_graph, loaded_store, _ = run_scenario(document)
    anchored_document = tiny.method_scenario("dsimplex-hoc", tmp_path / "replaced")
    anchored_document["replacements"] = [{**anchored_document["replacements"][0], "anchor": "replaced"}]
    _, graph, store, _ = run_scenario(anchored_document)
    task = anchored_document["replacements"][0]["at_task"] - 1
    for before in range(task):
        assert graph.model_stages[before] == loaded_graph.model_stages[before]
        assert store.load_manifest(graph.model_stages[before])["blobs"] == \
            loaded_store.load_manifest(loaded_graph.model_stages[before])["blobs"]
    replaced, reference = graph.model_stages[task], loaded_graph.model_stages[task]
    assert replaced != reference
    assert store.read_blob(replaced, "model.safetensors") != loaded_store.read_blob(reference, "model.safetensors")

    er = tiny.method_scenario("er", tmp_path / "er")
    er["replacements"] = [{**er["replacements"][0], "anchor": "replaced"}]
    with pytest.raises(ValueError, match=r"replacements\[0\]\.anchor: 'replaced' needs a d-Simplex method"):
        compile_scenario(validate_config(er))
