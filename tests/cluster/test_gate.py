"""`compat gate`, `compat gate history`, `compat gate rollback` against the real MLflow server (session fixture),
on the model versions a real tiny pipeline run registered there (with adapters at its replacement)."""
from __future__ import annotations

import hashlib
import json
import re
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402
from registry_models import register_files, tiny_model_files  # noqa: E402

from app.cli import main  # noqa: E402
from compat_core.upgrades.backfill_order import DEFAULT_FRACTIONS  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tracked_run(mlflow_server, tmp_path_factory):
    """A tiny ER run (float32 features, adapters at the replacement) tracked on the server; its model name."""
    from mlflow import MlflowClient

    tiny.register()
    folder = tmp_path_factory.mktemp("gate")
    document = tiny.scenario("er")
    document["name"] = "tiny-gate"
    document["evaluation"]["feature_dtype"] = "float32"   # so the run's matrix equals the gate's numbers exactly
    document["replacements"][0]["adapters"] = ["procrustes", "fct"]
    document["replacements"][0]["adapter_params"] = {"fct": {"epochs": 2, "hidden": 8}}
    config = folder / "tiny.yaml"
    config.write_text(yaml.safe_dump(document))
    run_dir = folder / "run"
    assert main(["run", str(config), "--output", str(run_dir), "--no-progress",
                 "--tracking-uri", mlflow_server.tracking_uri]) == 0
    client = MlflowClient(mlflow_server.tracking_uri)
    name = "tiny-gate"  # the scenario's registered model (its name, stable across runs)
    return client, name, run_dir


def _json_tail(text: str):
    """The JSON document printed last (MLflow's client prints 'View run' lines to stdout before it)."""
    lines = text.splitlines()
    start = max(i for i, line in enumerate(lines) if line in ("{", "[", "[]"))
    return json.loads("\n".join(lines[start:]))


def _json_tail_of(argv: list[str], capsys):
    capsys.readouterr()
    assert main(argv) == 0
    return _json_tail(capsys.readouterr().out)


def _version_of_task(client, name, task_1based):
    return client.get_model_version_by_alias(name, f"task-{task_1based}").version


