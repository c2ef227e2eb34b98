"""cluster.tracking.tracker against a real ``mlflow server`` on 127.0.0.1 (session fixture), checked through the REST API
with plain HTTP calls: runs and their nesting, metrics, artifacts, model versions, aliases, resume and failure."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from urllib.parse import urlencode
from urllib.request import Request, urlopen

import pytest
from test_tracking import EXPECTED, run_tracked  # same folder: pytest puts it on sys.path

pytestmark = pytest.mark.integration


def rest(server, method: str, path: str, params: dict | None = None, body: dict | None = None) -> dict:
    url = f"{server.tracking_uri}/api/2.0/mlflow/{path}"
    if params:
        url += "?" + urlencode(params)
    data = json.dumps(body).encode() if body is not None else None
    request = Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urlopen(request, timeout=30) as response:
        return json.loads(response.read() or b"{}")


def search_runs(server, experiment_id: str, filter_string: str = "") -> list[dict]:
    runs, token = [], None
    while True:
        body = {"experiment_ids": [experiment_id], "filter": filter_string, "max_results": 1000}
        if token:
            body["page_token"] = token
        page = rest(server, "POST", "runs/search", body=body)
        runs += page.get("runs", [])
        token = page.get("next_page_token")
        if not token:
            return runs


def tags_of(run: dict) -> dict:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


def latest_metrics(run: dict) -> dict:
    return {m["key"]: m["value"] for m in run["data"].get("metrics", [])}


@pytest.fixture(scope="module")
def served_run(mlflow_server, tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    run_dir = tmp_path_factory.mktemp("served") / "run"
    try:
        yield (run_dir, *run_tracked(run_dir, mlflow_server.tracking_uri, monkeypatch))
    finally:
        monkeypatch.undo()


def test_runs_metrics_and_artifacts_over_rest(mlflow_server, served_run):
    run_dir, graph, store, tracker = served_run
    experiment = rest(mlflow_server, "GET", "experiments/get-by-name", {"experiment_name": "track-demo"})["experiment"]
    pipeline = f"tags.pipeline_id = '{tracker.pipeline_id}'"
    parents = search_runs(mlflow_server, experiment["experiment_id"], f"{pipeline} and tags.run_role = 'pipeline'")
    assert len(parents) == 1
    parent = parents[0]
    assert parent["info"]["status"] == "FINISHED"
    parent_id = parent["info"]["run_id"]
    children = search_runs(mlflow_server, experiment["experiment_id"], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    # one nested run per stage; matrix entries are logged with their rows
    assert sorted(tags_of(r)["stage_label"] for r in children) == sorted(s.label for s in graph if s.kind != "entry")
    assert all(r["info"]["status"] == "FINISHED" for r in children)
    assert all(tags_of(r)["config_hash"] == tags_of(parent)["config_hash"] for r in children)

    metrics = latest_metrics(parent)
    assert not any(key.startswith("compat/q") for key in metrics)  # the matrix is one table, not single dots
    for name, value in EXPECTED.items():
        assert metrics[name] == pytest.approx(value, abs=1e-12), name
    history = rest(mlflow_server, "GET", "metrics/get-history", {"run_id": parent_id, "metric_key": "AA_tau"})
    assert {m["step"]: m["value"] for m in history["metrics"]} == pytest.approx(
        {1: 0.5, 2: 1.875 / 3, 3: 4.125 / 6}, abs=1e-12)  # tau, 1-based

    finetune = next(r for r in children if tags_of(r)["stage_label"] == "finetune[t=1]")
    history = rest(mlflow_server, "GET", "metrics/get-history",
                   {"run_id": finetune["info"]["run_id"], "metric_key": "train/loss"})
    assert {int(m["step"]): m["value"] for m in history["metrics"]} == {1: 2.75, 2: 2.5}  # 2 - 0.25 step + task 1

    listed = rest(mlflow_server, "GET", "artifacts/list", {"run_id": parent_id, "path": "results"})
    files = {f["path"]: f for f in listed["files"]}
    assert {"results/matrix.json", "results/matrix.csv", "results/metrics.json", "results/config.yaml",
            "results/matrix_table.json"} <= set(files)
    pngs = sorted(p for p in files if p.endswith(".png"))
    assert pngs == sorted(f"results/{p.name}" for p in run_dir.glob("*.png"))
    model_files = rest(mlflow_server, "GET", "artifacts/list", {"run_id": finetune["info"]["run_id"], "path": "model"})
    sizes = {f["path"]: int(f["file_size"]) for f in model_files["files"] if not f.get("is_dir")}
    nested = rest(mlflow_server, "GET", "artifacts/list", {"run_id": finetune["info"]["run_id"],
                                                           "path": "model/artifacts"})
    sizes.update({f["path"]: int(f["file_size"]) for f in nested["files"] if not f.get("is_dir")})
    weights = Path(store.blob_path(graph.model_stages[1], "model.safetensors"))
    # the run's own files byte for byte, as the artifacts of MLflow's pyfunc flavour written as code (no pickle)
    assert sizes["model/artifacts/model.safetensors"] == weights.stat().st_size
    assert sizes["model/artifacts/config.json"] == Path(weights.parent, "config.json").stat().st_size
    assert "model/MLmodel" in sizes and not any(p.endswith((".pth", ".pkl", ".pt")) for p in sizes)
    assert {"path": "model/data", "is_dir": True} not in model_files["files"]
    # weights only: the whole model folder is the safetensors' size plus a few kB (MLmodel, the loader, requirements)
    assert sum(sizes.values()) <= 1.1 * weights.stat().st_size + 32_000


def test_model_versions_and_aliases_over_rest(mlflow_server, served_run):
    run_dir, graph, store, tracker = served_run
    name = "track-demo"
    registered = rest(mlflow_server, "GET", "registered-models/get", {"name": name})["registered_model"]
    everything = {a["alias"]: a["version"] for a in registered.get("aliases", [])}
    aliases = {alias: version for alias, version in everything.items() if "__" not in alias}
    assert set(aliases) == {"task-1", "task-2", "task-3", "latest-task", "pretrain-p1", "pretrain-p2"}
    # the run's own namespace holds the same aliases on the same versions (the config ran as written)
    assert {alias: version for alias, version in everything.items() if "__" in alias} == {
        f"{tracker.run_name}__{alias}": version for alias, version in aliases.items()}
    versions = rest(mlflow_server, "GET", "model-versions/search", {"filter": f"name = '{name}'"})["model_versions"]
    assert len(versions) == 5
    by_version = {v["version"]: {t["key"]: t["value"] for t in v.get("tags", [])} | {"source": v["source"]}
                  for v in versions}
    for task, key in enumerate(graph.model_stages):
        alias = rest(mlflow_server, "GET", "registered-models/alias", {"name": name, "alias": f"task-{task + 1}"})
        version = alias["model_version"]
        tags = by_version[version["version"]]
        assert tags["stage_key"] == key and tags["task_0based"] == str(task)
        digest = hashlib.sha256(Path(store.blob_path(key, "model.safetensors")).read_bytes()).hexdigest()
        assert tags["sha256"] == digest
        assert tags["source"] == f"runs:/{version['run_id']}/model"
        if task > 0:
            assert tags["parent_version"] == aliases[f"task-{task}"]
    assert aliases["latest-task"] == aliases["task-3"]
    assert by_version[aliases["task-1"]]["external_source"] == "pretrain:p1"
    assert by_version[aliases["task-1"]]["source_version"] == aliases["pretrain-p1"]
    assert by_version[aliases["task-3"]]["source_version"] == aliases["pretrain-p2"]


def test_resume_against_server_creates_no_duplicates(mlflow_server, served_run, monkeypatch):
    run_dir, graph, store, tracker = served_run
    experiment_id = tracker.experiment_id
    before = sorted(r["info"]["run_id"] for r in search_runs(mlflow_server, experiment_id))
    name = "track-demo"
    versions = rest(mlflow_server, "GET", "model-versions/search", {"filter": f"name = '{name}'"})["model_versions"]
    run_tracked(run_dir, mlflow_server.tracking_uri, monkeypatch)
    assert sorted(r["info"]["run_id"] for r in search_runs(mlflow_server, experiment_id)) == before
    again = rest(mlflow_server, "GET", "model-versions/search", {"filter": f"name = '{name}'"})["model_versions"]
    assert len(again) == len(versions) == 5


def test_failed_stage_is_failed_over_rest(mlflow_server, tmp_path, monkeypatch):
    run_dir = tmp_path / "failing"
    with pytest.raises(RuntimeError, match="injected failure"):
        run_tracked(run_dir, mlflow_server.tracking_uri, monkeypatch, fail_task=0)
    experiment = rest(mlflow_server, "GET", "experiments/get-by-name", {"experiment_name": "track-demo"})["experiment"]
    failed = search_runs(mlflow_server, experiment["experiment_id"], "attributes.status = 'FAILED'")
    labels = sorted(tags_of(r).get("stage_label", "<pipeline>") for r in failed
                    if tags_of(r)["pipeline_id"] == tags_of(failed[0])["pipeline_id"])
    assert labels == ["<pipeline>", "finetune[t=0]"]


def test_stages_committed_before_tracking_are_logged_from_the_engines_records(mlflow_server, tmp_path, monkeypatch):
    """Six nodes committed without tracking, then the run resumed tracked: the stages committed before are logged
    (backfilled) from the records the engine read once and handed over, while the tracker's store refuses every
    manifest and result-file read (test_tracking.TrackerStore)."""
    run_dir = tmp_path / "backfilled"
    graph, store, _ = run_tracked(run_dir, "none", monkeypatch, stop_after=6)
    before = [stage for stage in graph if store.has(stage.key)]
    assert len(before) == 6 and any(stage.kind in ("pretrain", "finetune") for stage in before)
    _, _, tracker = run_tracked(run_dir, mlflow_server.tracking_uri, monkeypatch)
    runs = search_runs(mlflow_server, tracker.experiment_id, f"tags.pipeline_id = '{tracker.pipeline_id}'")
    by_key = {tags_of(run).get("stage_key"): run for run in runs}
    backfilled = {key for key, run in by_key.items() if tags_of(run).get("backfilled") == "true"}
    assert backfilled == {stage.key for stage in before if stage.kind != "entry"}  # entries log with their row
    for stage in before:
        run = by_key.get(stage.key)
        if stage.kind in ("pretrain", "finetune", "replace"):
            digest = hashlib.sha256(Path(store.blob_path(stage.key, "model.safetensors")).read_bytes()).hexdigest()
            assert tags_of(run)["model_sha256"] == digest
            files = rest(mlflow_server, "GET", "artifacts/list", {"run_id": run["info"]["run_id"],
                                                                  "path": "model/artifacts"})
            sizes = {Path(f["path"]).name: int(f["file_size"]) for f in files["files"]}
            assert sizes["model.safetensors"] == Path(store.blob_path(stage.key, "model.safetensors")).stat().st_size
        elif stage.kind == "extract":
            assert latest_metrics(run)["extract/rows"] == 30  # the fake layout's rows
    assert all(run["info"]["status"] == "FINISHED" for run in runs)
    parent = [run for run in runs if tags_of(run).get("run_role") == "pipeline"]
    assert len(parent) == 1
    assert latest_metrics(parent[0])["AA"] == pytest.approx(EXPECTED["AA"])
