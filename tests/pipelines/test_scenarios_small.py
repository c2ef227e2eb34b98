"""End to end on a tiny synthetic scenario: contract files, T extractions per split, T(T+1)/2 entries, eval variants."""
import json

import numpy as np
import pytest
import tiny_scenario_helpers as tiny
import torch

from pipelines.config.load import validate_config
from pipelines.engine.runner import LocalExecutor
from pipelines.graph.compile import compile_scenario
from pipelines.stages.feature_store import read_features
from pipelines.store.run_store import RunStore


@pytest.fixture(scope="module")
def hoc_run(tmp_path_factory):
    tiny.register()
    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("hoc")
    config = validate_config(tiny.scenario("dsimplex-hoc", output=str(run_dir)))
    graph = compile_scenario(config)
    summary = LocalExecutor(progress=False).run(graph, RunStore(run_dir))
    return config, graph, run_dir, summary


def test_contract_files_and_counts(hoc_run):
    config, graph, run_dir, summary = hoc_run
    T = config.num_tasks
    for name in ("config.yaml", "matrix.json", "metrics.json"):
        assert (run_dir / name).exists(), name
    store = RunStore(run_dir)
    keys = store.stage_keys()
    for split in ("query", "gallery"):
        assert sum(k.startswith("extract-") and f"-{split}-" in k for k in keys) == T
    assert sum(k.startswith("entry-") for k in keys) == T * (T + 1) // 2 == 6
    # every entry is a node of the graph, computed once in this run; each row assembles its own entries
    assert sum(k.startswith("entry-") for k in summary.executed) == 6
    rows = [store.load_record(k) for k in graph.evaluate_stages]
    assert [len(r["entry_keys"]) for r in rows] == [1, 2, 3]
    matrix = json.loads((run_dir / "matrix.json").read_text())
    assert matrix["metric"] == "recall_at_1" and matrix["protocol"]["gallery"] == "instances"
    assert matrix["values"][0][1] is None and matrix["values"][1][2] is None
    metrics = json.loads((run_dir / "metrics.json").read_text())
    C = np.array([[np.nan if v is None else v for v in row] for row in matrix["values"]])
    # metrics re-derived by hand from the stored matrix
    pairs = [(t, k) for t in range(T) for k in range(t)]
    assert metrics["AC"] == pytest.approx(sum(C[t, k] > C[k, k] for t, k in pairs) / 3)
    assert metrics["AA"] == pytest.approx(np.nansum(C) / 6)
    assert metrics["BC"] == pytest.approx(((C[2, 0] - C[0, 0]) + (C[2, 1] - C[1, 1])) / 2)
    assert len(metrics["AC_tau"]) == T and metrics["AC_tau"][0] is None


def test_entries_match_fp64_brute_force(hoc_run):
    config, graph, run_dir, _ = hoc_run
    store = RunStore(run_dir)
    matrix = json.loads((run_dir / "matrix.json").read_text())
    for t in range(config.num_tasks):
        q, ql, _ = read_features(store, graph.extract_stages[(t, "query")])
        for k in range(t + 1):
            g, gl, _ = read_features(store, graph.extract_stages[(k, "gallery")])
            q64 = q.astype(np.float64) / np.linalg.norm(q.astype(np.float64), axis=1, keepdims=True)
            g64 = g.astype(np.float64) / np.linalg.norm(g.astype(np.float64), axis=1, keepdims=True)
            expected = float(np.mean(gl[np.argmax(q64 @ g64.T, axis=1)] == ql))
            assert matrix["values"][t][k] == pytest.approx(expected, abs=1e-9)


def test_second_run_skips_everything_and_eval_variant_reuses_features(hoc_run, capsys):
    config, graph, run_dir, _ = hoc_run
    again = LocalExecutor(progress=False).run(graph, RunStore(run_dir))
    assert again.executed == [] and len(again.skipped) == len(graph)
    from app.cli import main

    before = set(RunStore(run_dir).stage_keys())
    assert main(["eval", str(run_dir), "--gallery", "class_means"]) == 0
    after = set(RunStore(run_dir).stage_keys())
    added = after - before
    # only the new protocol's entry and row nodes ran: no new extraction
    assert sum(k.startswith("entry-") for k in added) == 6 and sum(k.startswith("evaluate-") for k in added) == 3
    assert len(added) == 9
    variant = json.loads((run_dir / "eval-recall_at_1-class_means-fine" / "matrix.json").read_text())
    assert variant["protocol"]["gallery"] == "class_means"


@pytest.mark.parametrize("method", ["er", "cores"])
def test_other_method_families_run(tmp_path, method):
    tiny.register()
    document = tiny.scenario(method, output=str(tmp_path))
    if method == "cores":
        document.pop("replacements")
        document.pop("pretrain")
        document["replay"] = {"per_class": 0}
    config = validate_config(document)
    summary = LocalExecutor(progress=False).run(compile_scenario(config), RunStore(tmp_path))
    assert summary.metrics is not None and summary.metrics["AA"] is not None
    assert 0.0 <= summary.metrics["AA"] <= 1.0
