"""`compat run` tracks every run in MLflow by default (SQLite in the run directory), and 'none' turns it off."""
from __future__ import annotations

import json

import tiny_scenario_helpers as tiny
import yaml

from app.cli import main


def _write_config(tmp_path, method="dsimplex-hoc"):
    tiny.register()
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny.scenario(method)))
    return path


def test_run_tracks_in_the_machine_sqlite_store_by_default(tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    config = _write_config(tmp_path)
    run_dir = tmp_path / "runs" / "hoc"
    assert main(["run", str(config), "--output", str(run_dir), "--no-progress"]) == 0

    # the machine's one store (COMPAT_HOME: a folder of this test's own, see conftest), never the run folder
    database = tmp_path / "compat-home" / "mlflow" / "mlflow.db"
    assert database.exists() and not (run_dir / "mlflow.db").exists() and not (tmp_path / "runs" / "mlflow.db").exists()
    assert f"MLflow: sqlite:///{database.resolve()} (experiment tiny-dsimplex-hoc" in capsys.readouterr().out
    client = MlflowClient(tracking_uri=f"sqlite:///{database}")
    experiment = client.get_experiment_by_name("tiny-dsimplex-hoc")
    runs = client.search_runs([experiment.experiment_id], max_results=200)
    parents = [run for run in runs if run.data.tags.get("run_role") == "pipeline"]
    stages = [run for run in runs if run.data.tags.get("run_role") == "stage"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    # one nested run per stage of the graph, each pointing at the parent
    manifests = list((run_dir / "manifests").glob("*.json"))
    stage_keys = {json.loads(path.read_text())["stage_key"] for path in manifests}
    assert {run.data.tags["stage_key"] for run in stages} >= {key for key in stage_keys if not key.startswith("entry")}
    assert all(run.data.tags["mlflow.parentRunId"] == parent.info.run_id for run in stages)
    # the scalar metrics logged on the parent equal metrics.json (fractions)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for name in ("AA",):
        assert abs(parent.data.metrics[name] - metrics[name]) < 1e-12
    # the reports `compat run` wrote into the run folder are logged with the results
    results = {artifact.path for artifact in client.list_artifacts(parent.info.run_id, "results")}
    assert {"results/report.md", "results/matrix.png", "results/metrics.json"} <= results, results
    # a model version per model stage: 3 fine-tuned/replaced tasks + the third-party model
    name = parent.data.tags.get("registered_model") or next(
        model.name for model in client.search_registered_models())
    versions = client.search_model_versions(f"name='{name}'")
    assert len(versions) == 4
    assert client.get_model_version_by_alias(name, "task-3").tags["external_source"] == "pretrain:p1"
    # an ER run kept in the same folder lands in the same store: both are in one MLflow UI; MLFLOW_EXPERIMENT_NAME
    # (like --experiment) names its experiment
    er_config = tmp_path / "er.yaml"
    er_config.write_text(yaml.safe_dump(tiny.scenario("er")))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tiny-compare")
    assert main(["run", str(er_config), "--output", str(tmp_path / "runs" / "er"), "--no-progress",
                 "--set", "tasks.spec=2+2", "--set", "replacements=[]"]) == 0
    scenarios = sorted(run.data.tags["scenario"] for run in client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "tags.run_role = 'pipeline'"))
    assert scenarios == ["tiny-dsimplex-hoc", "tiny-er"]
    er_parent = client.search_runs([client.get_experiment_by_name("tiny-compare").experiment_id],
                                   "tags.run_role = 'pipeline'")
    assert [run.data.tags["scenario"] for run in er_parent] == ["tiny-er"]


def test_tracking_none_writes_no_database(tmp_path):
    config = _write_config(tmp_path, "er")
    run_dir = tmp_path / "run"
    assert main(["run", str(config), "--output", str(run_dir), "--no-progress", "--tracking-uri", "none"]) == 0
    assert (run_dir / "metrics.json").exists()
    assert not (run_dir / "mlflow.db").exists() and not (tmp_path / "mlflow.db").exists()


def test_bad_tracking_uri_is_refused_before_any_compute(tmp_path, capsys):
    config = _write_config(tmp_path, "er")
    run_dir = tmp_path / "run"
    assert main(["run", str(config), "--output", str(run_dir), "--tracking-uri", "mysql://nope"]) == 2
    assert "tracking" in capsys.readouterr().err
    assert not (run_dir / "manifests").exists()
