"""A run folder records what ran: config.yaml is the resolved config (absolute output folder, resolved precision)
under a header naming the code version, precision, command and overrides, and running that file again resumes the
same run in the same folder; ``training.autocast: auto`` is resolved once before any stage, into every key it
changes, the manifests, config.yaml, the report and the MLflow params."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import tiny_scenario_helpers as tiny
import torch
import yaml

from app.cli import main
from cluster.ray import jobs
from compat_core.hardware import calibration
from compat_core.hardware.workloads import PROBE_BATCH
from pipelines.config.load import load_config, validate_config
from pipelines.config.run_origin import RunOrigin
from pipelines.graph.code_version import code_version
from pipelines.graph.compile import compile_scenario
from pipelines.stages.run_precision import precision_probe, resolve_run_precision
from pipelines.training.settings import precision_name

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _manifests(run_dir) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in (run_dir / "manifests").glob("*.json")}


def test_config_yaml_is_what_ran_and_running_it_again_resumes_in_the_same_folder(tmp_path, monkeypatch, capsys):
    tiny.register()
    source = tmp_path / "configs" / "tiny.yaml"
    source.parent.mkdir()
    source.write_text(yaml.safe_dump(tiny.scenario("dsimplex-hoc", output="runs/elsewhere")))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "configs/tiny.yaml", "--output", "runs/hoc", "--set", "training.epochs=2",
                 "--no-progress", "--tracking-uri", "none"]) == 0
    run_dir = tmp_path / "runs" / "hoc"
    first = _manifests(run_dir)
    assert len(first) == 19 and not (tmp_path / "runs" / "elsewhere").exists()

    text = (run_dir / "config.yaml").read_text()
    recorded = yaml.safe_load(text)
    assert recorded["output"]["dir"] == str(run_dir)  # the folder it ran in, absolute, not the file's output.dir
    assert recorded["training"]["epochs"] == 2 and recorded["training"]["autocast"] == "off"
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert f"# code version: {code_version()}" in header
    assert "# precision: fp32 (training.autocast as resolved for this run)" in header
    assert ("# command: compat run configs/tiny.yaml --output runs/hoc --set training.epochs=2 --no-progress "
            "--tracking-uri none") in header
    assert "# overrides: training.epochs=2" in header
    (execution,) = [json.loads(path.read_text()) for path in (run_dir / "executions").iterdir()]
    assert execution["overrides"] == ["training.epochs=2"] and execution["code_version"] == code_version()
    assert execution["precision"] == "fp32" and execution["command"].startswith("compat run configs/tiny.yaml")
    capsys.readouterr()

    # the recorded file, from another folder: the same stage keys, every one already committed, in the same folder
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    assert main(["run", str(run_dir / "config.yaml"), "--no-progress", "--tracking-uri", "none"]) == 0
    assert f"run directory: {run_dir} (0 stages run, 19 already done; precision fp32" in capsys.readouterr().out
    assert _manifests(run_dir) == first
    assert list((tmp_path / "other").iterdir()) == []
    assert (run_dir / "config.yaml").read_text() == text  # still names the command that made the run


def _force_calibration_choice(config, choice: str, folder, monkeypatch) -> None:
    """This machine's calibration cache says ``choice`` is the faster training step of the config's model (as a
    measurement on a machine with fast bf16 would), so ``auto`` resolves to it without timing anything here."""
    monkeypatch.setenv(calibration.MODE_ENV, "on")
    monkeypatch.setenv(calibration.CACHE_ENV, str(folder))
    device = torch.device("cpu")
    model, example = precision_probe(config, device)
    name = calibration.workload_signature(model, example[:PROBE_BATCH], True)
    with calibration._locked(device):
        calibration._update(device, "workloads", name, {"choice": choice,
                                                        "seconds_per_step": {"fp32": 2.0, choice: 1.0}})


def _pinned(document: dict, autocast) -> dict:
    """``document`` with ``training.autocast`` set, and the layout pinned (contiguous), which calibration would
    otherwise measure for this conv net in the auto-resolved run only."""
    changed = json.loads(json.dumps(document))
    changed["training"]["autocast"] = autocast
    changed["training"]["channels_last"] = "off"
    return changed


def test_auto_precision_resolves_once_into_keys_equal_to_the_pinned_precision(tmp_path, monkeypatch):
    tiny.register()
    document = _pinned(tiny.scenario("dsimplex-hoc", output=str(tmp_path / "run")), "auto")
    config = validate_config(document)
    _force_calibration_choice(config, "bf16", tmp_path / "calibration", monkeypatch)
    resolved = resolve_run_precision(config)
    assert resolved.training.autocast == "bf16" and config.training.autocast == "auto"

    auto_graph = compile_scenario(resolved)
    bf16_graph = compile_scenario(validate_config(_pinned(document, "bf16")))
    fp32_graph = compile_scenario(validate_config(_pinned(document, "off")))
    assert [stage.key for stage in auto_graph] == [stage.key for stage in bf16_graph]
    assert [stage.key for stage in compile_scenario(validate_config(_pinned(document, False)))] == \
        [stage.key for stage in fp32_graph]  # false and off are one setting, one key
    with_precision = [stage for stage in auto_graph if stage.inputs.precision is not None]
    assert {stage.kind for stage in with_precision} == {"pretrain", "finetune", "replace", "extract"}
    assert {stage.inputs.precision for stage in with_precision} == {"bf16"}
    assert not {stage.key for stage in auto_graph} & {stage.key for stage in fp32_graph}

    # a pinned precision is never measured: calibration off or on, the same keys
    monkeypatch.setenv(calibration.MODE_ENV, "off")
    assert resolve_run_precision(validate_config(_pinned(document, "bf16"))).training.autocast == "bf16"
    assert resolve_run_precision(config).training.autocast == "off"  # auto without calibration: fp32


def test_resolved_precision_is_in_manifests_config_report_and_mlflow_params(tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient

    tiny.register()
    document = _pinned(tiny.scenario("dsimplex-hoc", output=str(tmp_path / "run")), "auto")
    _force_calibration_choice(validate_config(document), "bf16", tmp_path / "calibration", monkeypatch)
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(document))
    database = tmp_path / "mlflow.db"
    assert main(["run", str(path), "--no-progress", "--tracking-uri", f"sqlite:///{database}"]) == 0
    assert "precision bf16" in capsys.readouterr().out
    run_dir = tmp_path / "run"
    manifests = _manifests(run_dir)
    expected = compile_scenario(validate_config(_pinned(document, "bf16")))
    assert sorted(manifests) == sorted(stage.key for stage in expected)
    for stage in expected:
        assert manifests[stage.key].get("precision") == stage.inputs.precision, stage.label
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["training"]["autocast"] == "bf16"
    assert "- precision: bf16 (`training.autocast` as resolved for this run)" in (run_dir / "report.md").read_text()
    client = MlflowClient(tracking_uri=f"sqlite:///{database}")
    runs = client.search_runs([client.get_experiment_by_name("tiny-dsimplex-hoc").experiment_id], max_results=100)
    (parent,) = [run for run in runs if run.data.tags.get("run_role") == "pipeline"]
    assert parent.data.params["training.autocast"] == "bf16"


def test_the_shipped_demo_configs_pin_fp32():
    for name in ("demo-er.yaml", "demo-dsimplex-hoc.yaml"):
        config = load_config(CONFIGS / name)
        assert precision_name(config.training.autocast) == "fp32", name
        assert config.training.channels_last == "off", name  # the layout is pinned too: the same numbers anywhere


def test_a_submitted_job_records_the_submit_command_and_its_overrides(tmp_path, capsys):
    """`compat submit` stages the overridden scenario and the job runs `compat run` on it: the job's config.yaml
    names the submit command and its overrides (passed on the job's command line), with credentials redacted."""
    origin = RunOrigin.of_command(["submit", "c.yaml", "--set", "training.epochs=2", "--tracking-uri",
                                   "http://user:hunter2@127.0.0.1:5000"], ["training.epochs=2"])
    entrypoint = jobs.pipeline_entrypoint("/runs/hoc", origin=origin)
    assert "hunter2" not in entrypoint
    arguments = shlex.split(entrypoint.split('exec "$py" -m app.cli ', 1)[1])
    assert arguments[-4:] == ["--origin-command", "compat submit c.yaml --set training.epochs=2 --tracking-uri "
                              "'http://user:***@127.0.0.1:5000'", "--origin-set", "training.epochs=2"]

    tiny.register()
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(tiny.scenario("dsimplex-hoc", output=str(tmp_path / "run"))))
    arguments[arguments.index("scenario.yaml")] = str(path)
    arguments[arguments.index("--executor") + 1] = "local"  # the job's command line, run here in-process
    arguments.remove("--address"), arguments.remove("auto")
    arguments[arguments.index("--output") + 1] = str(tmp_path / "run")
    assert main([*arguments, "--tracking-uri", "none"]) == 0
    header = (tmp_path / "run" / "config.yaml").read_text().splitlines()
    assert ("# command: compat submit c.yaml --set training.epochs=2 --tracking-uri "
            "'http://user:***@127.0.0.1:5000'") in header
    assert "# overrides: training.epochs=2" in header