def test_gate_promotes_refuses_records_and_rolls_back(tracked_run, mlflow_server, capsys):
    client, name, run_dir = tracked_run
    uri = ["--tracking-uri", mlflow_server.tracking_uri]
    config = str(run_dir / "config.yaml")
    v1, v2 = _version_of_task(client, name, 1), _version_of_task(client, name, 2)

    # the first gate on an unset alias makes the candidate the champion
    capsys.readouterr()
    assert main(["gate", name, "--candidate", str(v1), "--config", config] + uri) == 0
    assert client.get_model_version_by_alias(name, "champion").version == v1
    assert "first promotion" in capsys.readouterr().out  # said, not silent: nothing was evaluated

    # task 2 against task 1: the decision and numbers equal the run's own matrix (C[1,0] vs C[0,0])
    matrix = json.loads((run_dir / "matrix.json").read_text())["values"]
    cross, self_old, self_new = matrix[1][0], matrix[0][0], matrix[1][1]
    expected_pass = cross > self_old
    capsys.readouterr()
    code = main(["gate", name, "--candidate", str(v2), "--config", config, "--json"] + uri)
    result = _json_tail(capsys.readouterr().out)
    assert code == (0 if expected_pass else 1)
    assert result["values"]["recall_at_1"]["cross"] == pytest.approx(cross, abs=1e-12)
    assert result["values"]["recall_at_1"]["self_old"] == pytest.approx(self_old, abs=1e-12)
    assert result["values"]["recall_at_1"]["self_new"] == pytest.approx(self_new, abs=1e-12)
    assert result["verdict"]["margin"] == pytest.approx(cross - self_old, abs=1e-12)
    assert result["decision"] == ("promoted" if expected_pass else "refused")
    if not expected_pass:
        assert set(result["options"]["adapters"]) == {"procrustes", "affine", "mlp", "fct", "fan"}
        assert result["advice"]
    gate_run = client.get_run(result["run_id"])
    assert gate_run.data.tags["decision"] == result["decision"]
    assert gate_run.data.tags["candidate_version"] == str(v2)
    assert gate_run.info.run_name == f"gate-{name}-v{v2}-{result['decision']}"  # the decision in the runs table
    assert gate_run.data.metrics["recall_at_1/cross"] == pytest.approx(cross, abs=1e-12)
    # a promotion writes the install tags; a refusal only the candidate's last decision
    tag = "gate.champion.decision" if result["decision"] == "promoted" else "gate.champion.last_decision"
    assert client.get_model_version(name, v2).tags[tag] == result["decision"]
    champion_now = client.get_model_version_by_alias(name, "champion").version

    # identical weights registered as a new version: M(new, old) == M(old, old) exactly, so strict refuses and
    # non-strict (>=) promotes
    source = client.get_model_version(name, champion_now)
    twin = client.create_model_version(name, source.source, run_id=source.run_id).version
    started = time.time()
    assert main(["gate", name, "--candidate", str(twin), "--config", config] + uri) == 1
    wall_ms = 1000 * (time.time() - started)
    captured = capsys.readouterr()
    out = captured.out
    assert "not compatible" in out and "what to do" in out
    # a progress line per adapter and per backfill point; the run lasts the whole gate; the curve's x is percent
    assert len(re.findall(r"^gate: adapter \d/5 \w+: M\(new, old\)", captured.err, flags=re.M)) == 5
    assert len(re.findall(r"^gate: backfill curve \d+% re-embedded", captured.err, flags=re.M)) == \
        len(DEFAULT_FRACTIONS)
    twin_tags = client.get_model_version(name, twin).tags
    assert "gate.champion.run_id" not in twin_tags and "gate.champion.decision" not in twin_tags
    refused_run = client.get_run(twin_tags["gate.champion.last_run_id"])
    assert refused_run.info.run_name == f"gate-{name}-v{twin}-refused"
    assert refused_run.info.end_time - refused_run.info.start_time >= 0.5 * wall_ms
    percent = client.get_metric_history(refused_run.info.run_id, "backfill/percent_reembedded")
    assert sorted((m.step, m.value) for m in percent) == [(round(100 * f), round(100 * f)) for f in DEFAULT_FRACTIONS]
    assert "gate/backfill.png" in [a.path for a in client.list_artifacts(refused_run.info.run_id, "gate")]
    assert client.get_model_version_by_alias(name, "champion").version == champion_now
    assert main(["gate", name, "--candidate", str(twin), "--config", config, "--non-strict"] + uri) == 0
    assert client.get_model_version_by_alias(name, "champion").version == twin

    # history lists every decision in order; rollback restores the previous champion and is recorded
    capsys.readouterr()
    assert main(["gate", "history", name, "--json"] + uri) == 0
    rows = _json_tail(capsys.readouterr().out)
    assert [row["candidate_version"] for row in rows] == [str(v1), str(v2), str(twin), str(twin)]
    assert rows[-1]["previous_version"] == str(champion_now) and rows[-1]["new_version"] == str(twin)
    assert main(["gate", "rollback", name, "--reason", "p99 latency regression"] + uri) == 0
    assert client.get_model_version_by_alias(name, "champion").version == champion_now
    capsys.readouterr()
    assert main(["gate", "history", name] + uri) == 0
    assert "rollback" in capsys.readouterr().out.splitlines()[-1]

    # a version the gate refused is installed by a rollback only with --force, and that is recorded
    refused = client.create_model_version(name, source.source, run_id=source.run_id).version
    assert main(["gate", name, "--candidate", str(refused), "--config", config] + uri) == 1
    capsys.readouterr()
    assert main(["gate", "rollback", name, "--to", str(refused)] + uri) == 2
    assert f"the gate refused version {refused}" in capsys.readouterr().err
    assert client.get_model_version_by_alias(name, "champion").version == champion_now
    assert main(["gate", "rollback", name, "--to", str(refused), "--force"] + uri) == 0
    assert "FORCED" in capsys.readouterr().out
    assert client.get_model_version_by_alias(name, "champion").version == refused
    forced = _json_tail_of(["gate", "history", name, "--json"] + uri, capsys)[-1]
    assert forced["action"] == "rollback" and forced["reason"].startswith("FORCED over the gate's refusal")


