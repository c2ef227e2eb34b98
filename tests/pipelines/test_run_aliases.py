"""Registry aliases only by intent, against a real ``mlflow server`` on 127.0.0.1: a full `compat run` of a tiny
config and a smoke run of the same config with ``--set`` overrides into another folder; afterwards every alias of
the registered model points at a version of the run it names (its namespace, or the full run for the bare scenario
aliases), every version carries its run's identity, and the smoke run took over none of the full run's aliases."""
from __future__ import annotations

import tiny_scenario_helpers as tiny
import yaml

from app.cli import main
from cluster.tracking.run_identity import ALIAS_SEPARATOR, run_intent

MODEL = "aliases-by-intent"
SMOKE = ["--set", "tasks.spec=2+2", "--set", "replacements=[]"]


def test_a_smoke_run_never_takes_over_the_full_runs_aliases(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    tiny.register()
    config = tmp_path / "tiny.yaml"
    document = tiny.scenario("dsimplex-hoc")
    document["name"] = MODEL  # a registered model of this test's own on the session's server
    config.write_text(yaml.safe_dump(document))
    full, smoke = tmp_path / "runs" / "full", tmp_path / "runs" / "smoke"
    common = ["--no-progress", "--tracking-uri", mlflow_server.tracking_uri, "--experiment", "aliases-by-intent"]
    assert main(["run", str(config), "--output", str(full), *common]) == 0
    assert main(["run", str(config), "--output", str(smoke), *SMOKE, *common]) == 0

    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri, registry_uri=mlflow_server.tracking_uri)
    versions = {v.version: v for v in client.search_model_versions(f"name = '{MODEL}'")}
    assert len(versions) == 4 + 3  # full: p1 + 3 tasks; smoke: p1 + 2 tasks (another config hash: its own p1)
    by_folder = {str(full): [], str(smoke): []}
    for version in versions.values():
        tags = version.tags
        by_folder[tags["run_folder"]].append(version.version)
        assert {"pipeline_id", "run_name", "config_hash", "overrides_digest", "code_version", "files_sha256",
                "content_sha256"} <= set(tags)
    assert [len(by_folder[str(full)]), len(by_folder[str(smoke)])] == [4, 3]
    names = {folder: versions[numbers[0]].tags["run_name"] for folder, numbers in by_folder.items()}
    assert names[str(full)].startswith("full-") and names[str(smoke)].startswith("smoke-")
    assert {versions[n].tags["scenario_aliases"] for n in by_folder[str(smoke)]} == {"false"}
    assert {versions[n].tags["scenario_aliases"] for n in by_folder[str(full)]} == {"true"}

    aliases = client.get_registered_model(MODEL).aliases  # {alias: version}
    bare = {alias: str(number) for alias, number in aliases.items() if ALIAS_SEPARATOR not in alias}
    assert sorted(bare) == ["latest-task", "pretrain-p1", "task-1", "task-2", "task-3"]
    assert all(number in by_folder[str(full)] for number in bare.values())  # only the full run moved them
    assert versions[bare["latest-task"]].tags["task_1based"] == "3"
    for alias, number in aliases.items():
        if ALIAS_SEPARATOR in alias:
            run_name, _ = alias.split(ALIAS_SEPARATOR, 1)
            assert versions[str(number)].tags["run_name"] == run_name, alias  # a run's alias names its own version
    expected_scoped = {f"{names[str(smoke)]}{ALIAS_SEPARATOR}{a}" for a in ("task-1", "task-2", "latest-task",
                                                                            "pretrain-p1")}
    assert expected_scoped <= set(aliases)
    assert aliases[f"{names[str(smoke)]}{ALIAS_SEPARATOR}latest-task"] != aliases["latest-task"]
    assert "champion" not in aliases  # only `compat gate` moves it

    # the smoke run resumed from its folder (its config.yaml, no --set now): its own parent run, its own intent
    assert main(["run", "--resume", str(smoke), *common]) == 0
    experiment = client.get_experiment_by_name("aliases-by-intent").experiment_id
    parents = client.search_runs([experiment], "tags.run_role = 'pipeline'")
    assert sorted(run.data.tags["run_folder"] for run in parents) == [str(full), str(smoke)]
    resumed = next(run for run in parents if run.data.tags["run_folder"] == str(smoke))
    assert resumed.data.tags["resumes"] == "1" and resumed.data.tags["scenario_aliases"] == "false"
    assert client.get_registered_model(MODEL).aliases == aliases
    assert len(client.search_model_versions(f"name = '{MODEL}'")) == len(versions)


