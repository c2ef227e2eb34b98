"""A pipeline's MLflow identity includes where it writes, against a real ``mlflow server`` on 127.0.0.1: one config
run into the same relative folder of two checkouts is two pipeline runs with their own stage runs; a live run's
stage runs are never ended by another driver; a resume continues its own parent run (hand-made stage outputs
driven through the real LocalExecutor, as in test_tracking.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from test_tracking import fake_stage_functions, run_tracked, scenario  # same folder: pytest puts it on sys.path

from cluster.tracking.run_identity import pipeline_id_of, run_location, run_name_of, scoped_alias
from pipelines.store.lease import holds_lease, run_lease

pytestmark = pytest.mark.integration

RELATIVE = "runs/demo/er"  # the demo's run folder, relative to the checkout it runs in


def _runs(client, experiment_name: str, under: Path) -> list:
    """The runs of the experiment whose run folder is under ``under`` (the session's server holds other tests' runs
    of the same scenario)."""
    experiment = client.get_experiment_by_name(experiment_name)
    runs = client.search_runs([experiment.experiment_id], max_results=5000)
    return [run for run in runs if run.data.tags.get("run_folder", "").startswith(f"{under}/")]


def test_identity_helpers_name_the_absolute_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_location(RELATIVE) == str(tmp_path / "runs" / "demo" / "er")
    assert run_location(str(tmp_path / "x") + "/") == str(tmp_path / "x")
    first, second = pipeline_id_of("c" * 64, str(tmp_path / "a")), pipeline_id_of("c" * 64, str(tmp_path / "b"))
    assert first != second and len(first) == 16
    assert run_name_of("/home/ana/runs/demo hoc.v2", "0123456789abcdef") == "demo-hoc-v2-01234567"
    assert scoped_alias("er-01234567", "task-3") == "er-01234567__task-3"


def test_one_config_in_two_checkouts_is_two_pipeline_runs_and_a_resume_continues_its_own(mlflow_server, tmp_path,
                                                                                        monkeypatch):
    checkouts = [tmp_path / "clone-a", tmp_path / "clone-b"]
    trackers = []
    for checkout in checkouts:
        checkout.mkdir()
        monkeypatch.chdir(checkout)
        with run_lease(RELATIVE):
            trackers.append(run_tracked(Path(RELATIVE), mlflow_server.tracking_uri, monkeypatch)[2])
    client = trackers[0].client
    runs = _runs(client, "track-demo", tmp_path)
    parents = [run for run in runs if run.data.tags.get("run_role") == "pipeline"]
    assert len(parents) == 2
    assert sorted(run.data.tags["run_folder"] for run in parents) == [str(c / RELATIVE) for c in checkouts]
    assert len({run.data.tags["pipeline_id"] for run in parents}) == 2
    children = {parent.info.run_id: [run for run in runs if run.data.tags.get("mlflow.parentRunId")
                                     == parent.info.run_id] for parent in parents}
    stages = [stage for stage in trackers[0].graph if stage.kind != "entry"]
    assert [len(own) for own in children.values()] == [len(stages), len(stages)]  # each its own, no stage twice
    for parent in parents:
        assert {run.data.tags["run_folder"] for run in children[parent.info.run_id]} == {parent.data.tags["run_folder"]}
    assert [run.info.status for run in runs if run.info.status != "FINISHED"] == []  # 0 KILLED, 0 FAILED

    monkeypatch.chdir(checkouts[0])  # the first checkout's run again: its own parent, resumed
    with run_lease(RELATIVE):
        resumed = run_tracked(Path(RELATIVE), mlflow_server.tracking_uri, monkeypatch)[2]
    after = [run for run in _runs(client, "track-demo", tmp_path) if run.data.tags.get("run_role") == "pipeline"]
    assert sorted(run.info.run_id for run in after) == sorted(run.info.run_id for run in parents)
    mine = client.get_run(next(run.info.run_id for run in parents
                               if run.data.tags["pipeline_id"] == trackers[0].pipeline_id))
    assert resumed.pipeline_id == trackers[0].pipeline_id != trackers[1].pipeline_id
    assert mine.data.tags["resumes"] == "1" and mine.info.status == "FINISHED"
    assert len(_runs(client, "track-demo", tmp_path)) == len(runs)  # nothing logged twice


INTRUDER = """
import sys
sys.path.insert(0, {here!r})
import test_tracking
from cluster.tracking.tracker import create_tracker
from pipelines.config.load import validate_config
from pipelines.graph.compile import compile_scenario
from pipelines.store.run_store import RunStore
graph = compile_scenario(validate_config(test_tracking.scenario({folder!r})), version="test+0123")
try:
    create_tracker({uri!r}).start(graph, RunStore({folder!r}))
except RuntimeError as error:
    print("refused:", error)
"""


def test_a_live_run_is_never_ended_by_another_driver(mlflow_server, tmp_path, monkeypatch):
    """While run A's first model stage runs, a run B of the same config into another folder starts and finishes,
    and another process's tracker for A's folder (without A's lease) is refused: A's stage runs stay A's."""
    import subprocess
    import sys

    folder_a, folder_b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    seen: dict = {}
    fakes = fake_stage_functions()

    def pretrain_while_others_start(ctx):
        if not seen:
            seen["a_stage"] = True
            script = INTRUDER.format(here=str(Path(__file__).parent), folder=str(folder_a),
                                     uri=mlflow_server.tracking_uri)
            intruder = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
            seen["intruder"] = intruder.stdout + intruder.stderr[-2000:]
            inner = pytest.MonkeyPatch()
            try:
                with run_lease(str(folder_b)):
                    seen["b"] = run_tracked(folder_b, mlflow_server.tracking_uri, inner)[2]
            finally:
                inner.undo()  # A's stage functions again
        return fakes["pretrain"](ctx)

    monkeypatch.setattr("test_tracking.fake_stage_functions",
                        lambda fail_task=None: {**fakes, "pretrain": pretrain_while_others_start})
    with run_lease(str(folder_a)):
        assert holds_lease(str(folder_a))
        tracker_a = run_tracked(folder_a, mlflow_server.tracking_uri, monkeypatch)[2]
    assert "refused: pipeline run" in seen["intruder"] and "does not hold the run folder's lease" in seen["intruder"]
    assert seen["b"].pipeline_id != tracker_a.pipeline_id
    runs = _runs(tracker_a.client, "track-demo", tmp_path)
    parents = {run.data.tags["run_folder"]: run for run in runs if run.data.tags.get("run_role") == "pipeline"}
    assert set(parents) == {str(folder_a), str(folder_b)}
    for folder, parent in parents.items():
        own = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert own and {run.data.tags["run_folder"] for run in own} == {folder}
    assert [run.info.status for run in runs] == ["FINISHED"] * len(runs)  # 0 KILLED: nobody ended A's live runs
    assert not [run for run in runs if run.data.tags.get("ended_by")]
