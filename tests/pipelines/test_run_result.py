"""pipelines.results.assemble.RunResult as it travels without the store (a Tune trial's last report) and as a Ray Job's
driver reads it back from the run folder: the same matrix.json and metrics.json texts, byte for byte."""
from __future__ import annotations

import json

import numpy as np
import pytest

from compat_core.evaluation.metrics import CompatibilityMatrix
from pipelines.results.assemble import RunResult, read_result, write_result
from pipelines.store.run_store import RunStore

# C[t, k] with exact binary fractions; strict ECC: (1,0) 0.625 > 0.5 yes, (2,0) 0.375 no, (2,1) 0.875 > 0.75 yes
VALUES = [[0.5, np.nan, np.nan], [0.625, 0.75, np.nan], [0.375, 0.875, 1.0]]


def _result() -> RunResult:
    matrix = CompatibilityMatrix(np.array(VALUES), ["task-1", "task-2", "task-3"], "recall_at_1",
                                 {"gallery": "instances", "strict": True})
    return RunResult.of(matrix, strict=True)


def test_run_result_round_trips_through_its_json_text_and_the_run_folder(tmp_path):
    result = _result()
    assert result.metrics["AC"] == pytest.approx(2 / 3) and result.metrics["AA"] == pytest.approx(4.125 / 6)
    again = RunResult.from_json(result.to_json())
    assert again.matrix_json() == result.matrix_json() and again.metrics_json() == result.metrics_json()
    store = RunStore(tmp_path)
    write_result(store, result)
    read = read_result(store)
    assert read.matrix_json() == (tmp_path / "matrix.json").read_text() == result.matrix_json()
    assert read.metrics_json() == (tmp_path / "metrics.json").read_text() == result.metrics_json()
    assert json.loads(result.to_json())["matrix"]["values"][0] == [0.5, None, None]


def test_run_result_text_that_is_not_one_names_what_was_expected(tmp_path):
    with pytest.raises(ValueError, match="run result: expected the JSON text of RunResult.to_json"):
        RunResult.from_json(None)
    with pytest.raises(ValueError, match="run result: expected"):
        RunResult.from_json(json.dumps({"matrix": {}}))
    with pytest.raises(FileNotFoundError, match="matrix.json"):
        read_result(RunStore(tmp_path))