def test_overrides_that_change_nothing_computed_keep_the_scenario_aliases(tmp_path):
    from pipelines.config.load import load_config

    tiny.register()
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny.scenario("dsimplex-hoc")))
    same = ["output.shared_store=/tmp/shared", "description=another words"]
    assert run_intent(config, [], load_config(config)).scenario_aliases
    assert run_intent(config, same, load_config(config, same)).scenario_aliases
    # the precision a run resolves on its machine is not an override: the config it runs with may say bf16 where the
    # file says auto, and its intent is still the file's
    resolved = load_config(config, same)
    resolved.training.autocast = "bf16" if resolved.training.autocast != "bf16" else "off"
    assert run_intent(config, same, resolved).scenario_aliases
    changed = ["training.epochs=2"]
    intent = run_intent(config, changed, load_config(config, changed))
    assert not intent.scenario_aliases and intent.overrides_digest != run_intent(config, [], None).overrides_digest


def test_a_submitted_jobs_intent_comes_from_the_submitter(monkeypatch):
    import json

    from cluster.tracking.run_identity import INTENT_METADATA_KEY, submitted_intent

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert submitted_intent() is None
    for value, expected in (("false", False), ("true", True)):
        monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"metadata": {INTENT_METADATA_KEY: value}}))
        assert submitted_intent() is expected


def test_registering_a_version_never_moves_champion():
    import pytest

    from cluster.model_registry.versions import register_version

    with pytest.raises(ValueError, match="compat gate"):
        register_version(object(), "m", "0" * 32, "k", {}, ["task-1", "champion"])  # refused before any call


def test_scenario_aliases_move_all_at_once_to_one_run(mlflow_server):
    from mlflow import MlflowClient

    from cluster.model_registry.versions import move_scenario_aliases

    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri, registry_uri=mlflow_server.tracking_uri)
    experiment = client.create_experiment("aliases-move-at-once")
    run = client.create_run(experiment)
    client.create_registered_model("move-at-once")
    versions = [client.create_model_version("move-at-once", f"runs:/{run.info.run_id}/m{i}", run_id=run.info.run_id)
                for i in range(3)]
    v1, v2, v3 = (str(v.version) for v in versions)
    for alias, version in {"a-1__task-1": v1, "a-1__task-2": v2, "a-1__latest-task": v2, "task-1": v3,
                           "task-3": v3, "latest-task": v3, "champion": v3, "best-task-1": v3,
                           "b-2__task-3": v3}.items():
        client.set_registered_model_alias("move-at-once", alias, version)
    assert move_scenario_aliases(client, "move-at-once", "a-1__") == {"task-1": v1, "task-2": v2,
                                                                     "latest-task": v2}
    after = {alias: str(version) for alias, version in client.get_registered_model("move-at-once").aliases.items()}
    # task-3 named another run's version: removed, so that every bare alias names run a-1; the rest is untouched
    assert after == {"a-1__task-1": v1, "a-1__task-2": v2, "a-1__latest-task": v2, "task-1": v1, "task-2": v2,
                     "latest-task": v2, "champion": v3, "best-task-1": v3, "b-2__task-3": v3}
    assert move_scenario_aliases(client, "no-such-model", "a-1__") == {}
