"""`compat compare SEARCH_DIR`: the top trials of a `compat tune` search directory, each read as the run's
RunResult, named by trial and parameters and ordered by the search's objective (hand-made search folder)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import yaml

from cluster.tune.runner import load_search_summaries
from cluster.tune.spec import RUNS_FOLDER, SEARCH_FILE, TRIAL_FILE, SearchSpec
from compat_core.evaluation.metrics import CompatibilityMatrix
from pipelines.reports.compare import compare_table_markdown

NAN = float("nan")


def _trial(root: Path, name: str, matrix: list, aca: float | None, lr: float) -> None:
    folder = root / RUNS_FOLDER / name
    folder.mkdir(parents=True)
    values = np.array(matrix, dtype=float)
    record = CompatibilityMatrix(values, [f"task-{t + 1}" for t in range(len(matrix))], "recall_at_1",
                                 {"gallery": "instances", "strict": True})
    (folder / "matrix.json").write_text(record.to_json())
    summary = record.summary()
    metrics = {key: (None if math.isnan(summary[key]) else summary[key]) for key in ("AC", "AA", "ACA", "BC", "FC")}
    assert metrics["ACA"] == aca  # the hand-worked ACA below is the one the matrix gives
    curves = {"AC_tau": [None] + [metrics["AC"]] * (len(matrix) - 1), "AA_tau": [matrix[0][0], metrics["AA"]]}
    (folder / "metrics.json").write_text(json.dumps({"units": "fraction", **metrics, **curves}))
    (folder / "config.yaml").write_text(yaml.safe_dump({"name": "tiny", "method": {"name": "er"}}))
    (folder / TRIAL_FILE).write_text(json.dumps({"params": {"training.optimizer.lr": lr}}))


def test_a_search_directory_lists_its_trials_best_objective_first(tmp_path):
    spec = SearchSpec(name="s1", base_config={}, space={}, objective="ACA", storage=str(tmp_path))
    root = tmp_path / "s1"
    root.mkdir()
    (root / SEARCH_FILE).write_text(spec.to_json())
    # ACA = (compatible cross-tests summed over pairs) / pairs: trial a: 0.6 > 0.5 -> 0.6; trial b: 0.4 < 0.5 -> 0
    _trial(root, "a", [[0.5, NAN], [0.6, 0.7]], 0.6, 0.1)
    _trial(root, "b", [[0.5, NAN], [0.4, 0.7]], 0.0, 0.05)
    (root / RUNS_FOLDER / "stopped").mkdir()  # stopped early: no metrics.json, not compared
    runs = load_search_summaries(root)
    assert [run.name for run in runs] == ["trial a (lr=0.1)", "trial b (lr=0.05)"]
    assert [run.display_name for run in runs] == [run.name for run in runs]
    assert math.isclose(runs[0].headline["ACA"], 0.6) and runs[1].headline["ACA"] == 0.0
    assert runs[0].source == str(root / RUNS_FOLDER / "a") and runs[0].method == "er"
    table = compare_table_markdown(runs)
    assert "| trial a (lr=0.1) | er | 2 |" in table
