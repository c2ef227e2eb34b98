"""Calibration: measured once per machine key, cached as JSON, read by retrieval "auto" and training "auto"."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from app.cli import main
from compat_core.hardware import calibration
from compat_core.hardware import workloads as calibration_workloads
from pipelines.training.autocast import resolve_autocast


@pytest.fixture
def calibrating(tmp_path, monkeypatch):
    """Calibration switched on against an empty temporary cache, with small shapes (seconds at most)."""
    monkeypatch.setenv(calibration.MODE_ENV, "on")
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(calibration, "GEMM_SHAPE", (64, 128, 256))
    monkeypatch.setattr(calibration, "_PROBE_SHAPE", (32, 64, 64))
    calibration._gemm_rates_cached.cache_clear()
    yield tmp_path / "cache"
    calibration._gemm_rates_cached.cache_clear()


def write_gemm(rates: dict[str, float]) -> None:
    """A cache file for this machine's key holding the given GOP/s (what a previous measurement left)."""
    path = calibration.cache_path("cpu")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": 1, "key": calibration.machine_key("cpu"), "workloads": {},
                                "gemm": {"shape": [1, 1, 1], "gops": rates, "probe_only": [], "seconds": 0.0,
                                         "measured_at": "x"}}))
    calibration._gemm_rates_cached.cache_clear()


def test_gemm_is_measured_once_and_cached_under_the_machine_key(calibrating, monkeypatch):
    rates = calibration.gemm_rates("cpu")
    assert set(rates) == set(calibration.GEMM_DTYPES)
    assert rates["fp32"] > 0 and rates["int8"] > 0 and rates["bf16"] > 0
    path = calibration.cache_path("cpu")
    assert path.parent == calibrating and path.exists()
    document = json.loads(path.read_text())
    assert document["key"]["threads"] == torch.get_num_threads()
    assert document["key"]["torch"] == torch.__version__
    assert document["gemm"]["shape"] == [64, 128, 256]
    assert document["gemm"]["gops"] == rates

    def refuse(*args, **kwargs):
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(calibration, "measure_gemm", refuse)
    calibration._gemm_rates_cached.cache_clear()
    assert calibration.gemm_rates("cpu") == rates                # read back from the file, not re-measured
    # another thread count is another key: another file
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        assert calibration.cache_path("cpu") != path
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rates, expected", [
    ({"fp32": 100.0, "bf16": 90.0, "fp16": 1.0, "int8": 300.0}, "int8"),
    ({"fp32": 100.0, "bf16": 250.0, "fp16": 1.0, "int8": 300.0}, "bf16"),     # int8 needs 1.25x the best float
    ({"fp32": 100.0, "bf16": 250.0, "fp16": 1.0, "int8": 320.0}, "int8"),
    ({"fp32": 100.0, "bf16": 250.0, "fp16": 1.0, "int8": 200.0}, "bf16"),
    ({"fp32": 100.0, "bf16": 101.0, "fp16": 1.0, "int8": 50.0}, "fp32"),     # within the 2 % margin: fp32
    ({"fp32": 100.0, "bf16": 50.0, "fp16": 400.0, "int8": 0.0}, "fp16"),
])
def test_fastest_matmul_reads_the_measured_rates(calibrating, rates, expected):
    write_gemm(rates)
    assert calibration.fastest_matmul("cpu") == expected


def test_unreadable_cache_is_measured_again(calibrating):
    path = calibration.cache_path("cpu")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert calibration.load("cpu") is None
    assert calibration.gemm_rates("cpu")["fp32"] > 0
    assert calibration.load("cpu")["gemm"]["gops"]["fp32"] > 0


def test_off_measures_nothing_and_means_fp32(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.MODE_ENV, "off")
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path / "cache"))
    assert calibration.fastest_matmul("cpu") == "fp32"
    assert calibration_workloads.autocast_choice("cpu", tiny_conv_net(), torch.zeros(4, 1, 8, 8)) is None
    assert not (tmp_path / "cache").exists()
    monkeypatch.setenv(calibration.MODE_ENV, "sometimes")
    with pytest.raises(ValueError, match="COMPAT_CALIBRATION"):
        calibration.calibration_enabled()


def tiny_conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5),
                         nn.Flatten(), nn.Linear(4 * 8 * 8, 5))


