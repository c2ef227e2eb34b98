"""A replacement source ``models:/<name>@task-3`` read from the MLflow model registry of a real ``mlflow server``
(session fixture): `compat run` registers the resolvers, trains from the registered weights and evaluates."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

from app.cli import main  # noqa: E402

pytestmark = pytest.mark.integration


def _write(tmp_path: Path, name: str, document: dict) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return str(path)


def _upgrade(tmp_path: Path, name: str, source: str) -> dict:
    document = tiny.scenario("dsimplex-hoc", output=str(tmp_path / name))
    document["name"] = name
    document.pop("pretrain")
    document["replacements"] = [{"at_task": 3, "source": source}]
    return document


def test_models_alias_source_trains_and_evaluates_end_to_end(mlflow_server, tmp_path, monkeypatch, uri_resolvers):
    from mlflow import MlflowClient

    from pipelines.store.run_store import RunStore

    tiny.register()
    torch.set_num_threads(1)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = mlflow_server.tracking_uri
    # 1. a tracked run registers its models with aliases task-1..task-3
    source_run = tiny.scenario("dsimplex-hoc", output=str(tmp_path / "source"))
    source_run["name"] = "registry-source-line"
    assert main(["run", _write(tmp_path, "source", source_run), "--tracking-uri", uri, "--no-progress"]) == 0
    names = [m.name for m in MlflowClient(uri).search_registered_models("name LIKE 'registry-source-line%'")]
    assert names == ["registry-source-line"]  # the scenario's one registered model
    version = MlflowClient(uri).get_model_version_by_alias(names[0], "task-3")
    # 2. a scenario whose replacement at task 3 is that registered model, by alias (the resolvers `compat run`
    # registers for it are forgotten after the test: uri_resolvers)
    models_uri = f"models:/{names[0]}@task-3"
    # without a registry to read it from, the command refuses before any compute, naming the key
    assert main(["run", _write(tmp_path, "noreg", _upgrade(tmp_path, "noreg", models_uri)), "--tracking-uri",
                 "none", "--no-progress"]) == 2
    assert not (tmp_path / "noreg" / "manifests").exists()
    assert main(["run", _write(tmp_path, "registry", _upgrade(tmp_path, "registry", models_uri)),
                 "--tracking-uri", uri, "--no-progress"]) == 0
    # the alias is pinned to the version it named, so moving it later cannot reuse these stages
    used = yaml.safe_load((tmp_path / "registry" / "config.yaml").read_text())["replacements"][0]["source"]
    assert used == f"models:/{names[0]}/{version.version}"
    # 3. the same scenario with the source model's folder as a path: the same weights, so the same matrix
    store = RunStore(tmp_path / "source")
    graph_source = json.loads((tmp_path / "source" / "matrix.json").read_text())
    assert graph_source["values"][2][2] is not None
    task_3 = [k for k in store.stage_keys() if k.startswith("replace-t002-")]
    assert len(task_3) == 1 and version.tags["stage_key"] == task_3[0]
    folder = store.uri(store.ARTIFACTS, task_3[0])  # model.safetensors + config.json of that stage
    assert main(["run", _write(tmp_path, "path", _upgrade(tmp_path, "path", folder)), "--tracking-uri", "none",
                 "--no-progress"]) == 0
    registry = json.loads((tmp_path / "registry" / "matrix.json").read_text())
    by_path = json.loads((tmp_path / "path" / "matrix.json").read_text())
    assert registry["values"] == by_path["values"]
    assert all(v is not None for row in range(3) for v in registry["values"][row][: row + 1])
