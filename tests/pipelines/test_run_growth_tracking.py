"""The MLflow view of a grown run, against a real ``mlflow server`` on 127.0.0.1: a 2-task run, its task-2 version
gated to @champion, then the run grown by a third task. The grown run is still ONE pipeline run (same pipeline id)
holding the new stage runs and the new row's metrics at the new step; the task-3 version is registered with
``parent_version`` = the task-2 version and the run's identity; ``compat gate`` then judges it against @champion."""
from __future__ import annotations

import json
import math
import uuid

import tiny_scenario_helpers as tiny
import yaml

from app.cli import main
from cluster.tracking.run_identity import ALIAS_SEPARATOR
from pipelines.config.load import config_hash, load_config


def test_a_grown_run_continues_its_pipeline_run_and_registers_the_next_version(mlflow_server, tmp_path, capsys):
    from mlflow import MlflowClient

    tiny.register()
    name = f"growth-{uuid.uuid4().hex[:6]}"  # a registered model and experiment of this test's own
    document = tiny.scenario("er", output=str(tmp_path / "unused"))
    document.update(name=name, tasks={"spec": "2+1x2"})
    document.pop("replacements")
    config = tmp_path / "short.yaml"
    config.write_text(yaml.safe_dump(document))
    run_dir = tmp_path / "runs" / "monthly"
    tracking = ["--tracking-uri", mlflow_server.tracking_uri]
    assert main(["run", str(config), "--output", str(run_dir), "--no-progress", *tracking]) == 0
    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri, registry_uri=mlflow_server.tracking_uri)
    experiment = client.get_experiment_by_name(name).experiment_id
    (parent,) = client.search_runs([experiment], "tags.run_role = 'pipeline'")
    short_hash = parent.data.tags["config_hash"]
    task2 = client.get_model_version_by_alias(name, f"{parent.data.tags['run_name']}{ALIAS_SEPARATOR}task-2")
    assert main(["gate", name, "--candidate", task2.version, "--config", str(run_dir / "config.yaml"),
                 *tracking]) == 0  # the first champion
    assert client.get_model_version_by_alias(name, "champion").version == task2.version

    assert main(["run", "--resume", str(run_dir), "--set", "tasks.spec=2+2x2", "--no-progress", *tracking]) == 0
    parents = client.search_runs([experiment], "tags.run_role = 'pipeline'")
    assert [run.info.run_id for run in parents] == [parent.info.run_id]  # the same pipeline run, continued
    grown = parents[0]
    tags = grown.data.tags
    assert grown.info.status == "FINISHED" and tags["pipeline_id"] == parent.data.tags["pipeline_id"]
    assert tags["grown"] == "1" and tags["grown_from_config_hash"] == short_hash
    assert tags["config_hash"] == config_hash(load_config(run_dir / "config.yaml")) != short_hash
    assert "tasks.spec: 2+1x2 -> 2+2x2" in tags["grown_params"]

    stages = client.search_runs([experiment], f"tags.run_role = 'stage' and tags.mlflow.parentRunId = "
                                              f"'{grown.info.run_id}'", max_results=200)
    labels = sorted(run.data.tags["stage_label"] for run in stages)
    new = {"finetune[t=2]", "extract[t=2,query]", "extract[t=2,gallery]", "evaluate[row=2]"}
    assert new <= set(labels) and len(labels) == len(set(labels))  # one run per stage, none logged twice
    assert {run.data.tags["task_0based"] for run in stages if run.data.tags["stage_label"] in new} == {"2"}

    matrix = json.loads((run_dir / "matrix.json").read_text())["values"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    (row,) = [run for run in stages if run.data.tags["stage_label"] == "evaluate[row=2]"]
    for k in range(3):  # the new row on its evaluate run, at the 1-based step of its task
        (point,) = client.get_metric_history(row.info.run_id, f"compat/q2_g{k}")
        assert (point.step, point.value) == (3, matrix[2][k])
    history = client.get_metric_history(grown.info.run_id, "AA")  # at step T (1-based): one point per length
    assert sorted(point.step for point in history) == [0, 2, 3]  # step 0: the NaN placeholder logged at start
    assert all(math.isnan(point.value) for point in history if point.step == 0)
    assert [point.value for point in history if point.step == 3] == [metrics["AA"]]
    assert {point.step for point in client.get_metric_history(grown.info.run_id, "AA_tau")} == {1, 2, 3}

    versions = {v.version: v for v in client.search_model_versions(f"name = '{name}'")}
    task3 = client.get_model_version_by_alias(name, f"{tags['run_name']}{ALIAS_SEPARATOR}task-3")
    assert len(versions) == 4 and int(task3.version) == max(map(int, versions))  # p1, tasks 1-2, then task 3
    assert task3.tags["parent_version"] == task2.version and task3.tags["task_1based"] == "3"
    assert task3.tags["pipeline_id"] == tags["pipeline_id"] and task3.tags["config_hash"] == tags["config_hash"]

    capsys.readouterr()
    decision = main(["gate", name, "--candidate", task3.version, "--config", str(run_dir / "config.yaml"),
                     "--json", *tracking])
    out = capsys.readouterr().out  # MLflow prints "View run" lines before the JSON document
    result = json.loads(out[out.index("\n{\n") + 1:])
    assert result["decision"] in ("promoted", "refused") and decision == (0 if result["decision"] == "promoted" else 1)
    assert str(result["candidate_version"]) == task3.version
    champion = client.get_model_version_by_alias(name, "champion").version
    assert champion == (task3.version if result["decision"] == "promoted" else task2.version)