def test_autocast_choice_times_copies_and_leaves_model_and_rng_alone(calibrating, monkeypatch):
    model = tiny_conv_net()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    example = torch.randn(6, 1, 8, 8)
    rng = torch.get_rng_state()
    choice = calibration_workloads.autocast_choice("cpu", model, example, train=True)
    assert torch.equal(torch.get_rng_state(), rng)                  # dropout in the timed steps drew nothing here
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name               # weights and batch-norm statistics untouched
    assert model.training and next(model.parameters()).is_contiguous()
    entry = calibration.load("cpu")["workloads"][calibration.workload_signature(model, example, True)]
    seconds = entry["seconds_per_step"]
    assert set(seconds) == {"fp32", "bf16"} and min(seconds.values()) > 0
    faster_half = seconds["fp32"] > 1.02 * seconds["bf16"]
    assert entry["choice"] == ("bf16" if faster_half else "fp32")
    assert choice == (torch.bfloat16 if faster_half else None)

    def refuse(*args, **kwargs):
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(calibration_workloads, "measure_workload", refuse)
    assert calibration_workloads.autocast_choice("cpu", model, example, train=True) == choice
    # inference is its own workload
    monkeypatch.undo()
    monkeypatch.setenv(calibration.MODE_ENV, "on")
    monkeypatch.setenv(calibration.CACHE_ENV, str(calibrating))
    calibration_workloads.autocast_choice("cpu", model, example, train=False)
    assert calibration.workload_signature(model, example, False) in calibration.load("cpu")["workloads"]


@pytest.mark.parametrize("cached, resolved", [("bf16", "bf16"), ("fp32", "off")])
def test_training_auto_resolves_through_the_cached_choice(calibrating, cached, resolved):
    model = tiny_conv_net()
    example = torch.zeros(4, 1, 8, 8)
    write_gemm({"fp32": 1.0, "bf16": 1.0, "fp16": 1.0, "int8": 1.0})
    path = calibration.cache_path("cpu")
    document = json.loads(path.read_text())
    document["workloads"][calibration.workload_signature(model, example, True)] = {
        "seconds_per_step": {"fp32": 1.0, "bf16": 1.0}, "choice": cached, "measured_at": "x"}
    path.write_text(json.dumps(document))
    assert resolve_autocast("auto", "cpu", model, example) == resolved
    assert resolve_autocast(True, "cpu", model, example) == resolved
    assert resolve_autocast("bf16", "cpu", model, example) == "bf16"     # forced modes are never measured
    assert resolve_autocast(False, "cpu", model, example) == "off"


def test_calibrate_command_measures_then_shows(calibrating, capsys):
    assert main(["calibrate", "--show"]) == 0
    assert "no calibration cached" in capsys.readouterr().out
    assert main(["calibrate"]) == 0
    measured = capsys.readouterr().out
    for name in calibration.GEMM_DTYPES:
        assert f"    {name}" in measured
    assert "retrieval precision=auto candidate pass:" in measured
    assert main(["calibrate", "--show"]) == 0
    assert capsys.readouterr().out == measured                        # shown from the cache, not re-measured
    assert main(["calibrate", "--threads", "0"]) == 2


def test_training_auto_is_bit_identical_whether_measured_now_or_cached(calibrating):
    # the first run measures inside train_task; the second reads the cache: same weights to the bit, and the same
    # weights as the forced mode the calibration chose
    import numpy as np

    from compat_core.data.source import ArraySource
    from compat_core.models.compat_model import create_model
    from pipelines.methods import get_method
    from pipelines.training.loop import train_task
    from pipelines.training.settings import TrainConfig
    from pipelines.training.task_data import TaskData

    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, size=(24, 16, 16, 1), dtype=np.uint8)
    labels = np.repeat(np.arange(3), 8)
    source = ArraySource(name="noise", images=images, labels=labels, class_names=["a", "b", "c"], hflip=False)

    def run(autocast):
        torch.manual_seed(0)
        model = create_model("cnn4", 8, classifier="simplex", backbone_config={"width": 4, "in_chans": 1})
        data = TaskData(source=source, task=0, indices=np.arange(24), slots=7 - labels, num_old_classes=0,
                        num_new_classes=3)
        config = TrainConfig(epochs=1, batch_size=8, optimizer={"lr": 0.05}, seed=3, autocast=autocast)
        return train_task(model, None, get_method("dsimplex-hoc"), data, config).model.state_dict()

    measured = run("auto")
    entries = calibration.load("cpu")["workloads"]
    assert len(entries) == 1
    cached = run("auto")
    forced = run({"fp32": "off"}.get(next(iter(entries.values()))["choice"], "bf16"))
    for name, value in measured.items():
        assert torch.equal(value, cached[name]), name
        assert torch.equal(value, forced[name]), name