def test_adapters_of_the_run_are_registered_and_bad_gate_input_is_refused(tracked_run, mlflow_server, capsys):
    client, name, run_dir = tracked_run
    adapters = client.search_model_versions(f"name = '{name}-adapters'")
    assert sorted(version.tags["adapter"] for version in adapters) == ["fct", "procrustes"]
    assert client.get_model_version_by_alias(f"{name}-adapters", "procrustes-task-3").tags["task_1based"] == "3"
    record = json.loads((run_dir / "adapters.json").read_text())[0]
    assert record["task"] == 2 and set(record["adapters"]) == {"procrustes", "fct"}
    uri = ["--tracking-uri", mlflow_server.tracking_uri]
    assert main(["gate", name, "--candidate", "999", "--config", str(run_dir / "config.yaml")] + uri) == 2
    assert "has no version '999'" in capsys.readouterr().err
    assert main(["gate", name, "--candidate", "1"] + uri) == 2
    assert "--config" in capsys.readouterr().err


def _champion(client, name) -> str:
    return str(client.get_model_version_by_alias(name, "champion").version)


def test_a_gate_of_the_champion_writes_nothing_and_a_rollback_loads_a_version_that_held_the_alias(
        mlflow_server, capsys, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server.tracking_uri)
    name = f"gate-rollback-{uuid.uuid4().hex[:6]}"
    uri = ["--tracking-uri", mlflow_server.tracking_uri]
    tiny.register()
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny.scenario("er")))
    champion = register_files(client, name, tiny_model_files(seed=0), tmp_path)
    assert main(["gate", name, "--candidate", champion, "--config", str(config)] + uri) == 0
    tags_before = client.get_model_version(name, champion).tags
    assert tags_before["gate.champion.decision"] == "promoted"

    # gating the champion itself: nothing evaluated, exit 0, decision recorded, no tag of the version touched
    capsys.readouterr()
    assert main(["gate", name, "--candidate", champion, "--config", str(config)] + uri) == 0
    assert "decision: unchanged" in capsys.readouterr().out
    assert client.get_model_version(name, champion).tags == tags_before
    assert _champion(client, name) == champion
    assert _json_tail_of(["gate", "history", name, "--json"] + uri, capsys)[-1]["decision"] == "unchanged"

    # a version that never held the alias: --force needed, recorded as forced
    never = register_files(client, name, tiny_model_files(seed=1), tmp_path)
    capsys.readouterr()
    assert main(["gate", "rollback", name, "--to", never] + uri) == 2
    assert f"version {never} never held alias 'champion'" in capsys.readouterr().err
    assert _champion(client, name) == champion
    assert main(["gate", "rollback", name, "--to", never, "--force"] + uri) == 0
    assert _champion(client, name) == never
    assert _json_tail_of(["gate", "history", name, "--json"] + uri, capsys)[-1]["reason"].startswith("FORCED")
    # a no-op gate of the new holder, then plain rollbacks go back and forth between versions that held the alias
    assert main(["gate", name, "--candidate", never, "--config", str(config)] + uri) == 0
    assert main(["gate", "rollback", name] + uri) == 0
    assert _champion(client, name) == champion
    assert main(["gate", "rollback", name] + uri) == 0
    assert _champion(client, name) == never
    assert main(["gate", "rollback", name, "--to", champion] + uri) == 0
    assert _champion(client, name) == champion
    tags_now = client.get_model_version(name, champion).tags
    assert {k: v for k, v in tags_now.items() if k in tags_before} == {**tags_before,
                                                                        "gate.champion.decision": "rolled-back"}

    # weights that do not load (1,000 zero bytes) or a model of another width: refused even with --force
    zeros = register_files(client, name, {"config.json": tiny_model_files()["config.json"],
                                          "model.safetensors": bytes(1000)}, tmp_path)
    capsys.readouterr()
    assert main(["gate", "rollback", name, "--to", zeros, "--force"] + uri) == 2
    error = capsys.readouterr().err
    assert f"models:/{name}/{zeros} cannot be loaded" in error and "not a safetensors file" in error
    wider = register_files(client, name, tiny_model_files(num_slots=12), tmp_path)
    assert main(["gate", "rollback", name, "--to", wider, "--force"] + uri) == 2
    assert f"cannot replace version {champion}: feature width 11 instead of 9" in capsys.readouterr().err
    assert _champion(client, name) == champion


