"""The channels_last training layout (``training.channels_last``): the same losses as the contiguous step within fp32
rounding, the probe behind ``auto`` cached per machine, the resolved value in the stage key and manifest, and ``on``
refused for a backbone without convolutions."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from compat_core.hardware import layout_probe
from compat_core.models.backbones import BACKBONES, create_backbone, small_test_config
from compat_core.models.compat_model import create_model, frozen_copy
from compat_core.models.precision import has_convolutions
from pipelines.config.load import ConfigError, validate_config
from pipelines.methods import get_method
from pipelines.training.autocast import resolve_channels_last
from pipelines.training.loop import train_task

from test_compiled_step import FP32_RELATIVE, config, source, task_data, tiny_model  # noqa: F401

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _conv_weight(model: torch.nn.Module) -> torch.Tensor:
    """A conv weight with several input channels (one channel is both layouts at once)."""
    return next(m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.in_channels > 1)


def step_losses(source, layout: str) -> tuple[list[float], torch.nn.Module]:
    result = train_task(tiny_model(), frozen_copy(tiny_model(seed=1)), get_method("dsimplex-hoc"), task_data(source),
                        config(channels_last=layout))
    assert [record.step for record in result.records] == list(range(1, 21))  # one record per step
    return [record.loss for record in result.records], result.model


def test_channels_last_step_matches_the_contiguous_step_over_20_steps(source):
    contiguous, plain = step_losses(source, "off")
    nhwc, model = step_losses(source, "on")
    # the layouts really differ (a test of two identical paths could not fail)
    assert _conv_weight(model).is_contiguous(memory_format=torch.channels_last)
    assert not _conv_weight(model).is_contiguous()
    assert _conv_weight(plain).is_contiguous()
    assert contiguous[-1] < contiguous[0]  # it trains
    np.testing.assert_allclose(nhwc, contiguous, rtol=FP32_RELATIVE, atol=1e-6)


def test_every_backbone_card_says_whether_it_has_convolutions():
    for name in BACKBONES.names():
        built = create_backbone(name, **small_test_config(name))
        assert BACKBONES.get(name).convolutional == has_convolutions(built), name


def test_on_is_refused_for_a_backbone_without_convolutions():
    document = yaml.safe_load((CONFIGS / "demo-dsimplex-hoc.yaml").read_text())
    document["model"]["backbone"] = "dinov3_vits16"
    document["model"]["backbone_config"] = small_test_config("dinov3_vits16")
    document.setdefault("training", {})["channels_last"] = "on"
    with pytest.raises(ConfigError) as error:
        validate_config(document)
    assert ("training.channels_last: on needs convolutional backbones; model.backbone is 'dinov3_vits16'"
            in str(error.value))
    document["training"]["channels_last"] = "auto"
    assert validate_config(document).training.channels_last == "auto"
    vit = create_model("dinov3_vits16", 16, classifier="simplex", backbone_config=small_test_config("dinov3_vits16"))
    with pytest.raises(ValueError, match="training.channels_last: on needs a convolutional backbone"):
        resolve_channels_last("on", "cpu", vit, None)
    assert resolve_channels_last("auto", "cpu", vit, None) == "off"  # nothing to measure


def test_auto_reads_the_cached_probe_and_measures_nothing_twice(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPAT_CALIBRATION_DIR", str(tmp_path))
    monkeypatch.delenv("COMPAT_CALIBRATION", raising=False)
    calls = []
    timings = {"contiguous_s": 0.010, "channels_last_s": 0.008}

    def fake_measure(model, example, device, dtype=None):
        calls.append((tuple(example.shape), dtype))
        measured = {**timings, "probe_batch": int(example.shape[0]), "measured_at": "now"}
        return {**measured, "choice": "on" if layout_probe.channels_last_pays(measured) else "off"}

    monkeypatch.setattr(layout_probe, "measure_layouts", fake_measure)
    model, example = tiny_model(), torch.zeros(16, 1, 16, 16)
    assert resolve_channels_last("auto", "cpu", model, example) == "on"
    assert resolve_channels_last("auto", "cpu", model, example) == "on"
    assert calls == [((16, 1, 16, 16), None)]
    assert resolve_channels_last("auto", "cpu", model, example, "bf16") == "on"   # another dtype: its own probe
    assert len(calls) == 2
    assert not layout_probe.channels_last_pays({"contiguous_s": 0.0101, "channels_last_s": 0.0100})  # < 2 %
    monkeypatch.setenv("COMPAT_CALIBRATION", "off")
    assert resolve_channels_last("auto", "cpu", tiny_model(seed=5), example, "fp16") == "off"
    assert len(calls) == 2


def test_the_real_probe_times_both_layouts(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPAT_CALIBRATION_DIR", str(tmp_path))
    measured = layout_probe.measure_layouts(tiny_model(), torch.rand(8, 1, 16, 16), "cpu")
    assert measured["contiguous_s"] > 0 and measured["channels_last_s"] > 0 and measured["probe_batch"] == 8
    assert measured["choice"] == ("on" if layout_probe.channels_last_pays(measured) else "off")


def test_the_resolved_layout_is_in_the_stage_key_and_calibrate_show_lists_the_probe(tmp_path, monkeypatch):
    from compat_core.hardware import calibration
    from pipelines.stages.inputs import TrainRecipe

    on, off = TrainRecipe.of(config(channels_last="on")), TrainRecipe.of(config(channels_last="off"))
    assert on.channels_last == "on" and off.channels_last == "off" and on.model_dump() != off.model_dump()
    monkeypatch.setenv("COMPAT_CALIBRATION_DIR", str(tmp_path))
    calibration._update("cpu", "channels_last", "train-CNN4-x", {"contiguous_s": 0.01, "channels_last_s": 0.005,
                                                                "probe_batch": 16, "choice": "on"})
    shown = calibration.format_calibration(calibration.load("cpu"))
    assert "channels_last train-CNN4-x: contiguous 10.0 ms, channels_last 5.0 ms per step -> channels_last auto = on" \
        in shown


def test_the_resolved_layout_is_in_manifests_config_report_and_mlflow_params(tmp_path, monkeypatch):
    """``auto`` resolved once on the driver from this machine's cached probe (it says channels_last pays, as on a
    GPU), then recorded like the compile mode: every training stage's manifest, config.yaml, report.md and the
    pipeline run's MLflow params."""
    import json

    import tiny_scenario_helpers as tiny
    from mlflow import MlflowClient

    from app.cli import main
    from compat_core.hardware import calibration
    from compat_core.hardware.workloads import PROBE_BATCH
    from pipelines.stages.run_precision import precision_probe

    tiny.register()
    document = tiny.scenario("dsimplex-hoc", output=str(tmp_path / "run"))
    document["training"].update(autocast="off", channels_last="auto")
    config = validate_config(document)
    monkeypatch.setenv(calibration.MODE_ENV, "on")
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path / "calibration"))
    model, example = precision_probe(config, torch.device("cpu"))
    name = f"{calibration.workload_signature(model, example[:PROBE_BATCH], True)}-fp32"
    with calibration._locked("cpu"):
        calibration._update("cpu", "channels_last", name, {"contiguous_s": 2.0, "channels_last_s": 1.0,
                                                           "probe_batch": PROBE_BATCH, "choice": "on"})
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(document))
    database = tmp_path / "mlflow.db"
    assert main(["run", str(path), "--no-progress", "--tracking-uri", f"sqlite:///{database}"]) == 0
    run_dir = tmp_path / "run"
    manifests = [json.loads(p.read_text()) for p in (run_dir / "manifests").glob("*.json")]
    trained = [m for m in manifests if m["stage_key"].split("-")[0] in ("pretrain", "finetune", "replace")]
    assert trained and {m.get("channels_last") for m in trained} == {"on"}
    assert all("channels_last" not in m for m in manifests if m not in trained)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["training"]["channels_last"] == "on"
    assert "- channels_last training layout: on (`training.channels_last` as resolved for this run)" in \
        (run_dir / "report.md").read_text()
    client = MlflowClient(tracking_uri=f"sqlite:///{database}")
    runs = client.search_runs([client.get_experiment_by_name("tiny-dsimplex-hoc").experiment_id], max_results=100)
    (parent,) = [run for run in runs if run.data.tags.get("run_role") == "pipeline"]
    assert parent.data.params["training.channels_last"] == "on"


def test_a_bare_yaml_on_or_off_is_the_same_switch():
    from pipelines.training.settings import TrainConfig

    assert yaml.safe_load("channels_last: on")["channels_last"] is True   # why the setting accepts booleans
    assert TrainConfig(channels_last=True).channels_last == "on"
    assert TrainConfig(channels_last=False).channels_last == "off"
    with pytest.raises(ValueError, match="channels_last"):
        TrainConfig(channels_last="yes")


def test_training_compile_takes_a_bare_yaml_on_or_off_too():
    """The three auto|on|off switches read the same: a config that writes ``compile: on`` unquoted compiles."""
    from pipelines.training.settings import TrainConfig

    assert TrainConfig(**yaml.safe_load("compile: on")).compile == "on"
    assert TrainConfig(**yaml.safe_load("compile: off")).compile == "off"
    with pytest.raises(ValueError, match="compile"):
        TrainConfig(compile="yes")
