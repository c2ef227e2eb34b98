"""`compat tune`: Ray Tune + Optuna over the tiny scenario, MLflow runs per trial, best model alias, compare, resume.

The tiny scenario (tests/pipelines/tiny_scenario_helpers.py) reaches the trial processes as a plugin file.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "pipelines" / "tiny_scenario_helpers.py"
sys.path.insert(0, str(TINY.parent))
import tiny_scenario_helpers as tiny  # noqa: E402

PLUGIN = f"{TINY}:register"
SPACE = {"parameters": {
    "method.params.lam": {"type": "categorical", "values": [0.0, 0.1, 1.0]},
    "training.optimizer.lr": {"type": "loguniform", "low": 0.001, "high": 0.1},
}}


def _base_config() -> dict:
    from pipelines.config.load import config_to_dict, validate_config

    tiny.register()
    return config_to_dict(validate_config(tiny.scenario("dsimplex-hoc", {"lam": 0.1, "rho": 10.0})))


def _matrix(run_dir: Path) -> np.ndarray:
    data = json.loads((run_dir / "matrix.json").read_text())
    return np.array([[np.nan if v is None else v for v in row] for row in data["values"]], dtype=np.float64)


def _mean_lower(block: np.ndarray) -> float:
    """AA by brute force: mean of the lower triangle with the diagonal."""
    values = [block[t, k] for t in range(block.shape[0]) for k in range(t + 1)]
    return float(sum(values) / len(values))


def test_search_tracks_every_trial_and_registers_the_best(ray_local, tmp_path, capsys):
    from mlflow import MlflowClient

    from app.cli import main
    from cluster.tracking.store import resolve_tracking
    from cluster.tune.runner import run_search
    from cluster.tune.spec import SearchSpec

    spec = SearchSpec(name="tiny-aa", base_config=_base_config(), space=SPACE, objective="AA", samples=3,
                      concurrent=2, scheduler="none", seed=1, storage=str(tmp_path / "searches"),
                      resources={"cpu": 0.5, "gpu": 0.0}, plugins=[PLUGIN],
                      tracking_uri=resolve_tracking(None).uri)  # what `compat tune` resolves without the option
    outcome = run_search(spec)
    printed = capsys.readouterr().out
    assert outcome.complete and len(outcome.trials) == 3
    experiment = tmp_path / "searches" / "tiny-aa"
    expected = {}
    for trial in outcome.trials:
        run_dir = experiment / "runs" / trial.trial_id
        matrix = _matrix(run_dir)
        assert matrix.shape == (3, 3)
        expected[trial.trial_id] = _mean_lower(matrix)
        assert trial.objective == pytest.approx(expected[trial.trial_id], abs=1e-12)
        assert trial.tasks_completed == 3 and trial.status == "FINISHED"
        # every stage ran exactly once across the per-task invocations
        executed = [key for path in (run_dir / "executions").iterdir()
                    for key in json.loads(path.read_text())["executed"]]
        stages = [path.stem for path in (run_dir / "manifests").glob("*.json")]
        assert len(stages) == 19  # 1 pretrain, 3 fine-tune/replace, 6 extract, 6 matrix entries, 3 evaluate
        assert sorted(executed) == sorted(stages)
    best_id = max(expected, key=expected.get)
    assert outcome.best.trial_id == best_id
    for trial_id, value in expected.items():  # a line per trial report, with the objective it reported
        assert re.search(rf"^\[search \d+ s\] trial {trial_id} \(lam=.*\): task 3/3 reported, AA {value:.4f}$",
                         printed, flags=re.M), printed
        assert re.search(rf"^\[search \d+ s\] trial {trial_id} .*: finished$", printed, flags=re.M), printed

    client = MlflowClient(tracking_uri=spec.tracking_uri)  # the machine's store (conftest: this test's own)
    assert spec.tracking_uri == f"sqlite:///{tmp_path / 'compat-home' / 'mlflow' / 'mlflow.db'}"
    parent = client.get_run(spec.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["run_role"] == "search"
    children = client.search_runs([parent.info.experiment_id], "tags.run_role = 'trial'")
    assert sorted(run.data.tags["trial_id"] for run in children) == sorted(expected)
    for run in children:
        trial_id = run.data.tags["trial_id"]
        assert run.data.tags["mlflow.parentRunId"] == spec.parent_run_id and run.info.status == "FINISHED"
        sampled = json.loads((experiment / "runs" / trial_id / "trial.json").read_text())["params"]
        assert {k: float(v) for k, v in run.data.params.items()} == pytest.approx(sampled)
        history = client.get_metric_history(run.info.run_id, "objective")
        matrix = _matrix(experiment / "runs" / trial_id)
        # AA is defined from the first task: one value per task, step = tasks completed
        assert [m.step for m in sorted(history, key=lambda m: m.step)] == [1, 2, 3]
        for metric in history:
            assert metric.value == pytest.approx(_mean_lower(matrix[: metric.step, : metric.step]), abs=1e-12)
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "results")}
        assert {"results/matrix.json", "results/metrics.json"} <= artifacts
        # named by its sampled values and final objective; only the best trial tagged best=true
        shown = ", ".join(f"{key.rsplit('.', 1)[-1]}={value:.4g}" for key, value in sorted(sampled.items()))
        assert run.info.run_name == f"trial-{trial_id} ({shown}) | AA {expected[trial_id]:.3f}"
        assert run.data.tags.get("best") == ("true" if trial_id == best_id else None)
    assert parent.info.run_name == f"tiny-aa | best AA {expected[best_id]:.3f}"
    best = client.get_model_version_by_alias("tiny-aa", "best")
    assert best.tags["trial_id"] == best_id and best.tags["task_1based"] == "3"
    assert client.get_model_version_by_alias("tiny-aa", "best-task-1").tags["trial_id"] == best_id
    # logged as MLflow's pyfunc flavour written as code: the best model loads by alias, with the best trial's weights
    import mlflow.pyfunc
    import torch
    from safetensors.torch import load_file

    from pipelines.store.run_store import RunStore

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", client.tracking_uri)
        loaded = mlflow.pyfunc.load_model("models:/tiny-aa@best").unwrap_python_model().model
    store = RunStore(experiment / "runs" / best_id)
    weights = load_file(str(store.blob_path(best.tags["stage_key"], "model.safetensors")))
    assert all(torch.equal(loaded.state_dict()[key], value) for key, value in weights.items())

    capsys.readouterr()
    assert main(["compare", str(experiment), "--output", str(tmp_path / "compare")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| trial ")]
    shown = [line.split()[2] for line in lines]
    assert shown == sorted(expected, key=expected.get, reverse=True)
    # AA column (percent, 2 decimals) of the first row is the best trial's brute-force AA
    assert lines[0].split("|")[5].strip() == f"{100 * expected[best_id]:.2f}"


def _runs_done(runs_root: str) -> int:
    """Trials whose pipeline finished (metrics.json written) under ``runs_root`` (local path or s3:// URI)."""
    from compat_core import io as cio

    if not cio.is_dir(runs_root):
        return 0
    return sum(1 for name in cio.list_dir(runs_root) if cio.exists(f"{runs_root}/{name}/metrics.json"))


def _executed(runs_root: str, name: str) -> list[str]:
    """Stage keys executed by every invocation recorded in a trial's run directory (a stage run twice appears twice)."""
    from compat_core import io as cio

    folder = f"{runs_root}/{name}/executions"
    return sorted(key for record in cio.list_dir(folder)
                  for key in json.loads(cio.read_bytes(f"{folder}/{record}"))["executed"])


@pytest.fixture(params=["local", "s3"])
def search_storage(request, tmp_path):
    """Where the interrupted search lives: a local folder, or a bucket on the real SeaweedFS S3 server."""
    if request.param == "local":
        yield str(tmp_path / "searches")
        return
    from cluster.storage.s3 import object_storage

    bucket = request.getfixturevalue("s3_bucket")
    with object_storage():
        yield f"s3://{bucket}/searches"


def test_interrupted_search_resumes_to_the_requested_total(search_storage, tmp_path):
    samples = 6
    from compat_core import io as cio

    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(tiny.scenario("dsimplex-hoc", {"lam": 0.1, "rho": 10.0})))
    space_path = tmp_path / "space.yaml"
    space_path.write_text(yaml.safe_dump(SPACE, sort_keys=False))
    experiment = f"{search_storage}/resumable"
    runs_root = f"{experiment}/runs"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = [sys.executable, "-m", "app.cli", "tune", str(config_path), "--space", str(space_path),
               "--samples", str(samples), "--concurrent", "1", "--objective", "aa", "--storage", search_storage,
               "--name", "resumable", "--plugin", PLUGIN, "--cpus-per-trial", "1", "--tracking-uri", tracking]
    log_path = tmp_path / "first.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        while _runs_done(runs_root) < 2:
            assert process.poll() is None, f"search ended before the interruption:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"2 trials not done in time:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        process.send_signal(signal.SIGINT)  # Ctrl+C: Tune saves the experiment and searcher state, then stops
        assert process.wait(timeout=90) == 1, log_path.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    assert "INTERRUPTED" in log_path.read_text()

    finished_before = {name for name in cio.list_dir(runs_root) if cio.exists(f"{runs_root}/{name}/metrics.json")}
    executed_before = {name: _executed(runs_root, name) for name in finished_before}
    # Under load Tune may finish another trial or two while it handles Ctrl+C; 6 samples leave room for that.
    assert 2 <= len(finished_before) < samples

    resumed = subprocess.run([sys.executable, "-m", "app.cli", "tune", "--resume", experiment, "--plugin", PLUGIN],
                             cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"search resumable: {samples} of {samples} trials" in resumed.stdout

    trials = sorted(cio.list_dir(runs_root))
    assert len(trials) == samples
    for name in trials:
        executed = _executed(runs_root, name)
        assert len(executed) == len(set(executed)), f"trial {name} ran a stage twice"
    for name in finished_before:  # completed before the interruption: none of their stages ran again
        assert _executed(runs_root, name) == executed_before[name]


def test_trials_share_third_party_models_whose_key_the_sampled_values_leave_alone(tmp_path, capsys):
    """Two trials that differ only in a method parameter need the same third-party model: the first trains and
    publishes it in <experiment>/third-party, the second copies it (no pretrain stage executed) and computes the
    matrix a trial training its own copy computes."""
    from cluster.tune.spec import SearchSpec
    from cluster.tune.trial import run_trial_pipeline
    from pipelines.store.run_store import RunStore

    spec = SearchSpec(name="shared", base_config=_base_config(), space=SPACE, objective="AA", samples=2,
                      scheduler="none", storage=str(tmp_path / "searches"), plugins=[PLUGIN])
    runs = tmp_path / "searches" / "shared" / "runs"
    for trial_id, lam in (("t1", 0.0), ("t2", 1.0)):
        run_trial_pipeline(spec, {"method.params.lam": lam, "training.optimizer.lr": 0.01}, trial_id,
                           report=lambda metrics, tasks: None)
        # the trial's stage lines (which Ray forwards to the search's driver) say which trial they belong to, once
        # per stage although each task's invocation of the engine passes the earlier tasks' stages again
        lines = capsys.readouterr().err
        assert re.search(rf"^\[trial {trial_id}\] \[\d+/\d+\] finetune\S*: done in", lines, flags=re.M)
        assert len(re.findall(r"^\[trial \w+\] \[\d+/\d+\] finetune\[t=0\]: done", lines, flags=re.M)) == 1
        assert ": skipped" not in lines
    pretrain = {name: sorted(p.stem for p in (runs / name / "manifests").glob("pretrain-*.json"))
                for name in ("t1", "t2")}
    assert pretrain["t1"] == pretrain["t2"] and len(pretrain["t1"]) == 1
    assert RunStore(tmp_path / "searches" / "shared" / "third-party").stage_keys() == pretrain["t1"]
    assert pretrain["t1"][0] in _executed(str(runs), "t1")
    assert pretrain["t1"][0] not in _executed(str(runs), "t2")
    for name in ("t1", "t2"):  # a complete trial's run folder has its reports (the search's tracking logs them)
        assert {"matrix.json", "metrics.json", "report.md", "matrix.png"} <= {p.name for p in (runs / name).iterdir()}
    # a search without the shared folder (its base config names another store) trains its own: same matrix
    base = _base_config()
    base["output"]["shared_store"] = str(tmp_path / "elsewhere")
    alone = SearchSpec(name="alone", base_config=base, space=SPACE, objective="AA", samples=1,
                       scheduler="none", storage=str(tmp_path / "searches"), plugins=[PLUGIN])
    run_trial_pipeline(alone, {"method.params.lam": 1.0, "training.optimizer.lr": 0.01}, "t2",
                       report=lambda metrics, tasks: None)
    assert RunStore(tmp_path / "elsewhere").stage_keys() == pretrain["t1"]
    assert not (tmp_path / "searches" / "alone" / "third-party").exists()
    np.testing.assert_array_equal(_matrix(tmp_path / "searches" / "alone" / "runs" / "t2"), _matrix(runs / "t2"))


def test_a_trial_completes_its_whole_graph_and_reports_its_result(tmp_path):
    """A scenario that declares a third-party model no task loads (no replacement names it): the trial still runs
    that stage on its last task, as `compat run` does, so its run is complete, its last report holds the result the
    search's tracking logs, and its matrix equals the one the report's row was read from."""
    from cluster.tune.spec import MODELS_KEY, RESULT_KEY, SearchSpec
    from cluster.tune.trial import run_trial_pipeline
    from pipelines.results.assemble import RunResult

    base = _base_config()
    base["tasks"] = {"spec": "2+2"}
    base["replacements"] = []
    assert base["pretrain"] and base.get("initial_model") != f"pretrain:{base['pretrain'][0]['name']}"
    spec = SearchSpec(name="whole", base_config=base, space=SPACE, objective="AA", samples=1, scheduler="none",
                      storage=str(tmp_path / "searches"), plugins=[PLUGIN])
    reports = []
    last = run_trial_pipeline(spec, {"method.params.lam": 0.0, "training.optimizer.lr": 0.01}, "t1",
                              report=lambda metrics, tasks: reports.append((tasks, dict(metrics))))
    assert [tasks for tasks, _ in reports][-1] == 2
    assert RESULT_KEY in last and MODELS_KEY in last
    run_dir = tmp_path / "searches" / "whole" / "runs" / "t1"
    assert sorted(p.stem.split("-")[1] for p in (run_dir / "manifests").glob("pretrain-*.json")) == ["p1"]
    result = RunResult.from_json(last[RESULT_KEY])
    matrix = _matrix(run_dir)
    assert json.loads(result.metrics_json()) == json.loads((run_dir / "metrics.json").read_text())
    assert result.metrics["AA"] == pytest.approx(_mean_lower(matrix), abs=1e-12) == last["AA"]
    assert last["matrix_row"] == [float(v) for v in matrix[1, :2]]


def test_search_spec_names_the_drivers_folders_for_relative_paths(tmp_path, monkeypatch):
    """Tune runs each trial in its own working folder: a relative shared store or data root in the config (or in the
    space's fixed values) must name the folder under the directory `compat tune` was started in, in every trial;
    URIs and pretrain references stay as written."""
    import argparse

    from app.commands.tune import build_spec
    from cluster.tracking.store import TrackingTarget
    from cluster.tune.spec import absolute_local_paths, trial_config

    base = _base_config()
    base["output"]["shared_store"] = "runs/demo/third-party"
    base["evaluation"]["query_set"]["root"] = "data/glyphs"
    base["initial_model"] = "pretrain:p1"
    (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(base))
    space = {**SPACE, "fixed": {"pretrain": [{"name": "q1", "pool": {"dataset": "glyphs", "root": "data/other",
                                                                    "split": "pretrain-1"}}],
                                "evaluation.gallery_set.root": "s3://bucket/gallery"}}
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(config="scenario.yaml", space="space.yaml", overrides=[], plugins=[PLUGIN],
                              storage="runs/tune", concurrent=1, cpus_per_trial=None, gpus_per_trial=None,
                              name="paths", objective="AA", samples=1, scheduler="none", seed=0,
                              tracking=TrackingTarget(None, "off"),
                              mlflow_experiment=None)
    spec = build_spec(args)
    assert spec.base_config["output"]["shared_store"] == str(tmp_path / "runs" / "demo" / "third-party")
    assert spec.base_config["evaluation"]["query_set"]["root"] == str(tmp_path / "data" / "glyphs")
    assert spec.base_config["initial_model"] == "pretrain:p1"
    assert spec.space["fixed"]["pretrain"][0]["pool"]["root"] == str(tmp_path / "data" / "other")
    assert spec.space["fixed"]["evaluation.gallery_set.root"] == "s3://bucket/gallery"
    # a trial elsewhere (its own working folder) sees the driver's folders
    elsewhere = tmp_path / "trial-folder"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = trial_config(spec.base_config, {}, {"method.params.lam": 0.1}, str(tmp_path / "runs" / "t1"))
    assert config.output.shared_store == str(tmp_path / "runs" / "demo" / "third-party")
    # the helper itself: URIs, MLflow references and pretrain references are left alone
    document = {"source": "models:/name/1", "init": "s3://b/w.safetensors", "initial_model": "pretrain:p2",
                "root": "/abs/data", "dir": "runs/x", "shared_store": "file:///tmp/x"}
    assert absolute_local_paths(document, tmp_path) == document
