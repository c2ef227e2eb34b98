"""`compat run --run-name NAME` against the real MLflow server: the pipeline run is named NAME, its versions carry
run_name NAME and its per-run aliases are NAME__task-N / NAME__latest-task; a name that cannot prefix an alias is
refused before any stage, and another run folder cannot take a name a pipeline run already carries."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

pytestmark = pytest.mark.integration
SCENARIO = "run-name-test"


def _config(tmp_path: Path, folder: str) -> Path:
    document = tiny.scenario("er", output=str(tmp_path / folder))
    document["name"] = SCENARIO
    document.pop("pretrain")
    document["replacements"] = []
    document["tasks"]["spec"] = "2+2"
    config = tmp_path / f"{folder}.yaml"
    config.write_text(yaml.safe_dump(document))
    return config


def test_run_name_names_the_run_and_its_aliases(mlflow_server, tmp_path, monkeypatch, capsys):
    import torch
    from mlflow import MlflowClient

    from app.cli import main

    tiny.register()
    torch.set_num_threads(1)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = mlflow_server.tracking_uri
    client = MlflowClient(uri)
    config = _config(tmp_path, "first")
    assert main(["run", str(config), "--tracking-uri", uri, "--no-progress", "--run-name", "nightly-7"]) == 0
    assert f"models:/{SCENARIO}@nightly-7__task-N" in capsys.readouterr().out
    experiment = client.get_experiment_by_name(SCENARIO).experiment_id
    parent, = client.search_runs([experiment], "tags.run_role = 'pipeline'")
    assert parent.data.tags["run_name"] == "nightly-7"
    assert parent.info.run_name.split(" | ")[0] == "nightly-7"   # the headline metrics follow the name
    versions = client.search_model_versions(f"name = '{SCENARIO}'")
    assert versions and {v.tags["run_name"] for v in versions} == {"nightly-7"}
    by_task = {int(v.tags["task_1based"]): v.version for v in versions if v.tags.get("task_1based")}
    assert sorted(by_task) == [1, 2]
    for task, version in by_task.items():
        assert client.get_model_version_by_alias(SCENARIO, f"nightly-7__task-{task}").version == version
    assert client.get_model_version_by_alias(SCENARIO, "nightly-7__latest-task").version == by_task[2]

    # another run folder (another pipeline) cannot take the name, before any stage runs
    other = _config(tmp_path, "second")
    capsys.readouterr()
    assert main(["run", str(other), "--tracking-uri", uri, "--no-progress", "--run-name", "nightly-7"]) != 0
    assert "--run-name nightly-7: already the name of pipeline run" in capsys.readouterr().err
    assert not (tmp_path / "second" / "metrics.json").exists()
    # a name that cannot prefix an alias: exit 2 with one line naming the option, nothing run
    for bad in ("night.ly", "a__b", "-x", "x" * 65):
        assert main(["run", str(other), "--tracking-uri", uri, "--no-progress", f"--run-name={bad}"]) == 2
        assert capsys.readouterr().err.startswith(f"error: --run-name {bad!r}: expected 1 to 64 letters")

    # a resume keeps the name the run was started with; another --run-name for it is refused with the fix
    assert main(["run", "--resume", str(tmp_path / "first"), "--tracking-uri", uri, "--no-progress"]) == 0
    assert [run.data.tags["run_name"] for run in client.search_runs([experiment], "tags.run_role = 'pipeline'")] \
        == ["nightly-7"]
    capsys.readouterr()
    assert main(["run", "--resume", str(tmp_path / "first"), "--tracking-uri", uri, "--no-progress",
                 "--run-name", "weekly"]) != 0
    error = capsys.readouterr().err
    assert "--run-name weekly: the run in" in error and "or with --run-name nightly-7" in error, error
