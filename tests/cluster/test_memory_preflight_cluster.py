"""The memory preflight of stages that run on Ray: `compat run --executor ray` and `compat tune` refuse a config
whose training stage cannot fit the memory Ray reports for the node that would hold it, before any stage or trial
starts, with exit 2 naming ``model.num_slots``, the estimate and what it was compared with (a real local Ray)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

from app.cli import main  # noqa: E402

GIB = float(1 << 30)
HUGE = "model.num_slots=100000000"
# junction 32 x 99999999 fp32 floats alone: 99999999 * 32 * 4 bytes = 11.92 GiB of parameters (hand-worked)
PARAMETERS = "parameters 11.92"


def _config(tmp_path) -> str:
    tiny.register()
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny.scenario("dsimplex-hoc", output=str(tmp_path / "run"))))
    return str(path)


def _node_memory_gib(ray) -> str:
    """What the check must name: the `memory` total Ray reports for the one node of the test's instance."""
    nodes = [node for node in ray.nodes() if node["Alive"]]
    assert len(nodes) == 1
    return f"{nodes[0]['Resources']['memory'] / GIB:.2f} GiB of the `memory` resource Ray reports for it"


def test_compat_run_on_ray_refuses_a_huge_num_slots_before_any_stage(ray_local, tmp_path, capsys):
    code = main(["run", _config(tmp_path), "--executor", "ray", "--no-progress", "--tracking-uri", "none",
                 "--set", HUGE])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "model.num_slots=100000000 with training.batch_size=8" in err and PARAMETERS in err
    assert "but the largest Ray node that can hold the stage (127.0.0.1, of 1) has " in err
    assert _node_memory_gib(ray_local) in err
    manifests = tmp_path / "run" / "manifests"
    assert not manifests.exists() or not list(manifests.iterdir())  # no stage ran


@pytest.mark.parametrize("sampled", [False, True])
def test_compat_tune_refuses_a_huge_num_slots_before_any_trial(ray_local, tmp_path, capsys, sampled):
    """The base config (``--set``) and a value only the space samples are both checked, before search.json or the
    search's MLflow run exist."""
    space = {"parameters": {"training.optimizer.lr": {"type": "loguniform", "low": 0.01, "high": 0.1}}}
    overrides = ["--set", HUGE]
    if sampled:
        space["parameters"]["model.num_slots"] = {"type": "categorical", "values": [10, 100000000]}
        overrides = []
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = main(["tune", _config(tmp_path), "--space", str(tmp_path / "space.yaml"), "--samples", "2",
                 "--storage", str(tmp_path / "searches"), "--name", "huge", "--tracking-uri", store, *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "model.num_slots=100000000 with training.batch_size=8" in err and PARAMETERS in err
    assert _node_memory_gib(ray_local) in err
    assert not (tmp_path / "searches" / "huge").exists()  # nothing written: no search.json, no trial folder
    from mlflow import MlflowClient

    assert [e.name for e in MlflowClient(store).search_experiments()] in ([], ["Default"])
