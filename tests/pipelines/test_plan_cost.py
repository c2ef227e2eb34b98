"""`compat plan`'s cost: its image counts equal what the training loop's sampler yields in a real run, the
replay-epoch arithmetic by hand, and the critical path of a hand-worked schedule."""
import numpy as np
import pytest
import tiny_scenario_helpers as tiny
import torch

import pipelines.stages.training_stages as train_stages
import pipelines.training.loop as training
import pipelines.training.trainer as trainer
from pipelines.config.load import validate_config
from pipelines.engine.runner import LocalExecutor
from pipelines.graph.compile import compile_scenario
from pipelines.graph.plan_cost import FORWARD_FRACTION, cost_lines, schedule, stage_images
from pipelines.store.run_store import RunStore


def _config(tmp_path, epochs=2):
    document = tiny.scenario("dsimplex-hoc", output=str(tmp_path / "run"))
    document["replay"] = {"per_class": 3, "epoch_length": "reference"}
    document["training"]["epochs"] = epochs
    return validate_config(document)


def test_plan_counts_equal_the_images_the_sampler_yields(tmp_path, monkeypatch):
    tiny.register()
    torch.set_num_threads(1)
    config = _config(tmp_path)
    graph = compile_scenario(config)
    planned = stage_images(graph)

    # count what the training loop actually consumes: every batch the input stream yields to train_task
    seen: dict[tuple[str, int], int] = {}
    real_train_task, real_stream = training.train_task, trainer.stream_batches

    def counting_train_task(model, old_model, method, data, config, **kwargs):
        key = (method.name, data.task)
        seen[key] = 0

        def counting_stream(*args, **stream_kwargs):
            for positions, images in real_stream(*args, **stream_kwargs):
                seen[key] += int(np.asarray(positions).size)
                yield positions, images

        monkeypatch.setattr(trainer, "stream_batches", counting_stream)
        try:
            return real_train_task(model, old_model, method, data, config, **kwargs)
        finally:
            monkeypatch.setattr(trainer, "stream_batches", real_stream)

    monkeypatch.setattr(training, "train_task", counting_train_task)  # pre-training runs it from inside training
    monkeypatch.setattr(train_stages, "train_task", counting_train_task)
    LocalExecutor(progress=False).run(graph, RunStore(tmp_path / "run"))

    pretrain = planned[graph.pretrain_stages["p1"]]
    assert pretrain.train_images == seen[(training.SupervisedPretraining.name, 0)]
    for task, key in enumerate(graph.model_stages):
        assert planned[key].train_images == seen[("dsimplex-hoc", task)], graph[key].label
    # by hand: 2 classes x 10 images per task, batch 8, 2 epochs. Task 0: no memory, batches 8 + 8 + 4 = 20 per epoch.
    # Tasks 1, 2: memory 6 then 12 (3 per seen class); reference epochs hold (20 + 6) // 8 = 3 and (20 + 12) // 8 = 4
    # batches of 8. The pre-training pool: 4 classes x 10 = 40 images = 5 batches of 8.
    assert [planned[k].epoch_images for k in graph.model_stages] == [20, 24, 32]
    assert [planned[k].memory for k in graph.model_stages] == [0, 6, 12]
    assert [planned[k].train_images for k in graph.model_stages] == [40, 48, 64]
    assert pretrain.train_images == 80 and pretrain.forward_images == 0
    # HOC's old model: none at task 0 (no initial_model: random weights), the previous / loaded one after
    assert [planned[k].forward_images for k in graph.model_stages] == [0, 48, 64]
    extract = planned[graph.extract_stages[(0, "query")]]
    assert (extract.train_images, extract.forward_images) == (0, 30)  # 3 classes x 10 images


def test_schedule_critical_path_by_hand(tmp_path):
    tiny.register()
    config = _config(tmp_path, epochs=1)
    graph = compile_scenario(config)
    images = stage_images(graph)
    per_image = 0.5
    plan = schedule(graph, images, per_image)
    # image-units: p1 40 trained; t0 20 (no old model); t1 24 + 24/3 old-model forwards; t2 (replace: needs p1 and
    # t1) 32 + 32/3; every extract 30/3
    third = FORWARD_FRACTION
    units = {"p1": 40, "t0": 20, "t1": 24 * (1 + third), "t2": 32 * (1 + third), "x": 30 * third}
    total = units["p1"] + units["t0"] + units["t1"] + units["t2"] + 6 * units["x"]
    assert plan.sequential_hours == pytest.approx(total * per_image / 3600)
    # t0 + t1 = 52 > p1 = 40, so the longest chain is t0 -> t1 -> t2 -> one of t2's extracts
    chain = units["t0"] + units["t1"] + units["t2"] + units["x"]
    assert plan.critical_hours == pytest.approx(chain * per_image / 3600)
    assert [graph[k].label for k in plan.path][:3] == ["finetune[t=0]", "finetune[t=1]", "replace[t=2]"]
    assert graph[plan.path[-1]].kind == "extract" and graph[plan.path[-1]].task == 2
    # at 20 image-units p1 still runs beside t1 and t0's two extracts: 4 stages at once
    assert plan.peak_stages == 4
    text = "\n".join(cost_lines(graph, per_image, "stated"))
    assert "500 ms per training image (stated)" in text and "critical path" in text


def test_cost_without_readable_data_says_so(tmp_path):
    document = tiny.scenario("dsimplex-hoc", output=str(tmp_path / "run"))
    document["data"] = {"dataset": "celeba", "root": str(tmp_path / "missing"), "split": "train"}
    graph = compile_scenario(validate_config(document))
    (line,) = cost_lines(graph, 0.001, "stated")
    assert line.startswith("cost: unknown, the data cannot be opened") and "missing" in line


def test_calibrated_cost_without_a_measurement_names_the_command(tmp_path, monkeypatch):
    from pipelines.graph.calibrated_cost import calibrated_seconds_per_image

    tiny.register()
    monkeypatch.setenv("COMPAT_CALIBRATION_DIR", str(tmp_path / "empty-cache"))
    config = _config(tmp_path)
    with pytest.raises(ValueError, match=r"--calibrated cpu: no training step of cnn4 is cached.*compat calibrate"):
        calibrated_seconds_per_image(config, "cpu")


def test_calibrated_cost_is_the_cached_training_step_over_its_batch(tmp_path, monkeypatch):
    from compat_core.hardware import calibration
    from compat_core.models.compat_model import create_model
    from pipelines.graph.calibrated_cost import calibrated_seconds_per_image

    tiny.register()
    config = _config(tmp_path)
    model = create_model("cnn4", 10, backbone_config={"in_chans": 1, "width": 4})
    name = calibration.workload_signature(model, torch.zeros(8, 1, 16, 16), train=True)
    document = {"workloads": {name: {"seconds_per_step": {"fp32": 0.8, "bf16": 0.4}, "choice": "bf16"},
                              name.replace("train-", "infer-"): {"seconds_per_step": {"fp32": 9.0}, "choice": "fp32"}}}
    monkeypatch.setattr(calibration, "load", lambda device: document)
    seconds, source = calibrated_seconds_per_image(config, "cpu")
    assert seconds == pytest.approx(0.4 / 8)  # the precision auto chose, per image of the measured batch
    assert name in source and "bf16" in source