def test_a_rollback_is_checked_against_the_index_the_alias_serves(mlflow_server, capsys, tmp_path):
    """The alias moved by hand onto weights that do not load (what a registry edit after a broken upload leaves):
    the check against the champion cannot compare anything (the target is "checked alone"). With --index, the index
    `compat serve` searches (built by `compat index build` with v1, 9-d) refuses a version of another width, of
    another classifier kind, and one whose installed adapter file is gone; v1 is accepted."""
    from mlflow import MlflowClient

    from compat_core.models.compat_model import create_model, model_to_bytes

    client = MlflowClient(mlflow_server.tracking_uri)
    name = f"gate-index-{uuid.uuid4().hex[:6]}"
    uri = ["--tracking-uri", mlflow_server.tracking_uri]
    tiny.register()
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny.scenario("er")))
    v1 = register_files(client, name, tiny_model_files(seed=0), tmp_path)
    assert main(["gate", name, "--candidate", v1, "--config", str(config)] + uri) == 0
    root = tmp_path / "index"
    assert main(["index", "build", str(root), "--config", str(config), "--model", f"models:/{name}@champion"]
                + uri) == 0
    zeros = register_files(client, name, {"config.json": tiny_model_files()["config.json"],
                                          "model.safetensors": bytes(1000)}, tmp_path)
    client.set_registered_model_alias(name, "champion", zeros)
    wider = register_files(client, name, tiny_model_files(num_slots=12), tmp_path)
    learnable = register_files(client, name, model_to_bytes(create_model(
        "cnn4", 10, classifier="learnable", backbone_config={"in_chans": 1, "width": 4})), tmp_path)
    # the install tags of a version whose gate run does not hold the adapter file they name
    orphan = register_files(client, name, tiny_model_files(seed=2), tmp_path)
    gate_run = client.create_run(client.get_experiment_by_name(f"{name}-runs").experiment_id,
                                 tags={"previous_version": v1})
    client.set_terminated(gate_run.info.run_id)
    client.set_model_version_tag(name, orphan, "gate.champion.adapter", "procrustes")
    client.set_model_version_tag(name, orphan, "gate.champion.run_id", gate_run.info.run_id)

    index = ["--index", str(root)]
    capsys.readouterr()
    assert main(["gate", "rollback", name, "--to", wider, "--force"] + index + uri) == 2
    error = capsys.readouterr().err
    assert f"the version behind the alias does not load (models:/{name}/{zeros} cannot be loaded" in error
    assert f"version {wider} is checked alone" in error  # the champion check let it through; the index did not
    assert f"model models:/{name}/{wider} makes 11-d features, the index at {root} (manifest " in error
    assert "holds 9-d embeddings (flat search)" in error
    assert main(["gate", "rollback", name, "--to", learnable, "--force"] + index + uri) == 2
    error = capsys.readouterr().err
    assert (f"models:/{name}/{learnable} cannot search the index at {root} (manifest " in error
            and f"it holds rows embedded by version {v1}, and classifier learnable instead of simplex" in error), error
    assert main(["gate", "rollback", name, "--to", orphan, "--force"] + index + uri) == 2
    error = capsys.readouterr().err
    assert f"models:/{name}/{orphan} was installed with an adapter (tag gate.champion.adapter)" in error, error
    assert _champion(client, name) == zeros  # nothing moved
    # without --index: the index `compat index build` recorded on the registered model is checked all the same
    assert client.get_registered_model(name).tags[
        "serving_index." + hashlib.sha256(str(root).encode()).hexdigest()[:12]] == str(root)
    assert main(["gate", "rollback", name, "--to", wider, "--force"] + uri) == 2
    assert f"model models:/{name}/{wider} makes 11-d features, the index at {root} (manifest " in \
        capsys.readouterr().err
    # a recorded index that is gone is said and skipped; v1, which held the alias and built the index: accepted
    client.set_registered_model_tag(name, "serving_index.000000000000", str(tmp_path / "gone"))
    assert main(["gate", "rollback", name, "--to", v1] + uri) == 0
    assert f"the index at {tmp_path / 'gone'}, recorded when `compat index build` wrote it, is gone; not checked" \
        in capsys.readouterr().err
    assert _champion(client, name) == v1