def test_probe_only_drops_paths_far_slower_than_fp32(calibrating, monkeypatch):
    # the 64-row probe is no ranking: a half product there pays mostly for re-packing its operand, so bf16 at
    # 0.3x fp32 on the probe must still be timed at the full shape; fp16 at 0.03x is not
    probe_seconds = {"fp32": 1e-5, "bf16": 1e-5 / 0.3, "fp16": 1e-5 / 0.03, "int8": 0.5e-5}
    order = iter(calibration.GEMM_DTYPES)
    monkeypatch.setattr(calibration, "_min_call_time", lambda function, device: probe_seconds[next(order)])
    timed = []
    original = calibration._time_rounds

    def record(functions, device, rounds, *spread):
        timed.extend(functions)
        return original(functions, device, rounds, *spread)

    monkeypatch.setattr(calibration, "_time_rounds", record)
    result = calibration.measure_gemm("cpu")
    assert sorted(timed) == ["bf16", "fp32", "int8"]
    assert result["probe_only"] == ["fp16"]
    assert result["gops"]["fp16"] == pytest.approx(2.0 * 32 * 64 * 64 / (1e-5 / 0.03) / 1e9, rel=1e-3)
    # a path that passes the fp32 fraction but would take seconds per full-shape call keeps its probe rate
    monkeypatch.setattr(calibration, "_FULL_CALL_MAX_S", 1e-9)
    order = iter(calibration.GEMM_DTYPES)
    timed.clear()
    result = calibration.measure_gemm("cpu")
    assert timed == ["fp32"] and result["probe_only"] == ["bf16", "fp16", "int8"]


def test_workload_is_timed_on_a_probe_batch_of_one_copy(calibrating, monkeypatch):
    """A training batch of 320 is cut to PROBE_BATCH rows before any step, and one private copy serves both paths."""
    seen_rows: list[int] = []

    class Recording(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 4)

        def forward(self, x):
            seen_rows.append(int(x.shape[0]))
            return self.linear(x)

    copies: list[int] = []
    real_deepcopy = calibration_workloads.copy.deepcopy

    def counting_deepcopy(value, *args, **kwargs):
        if isinstance(value, Recording):
            copies.append(1)
        return real_deepcopy(value, *args, **kwargs)

    monkeypatch.setattr(calibration_workloads.copy, "deepcopy", counting_deepcopy)
    model = Recording()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    choice = calibration_workloads.autocast_choice("cpu", model, torch.randn(320, 8), train=True)
    assert choice in (None, torch.bfloat16, torch.float16)
    assert seen_rows and set(seen_rows) == {calibration_workloads.PROBE_BATCH}
    assert len(copies) == 1
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    document = calibration.load(torch.device("cpu"))
    entries = list(document["workloads"].values())
    assert len(entries) == 1 and entries[0]["probe_batch"] == calibration_workloads.PROBE_BATCH
    assert next(iter(document["workloads"])).endswith(f"in{calibration_workloads.PROBE_BATCH}x8")


def test_a_noisy_product_measurement_is_provisional_and_measured_again_later(calibrating, monkeypatch):
    # the rounds of each path: a quiet machine gives nearly equal times, a busy one a wide spread
    rounds = {"quiet": [1.0, 1.02, 1.01, 1.03, 1.0], "busy": [1.0, 1.9, 2.4, 1.5, 3.0]}
    state = {"machine": "busy", "measured": 0}
    clock = {"now": 1_000_000.0}

    def timings(functions, device, count, spread=None):
        state["measured"] += 1
        values = rounds[state["machine"]]
        if spread is not None:
            for name in functions:
                spread[name] = (sorted(values)[len(values) // 2] - min(values)) / min(values)
        return {name: 1e-3 * min(values) for name in functions}

    monkeypatch.setattr(calibration, "_time_rounds", timings)
    monkeypatch.setattr(calibration.time, "time", lambda: clock["now"])
    calibration.gemm_rates("cpu")
    document = calibration.load("cpu")["gemm"]
    assert document["final"] is False and document["spread"]["fp32"] == pytest.approx(0.9)
    assert "provisional" in calibration.format_calibration(calibration.load("cpu"))
    # another process soon after uses the provisional rates without measuring again
    calibration._gemm_rates_cached.cache_clear()
    clock["now"] += calibration._RETRY_S / 2
    calibration.gemm_rates("cpu")
    assert state["measured"] == 1
    # later, on a quiet machine, it is measured again and becomes final; then it stays
    calibration._gemm_rates_cached.cache_clear()
    clock["now"] += calibration._RETRY_S
    state["machine"] = "quiet"
    calibration.gemm_rates("cpu")
    assert state["measured"] == 2 and calibration.load("cpu")["gemm"]["final"] is True
    calibration._gemm_rates_cached.cache_clear()
    clock["now"] += 100 * calibration._RETRY_S
    calibration.gemm_rates("cpu")
    assert state["measured"] == 2
