"""Architecture upgrade (IAM-CL2R's variant): the replacement model has another backbone and embedding size, yet it
shares the fixed d-Simplex interface, so the pipeline trains, evaluates and fills the whole matrix across it."""
from __future__ import annotations

import json

import numpy as np
import tiny_scenario_helpers as tiny
import torch

from compat_core.models.compat_model import load_model
from compat_core.retrieval.search import recall_at_1
from pipelines.config.load import validate_config
from pipelines.engine.runner import LocalExecutor
from pipelines.graph.compile import compile_scenario
from pipelines.stages.feature_store import read_features
from pipelines.store.run_store import RunStore


def test_replacement_with_another_backbone_runs_end_to_end(tmp_path):
    tiny.register()
    torch.set_num_threads(1)
    doc = tiny.scenario("dsimplex-hoc", output=str(tmp_path))
    # the third-party model that enters at task 3 is a LeNet++-style net (m = 2 by default; here 16) instead of cnn4
    doc["pretrain"][0].update({"backbone": "lenetpp", "backbone_config": {"in_chans": 1, "embed_dim": 16,
                                                                            "img_size": 16}})
    doc["replacements"][0].update({"backbone": "lenetpp", "backbone_config": {"in_chans": 1, "embed_dim": 16,
                                                                               "img_size": 16}})
    config = validate_config(doc)
    graph = compile_scenario(config)
    store = RunStore(tmp_path)
    LocalExecutor(progress=False).run(graph, store)

    # tasks 1-2 train cnn4 models, task 3 on the replacement's LeNet++ (embedding 16); all share K - 1 features
    models = [load_model(store.uri(store.load_record(key)["uri"])) for key in graph.model_stages]
    assert [model.config["backbone"] for model in models] == ["cnn4", "cnn4", "lenetpp"]
    assert models[2].backbone.embed_dim == 16 and models[0].backbone.embed_dim != 16
    assert {model.feature_dim for model in models} == {config.model.num_slots - 1}

    matrix = json.loads((tmp_path / "matrix.json").read_text())
    values = matrix["values"]
    assert len(values) == 3 and all(v is not None for row in range(3) for v in values[row][: row + 1])
    # every entry, including the cross-architecture ones, equals an fp64 brute force over the stored features
    for row in range(3):
        query, query_labels, _ = read_features(store, graph.extract_stages[(row, "query")])
        assert query.shape[1] == config.model.num_slots - 1
        for column in range(row + 1):
            gallery, gallery_labels, _ = read_features(store, graph.extract_stages[(column, "gallery")])
            q = query.astype(np.float64)
            g = gallery.astype(np.float64)
            q /= np.linalg.norm(q, axis=1, keepdims=True)
            g /= np.linalg.norm(g, axis=1, keepdims=True)
            nearest = np.argmax(q @ g.T, axis=1)
            expected = float(np.mean(gallery_labels[nearest] == query_labels))
            assert abs(values[row][column] - expected) < 1e-12
            assert abs(values[row][column] - recall_at_1(query, query_labels, gallery, gallery_labels)) < 1e-12
