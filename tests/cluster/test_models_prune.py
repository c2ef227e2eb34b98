"""`compat models prune` against the real MLflow server: the dry run (default) lists the per-run aliases whose run
folder is gone and removes nothing; --apply removes exactly those; bare scenario aliases, champion, aliases of runs
whose folder exists and aliases whose version records another run are never touched."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration
NAME = "prune-test"


def _version(client, run_id: str, run_name: str, folder: str) -> str:
    return str(client.create_model_version(NAME, f"runs:/{run_id}/model", run_id=run_id,
                                           tags={"run_name": run_name, "run_folder": folder}).version)


def test_prune_removes_only_per_run_aliases_of_gone_folders(mlflow_server, tmp_path, capsys):
    from mlflow import MlflowClient

    from app.cli import main
    from cluster.tracking.client import ensure_experiment

    client = MlflowClient(mlflow_server.tracking_uri)
    run = client.create_run(ensure_experiment(client, "prune-test"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "note.txt").write_text("placeholder")
    client.log_artifacts(run.info.run_id, str(tmp_path / "model"), "model")
    client.create_registered_model(NAME)
    alive_folder = tmp_path / "runs" / "alive"
    alive_folder.mkdir(parents=True)
    gone_folder = tmp_path / "runs" / "gone"   # never created: the run folder was deleted
    gone = _version(client, run.info.run_id, "gone-1a2b3c4d", str(gone_folder))
    alive = _version(client, run.info.run_id, "alive-5e6f7a8b", str(alive_folder))
    aliases = {"gone-1a2b3c4d__task-1": gone, "gone-1a2b3c4d__latest-task": gone, "alive-5e6f7a8b__task-1": alive,
               "task-1": gone, "champion": gone, "someone-else__task-1": gone}
    for alias, version in aliases.items():
        client.set_registered_model_alias(NAME, alias, version)
    uri = mlflow_server.tracking_uri

    assert main(["models", "prune", "--model", NAME, "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    listed = sorted(line.split()[2] for line in out.splitlines() if line.startswith("would remove "))
    assert listed == [f"{NAME}@gone-1a2b3c4d__latest-task", f"{NAME}@gone-1a2b3c4d__task-1"], out
    assert "dry run: 2 alias(es) listed, none removed" in out
    assert client.get_registered_model(NAME).aliases == aliases   # nothing removed

    assert main(["models", "prune", "--model", NAME, "--tracking-uri", uri, "--apply"]) == 0
    assert sum(line.startswith("removed ") for line in capsys.readouterr().out.splitlines()) == 2
    kept = {alias: version for alias, version in aliases.items() if not alias.startswith("gone-")}
    assert client.get_registered_model(NAME).aliases == kept

    assert main(["models", "prune", "--model", NAME, "--tracking-uri", uri]) == 0
    assert "no per-run alias names a run folder that is gone" in capsys.readouterr().out
