"""Data-parallel training through Ray Train (``resources.<stage>.num_workers``): 2 gloo CPU workers vs 1 process.

Tolerance. Two workers compute the loss of exactly the same global batch (same samples, same augmentation draws,
InfoNCE over the gathered features); what differs is float summation order: the convolutions run on 4-row instead
of 8-row batches and the parameter gradient is the sum of two half-batch sums (DDP's all-reduce) instead of one.
Each reordered fp32 sum differs by at most ~n * 2^-24 relative (n = 8 rows: ~5e-7), and the few SGD steps here
(lr 0.05) do not amplify that by more than ~10x, so per-step losses must agree to 1e-5 relative and the weights to
1e-5 absolute; measured differences are ~1e-7 (see docs/data_parallel.md). A wrong shard, a missing gather (local
InfoNCE over 4 rows) or an un-averaged gradient changes the loss at the first step by > 1e-2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

from pipelines.config.load import validate_config  # noqa: E402
from pipelines.engine.runner import LocalExecutor  # noqa: E402
from pipelines.graph.compile import compile_scenario  # noqa: E402
from pipelines.store.run_store import RunStore  # noqa: E402

RELATIVE_LOSS_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 1e-5
BACKBONE = {"backbone": "lenetpp", "backbone_config": {"in_chans": 1, "img_size": 16, "embed_dim": 8}}


def _task():
    """HOC task 2 of 2: a model and its frozen copy as the old model, a replay memory, crop augmentation on."""
    from compat_core.models.compat_model import create_model
    from compat_core.models.compat_model import frozen_copy
    from pipelines.methods import get_method
    from pipelines.training.settings import TrainConfig
    from pipelines.training.task_data import TaskData

    source = tiny.make_source("finetune")
    torch.manual_seed(0)
    model = create_model(BACKBONE["backbone"], num_slots=10, backbone_config=BACKBONE["backbone_config"])
    old_model = frozen_copy(model)
    labels = np.asarray(source.labels)
    task = np.flatnonzero(np.isin(labels, [12, 13]))
    memory = np.flatnonzero(np.isin(labels, [10, 11]))[::3]
    data = TaskData(source=source, task=1, indices=task, slots=9 - (labels[task] - 10), num_old_classes=2,
                    num_new_classes=2, memory_indices=memory, memory_slots=9 - (labels[memory] - 10))
    config = TrainConfig(epochs=2, batch_size=8, optimizer={"name": "sgd", "lr": 0.05}, log_every_steps=1,
                         autocast="off", seed=3)
    return model, old_model, get_method("dsimplex-hoc"), data, config


def _train(_loop_config=None) -> dict:
    """Train the task (in this process, or as one Ray Train worker); per-step losses and the final weights."""
    from pipelines.training.loop import train_task

    torch.set_num_threads(1)
    model, old_model, method, data, config = _task()
    result = train_task(model, old_model, method, data, config)
    return {"losses": [r.loss for r in result.records], "parts": [r.loss_parts for r in result.records],
            "images_per_s": result.images_per_s,
            "weights": {k: v.detach().numpy().copy() for k, v in result.model.state_dict().items()}}


@pytest.fixture(scope="module")
def ray_train(ray_local):
    import ray

    ray.cloudpickle.register_pickle_by_value(tiny)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray_local


def test_two_workers_match_one_worker_step_by_step(ray_train, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    reference = _train()
    trainer = TorchTrainer(_train, torch_config=TorchConfig(backend="gloo"),
                           scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(name="ddp-step-test", storage_path=str(tmp_path)))
    parallel = trainer.fit().return_value
    # half-and-half batches of 4 task + 4 memory samples: 20 task samples give 5 steps per epoch
    assert len(parallel["losses"]) == len(reference["losses"]) == 2 * 5
    print("losses 1 worker ", reference["losses"], "\nlosses 2 workers", parallel["losses"])
    np.testing.assert_allclose(parallel["losses"], reference["losses"], rtol=RELATIVE_LOSS_TOLERANCE)
    for ours, theirs in zip(parallel["parts"], reference["parts"]):
        assert set(ours) == {"sce", "info_nce"}
        np.testing.assert_allclose([ours["sce"], ours["info_nce"]], [theirs["sce"], theirs["info_nce"]],
                                   rtol=RELATIVE_LOSS_TOLERANCE)
    for name, value in reference["weights"].items():
        np.testing.assert_allclose(parallel["weights"][name], value, atol=WEIGHT_TOLERANCE, err_msg=name)
    print(f"max relative loss difference {np.max(np.abs(np.subtract(parallel['losses'], reference['losses'])) / np.abs(reference['losses'])):.2e}; "
          f"images/s: 1 worker {reference['images_per_s']:.1f}, 2 workers {parallel['images_per_s']:.1f} (stage)")


def _scenario(tmp: Path, workers: int) -> dict:
    """One HOC task (20 images) fine-tuned from a pre-trained model (its old model), one step per epoch, 3 epochs."""
    config = tiny.scenario("dsimplex-hoc", output=str(tmp))
    config["tasks"] = {"spec": "2"}
    del config["replacements"]
    config["initial_model"] = "pretrain:p1"
    config["model"].update(BACKBONE)
    config["training"].update({"epochs": 3, "batch_size": 20})
    config["pretrain"][0].update({"epochs": 1, "batch_size": 8})
    config["resources"] = {"finetune": {"num_cpus": 1, "num_workers": workers}}
    return config


def _training_records(events: list, key: str) -> list:
    from pipelines.engine.events import StageRecord

    return [e.record for e in events if isinstance(e, StageRecord) and e.stage_key == key]


def test_engine_trains_a_finetune_stage_on_two_ray_train_workers(ray_train, tmp_path):
    from cluster.ray.task_backend import RayExecutor
    from pipelines.training.records import TrainRecord

    tiny.register()
    torch.set_num_threads(1)
    local_graph = compile_scenario(validate_config(_scenario(tmp_path / "local", 1)))
    local_records = []
    LocalExecutor(emit=lambda r: local_records.append(r) if isinstance(r, TrainRecord) else None,
                  progress=False).run(local_graph, RunStore(tmp_path / "local"))
    graph = compile_scenario(validate_config(_scenario(tmp_path / "ray", 2)))
    events = []
    RayExecutor(emit=events.append, setup=tiny.register).run(graph, RunStore(tmp_path / "ray"))

    (finetune,) = graph.model_stages
    assert graph[finetune].inputs.workers == 2 and local_graph[local_graph.model_stages[0]].inputs.workers == 1
    records = _training_records(events, finetune)  # rank 0's per-epoch summaries, each epoch one step
    reference = [r for r in local_records if r.task == 0 and r.step <= 3][-3:]
    assert [r.step for r in records] == [r.step for r in reference] == [1, 2, 3]
    assert all(r.loss_parts["info_nce"] > 0 for r in records)  # the old (pre-trained) model is there: HOC in full
    np.testing.assert_allclose([r.loss for r in records], [r.loss for r in reference], rtol=RELATIVE_LOSS_TOLERANCE)
    ours = json.loads((tmp_path / "ray" / "matrix.json").read_text())
    theirs = json.loads((tmp_path / "local" / "matrix.json").read_text())
    assert ours["values"] == theirs["values"]  # Recall@1 counts: weights within 1e-5 rank the gallery alike
    record = RunStore(tmp_path / "ray").load_record(finetune)
    assert record["training"]["epochs_recorded"] == 3  # committed once, by rank 0, with its summary
    assert record["placement"]["workers"] == 2
    # epoch checkpoints went through Ray Train (training.checkpoint_every_epochs: 1) and were deleted at the commit
    assert not (tmp_path / "ray" / "ray-train" / finetune).exists()
    assert not (tmp_path / "ray" / "checkpoints" / finetune).exists()


def test_in_process_backend_refuses_more_than_one_worker(tmp_path):
    tiny.register()
    config = validate_config(_scenario(tmp_path, 2))
    with pytest.raises(ValueError, match=r"resources\.finetune\.num_workers = 2"):
        LocalExecutor(progress=False).run(compile_scenario(config), RunStore(tmp_path))
    assert not (tmp_path / "manifests").exists()  # refused before any node ran
    bad = _scenario(tmp_path, 1)
    bad["resources"]["evaluate"] = {"num_workers": 2}
    with pytest.raises(ValueError, match=r"resources\.evaluate\.num_workers must be 1"):
        validate_config(bad)


def test_rank_rows_partition_each_global_batch_in_order():
    from pipelines.training.distributed import DataParallel, shard_batches

    for world in (2, 3):
        for total in range(world, 10):
            ranks = [DataParallel(rank, world) for rank in range(world)]
            batch = np.arange(100, 100 + total)
            pieces = [shard_batches(parallel, [batch])[0] for parallel in ranks]
            assert np.array_equal(np.concatenate(pieces), batch)  # disjoint, complete, rank order
            assert max(map(len, pieces)) - min(map(len, pieces)) <= 1
    assert DataParallel(1, 2).rows(7) == (4, 7)
    with pytest.raises(ValueError, match=r"resources\.finetune\.num_workers = 3"):
        DataParallel(0, 3).check_batches([8, 2], "resources.finetune.num_workers")


def _train_crashing_once(loop: dict) -> dict:
    """Worker of the resume test: 2 epochs checkpointed through Ray Train, then rank 1 dies in epoch 3 (once)."""
    import os

    import ray.train

    from cluster.ray.train_stage import RayTrainCheckpointSink
    from pipelines.training.checkpoints import CheckpointPolicy
    from pipelines.training.loop import train_task

    class Sink(RayTrainCheckpointSink):
        restored = None

        def load_latest(self):
            latest = super().load_latest()
            self.restored = None if latest is None else latest.epochs_done
            return latest

    torch.set_num_threads(1)
    model, old_model, method, data, config = _task()
    config = config.model_copy(update={"epochs": 3})
    rank = ray.train.get_context().get_world_rank()
    steps = []

    def progress(epoch: int, step: int, total: int, images_per_s: float) -> None:
        steps.append(step)
        if rank == 1 and epoch == 2 and not os.path.exists(loop["marker"]):
            open(loop["marker"], "w").close()
            os._exit(1)  # the worker process dies: Ray Train restarts the group from the latest checkpoint

    sink = Sink(CheckpointPolicy(1))
    result = train_task(model, old_model, method, data, config, progress=progress, checkpoints=sink)
    return {"losses": [r.loss for r in result.records], "restored": sink.restored, "steps_run": steps,
            "saved": sink.saved, "weights": {k: v.detach().numpy().copy() for k, v in result.model.state_dict().items()}}


@pytest.mark.slow
def test_a_restarted_worker_group_resumes_from_the_ray_train_checkpoint(ray_train, tmp_path):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from pipelines.training.loop import train_task

    torch.set_num_threads(1)
    model, old_model, method, data, config = _task()
    reference = train_task(model, old_model, method, data, config.model_copy(update={"epochs": 3}))
    trainer = TorchTrainer(_train_crashing_once, train_loop_config={"marker": str(tmp_path / "crashed")},
                           torch_config=TorchConfig(backend="gloo"),
                           scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(name="resume-test", storage_path=str(tmp_path / "ray-train"),
                                                failure_config=FailureConfig(max_failures=1),
                                                checkpoint_config=CheckpointConfig(num_to_keep=1)))
    resumed = trainer.fit().return_value
    assert (tmp_path / "crashed").exists()  # the first attempt died in epoch 3
    assert resumed["restored"] == 2 and resumed["steps_run"] == [11, 12, 13, 14, 15]  # only epoch 3 recomputed
    assert resumed["saved"] == 0  # no periodic save after the last epoch (the stage commits then)
    np.testing.assert_allclose(resumed["losses"], [r.loss for r in reference.records], rtol=RELATIVE_LOSS_TOLERANCE)
    for name, value in reference.model.state_dict().items():
        np.testing.assert_allclose(resumed["weights"][name], value.numpy(), atol=WEIGHT_TOLERANCE, err_msg=name)
