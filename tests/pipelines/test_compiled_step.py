"""The compiled training step (``training.compile``), the fused optimisers and the step without host synchronisation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compat_core.data.source import ArraySource
from compat_core.hardware import compile_probe
from compat_core.models.compat_model import create_model, frozen_copy
from pipelines.methods import get_method
from pipelines.training.loop import train_task
from pipelines.training.settings import TrainConfig
from pipelines.training.task_data import TaskData
from pipelines.training.trainer import Trainer, make_optimizer

K = 16
# fp32 on the CPU: inductor reorders reductions and fuses kernels, so losses differ at rounding level that 20 SGD
# steps amplify a little. bf16 autocast on a GPU is held to 2e-2 relative (bf16 keeps 8 mantissa bits).
FP32_RELATIVE = 1e-4
BF16_RELATIVE = 2e-2


@pytest.fixture(scope="module")
def source() -> ArraySource:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 60, size=(48, 16, 16, 1), dtype=np.uint8)
    labels = np.repeat(np.arange(6), 8)
    for index, label in enumerate(labels):
        row, col = divmod(int(label), 3)
        images[index, 2 + 6 * row: 7 + 6 * row, 1 + 5 * col: 5 + 5 * col] = 230
    return ArraySource(name="squares", images=images, labels=labels, class_names=[str(c) for c in range(6)],
                       hflip=False)


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return create_model("cnn4", K, classifier="simplex", backbone_config={"width": 4, "in_chans": 1})


def task_data(source) -> TaskData:
    labels = source.labels
    indices = np.flatnonzero(labels >= 3)
    memory = np.concatenate([np.flatnonzero(labels == c)[:2] for c in range(3)])
    return TaskData(source=source, task=1, indices=indices, slots=K - 1 - labels[indices], num_old_classes=3,
                    num_new_classes=3, memory_indices=memory, memory_slots=K - 1 - labels[memory])


def config(**overrides) -> TrainConfig:
    values = dict(epochs=4, steps_per_epoch=5, batch_size=8, optimizer={"lr": 0.05}, seed=3, autocast=False,
                  augment=False, log_every_steps=1)
    values.update(overrides)
    return TrainConfig(**values)


def step_losses(source, compile_mode: str) -> list[float]:
    result = train_task(tiny_model(), frozen_copy(tiny_model(seed=1)), get_method("dsimplex-hoc"), task_data(source),
                        config(compile=compile_mode))
    assert [record.step for record in result.records] == list(range(1, 21))  # one record per step
    return [record.loss for record in result.records]


@pytest.mark.slow
def test_compiled_step_matches_the_eager_step_over_20_steps(source):
    eager = step_losses(source, "off")
    compiled = step_losses(source, "on")
    assert len(eager) == len(compiled) == 20
    assert eager[-1] < eager[0]  # it trains
    np.testing.assert_allclose(compiled, eager, rtol=FP32_RELATIVE, atol=1e-6)


def test_the_step_never_reads_a_tensor_back_to_the_host(source, monkeypatch):
    """Between two log records no step calls .item(), .tolist(), float() or bool() on a tensor (each waits for the
    device); the records themselves (every 5 steps here) may."""
    reads: list[str] = []
    inside = {"step": False}
    # .numpy() / .cpu() are left out: the loader turns host-side index tensors into arrays, which waits for nothing
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if inside["step"]:
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    train_step = Trainer.train_step

    def watched(self, positions, images):
        inside["step"] = True
        try:
            return train_step(self, positions, images)
        finally:
            inside["step"] = False

    monkeypatch.setattr(Trainer, "train_step", watched)
    result = train_task(tiny_model(), frozen_copy(tiny_model(seed=1)), get_method("dsimplex-hoc"), task_data(source),
                        config(epochs=1, log_every_steps=5))
    assert result.records and reads == []


def test_optimisers_are_fused_only_on_cuda():
    parameters = [torch.nn.Parameter(torch.zeros(3))]
    for name in ("sgd", "adamw"):
        optimizer = make_optimizer(parameters, config(optimizer={"name": name, "lr": 0.1}))
        assert not optimizer.param_groups[0].get("fused")
        if torch.cuda.is_available():
            cuda = [torch.nn.Parameter(torch.zeros(3, device="cuda"))]
            optimizer = make_optimizer(cuda, config(optimizer={"name": name, "lr": 0.1}, device="cuda"))
            assert optimizer.param_groups[0]["fused"] is True


def test_compile_pays_only_after_its_compile_time():
    measured = {"eager_s": 0.10, "compiled_s": 0.08, "compile_s": 30.0, "probe_batch": 16}
    # per step at batch 32: eager 0.2 s, compiled 0.16 s; 30 s of compile are repaid after 750 steps (+2 % margin)
    assert not compile_probe.compile_pays(measured, steps=700, batch_size=32)
    assert compile_probe.compile_pays(measured, steps=1000, batch_size=32)
    assert not compile_probe.compile_pays({**measured, "compiled_s": 0.12}, steps=10 ** 6, batch_size=32)


def test_compile_auto_reads_the_cached_probe_and_measures_nothing_twice(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPAT_CALIBRATION_DIR", str(tmp_path))
    monkeypatch.delenv("COMPAT_CALIBRATION", raising=False)
    calls = []

    def fake_measure(model, example, device, dtype=None):
        calls.append(tuple(example.shape))
        return {"eager_s": 0.10, "compiled_s": 0.05, "compile_s": 10.0, "probe_batch": int(example.shape[0]),
                "measured_at": "now"}

    monkeypatch.setattr(compile_probe, "measure_compile", fake_measure)
    model, example = tiny_model(), torch.zeros(16, 1, 16, 16)
    assert not compile_probe.compile_choice("cpu", model, example, steps=100, batch_size=16)   # 10 s > 5 s saved
    assert compile_probe.compile_choice("cpu", model, example, steps=1000, batch_size=16)      # 10 s < 50 s saved
    assert calls == [(16, 1, 16, 16)]
    monkeypatch.setenv("COMPAT_CALIBRATION", "off")
    assert not compile_probe.compile_choice("cpu", model, example, steps=10 ** 6, batch_size=16)


def test_the_resolved_compile_setting_is_in_the_training_stage_key():
    from pipelines.stages.inputs import TrainRecipe

    on, off = TrainRecipe.of(config(compile="on")), TrainRecipe.of(config(compile="off"))
    assert on.compile == "on" and off.compile == "off"
    assert on.model_dump() != off.model_dump()
    with pytest.raises(ValueError, match="compile"):
        TrainConfig(compile="yes")


def test_calibrate_show_lists_the_compile_probe(tmp_path, monkeypatch):
    from compat_core.hardware import calibration

    monkeypatch.setenv("COMPAT_CALIBRATION_DIR", str(tmp_path))
    calibration._update("cpu", "compile", "train-CNN4-x", {"eager_s": 0.01, "compiled_s": 0.005, "compile_s": 12.0,
                                                          "probe_batch": 16})
    shown = calibration.format_calibration(calibration.load("cpu"))
    assert "compile train-CNN4-x: eager 10.0 ms, compiled 5.0 ms per step, compile 12.0 s" in shown
