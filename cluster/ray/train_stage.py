"""Data-parallel training stages on Ray Train: ``resources.<stage>.num_workers: N`` runs one stage on N workers.

The engine's Ray backend (:mod:`cluster.ray.task_backend`) submits such a node as a small Ray task (no CPU of its own)
that runs a ``TorchTrainer`` of N workers, each holding the stage's ``num_cpus`` / ``num_gpus`` / ``memory`` (one
GPU each and NCCL when the stage asks for GPUs, gloo on CPUs). Every worker runs the same stage function
(:func:`pipelines.stages.execute.execute_stage`); training inside it shards each global batch over the ranks and computes
the loss of the global batch (:mod:`pipelines.training.distributed`). Rank 0 commits the stage's artifacts and returns its
training records (the Result's return value); the other ranks write nothing. Ray Train's own run state goes under
``ray-train/<stage key>`` of the run store (a local folder or ``s3://``), so nothing needs a shared filesystem.
Worker failures restart the worker group up to ``max_failures`` times; a stage found committed is not retrained.

Epoch checkpoints (the stage's checkpoint policy) go through Ray Train (:class:`RayTrainCheckpointSink`):
rank 0 reports the training state with ``ray.train.report(checkpoint=...)`` into that folder (the latest one kept),
and a restarted worker group (or a new fit of the same stage after the fitting task was retried: Ray Train reloads
its run state from the storage path) restores it from ``ray.train.get_checkpoint()``. The stage's Ray Train folder
is deleted once the stage is committed.
"""
from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Callable

from cluster.ray.worker import NodeResult, run_stage_in_worker
from cluster.storage.s3 import configure_object_storage
from compat_core import io as cio
from pipelines.graph.compile import Stage
from pipelines.stages.inputs import RunSettings
from pipelines.store.lease import LeaseFence, hold_fence
from pipelines.store.run_store import RunStore, sha256_bytes
from pipelines.training.checkpoints import EpochCheckpoint, decode_state, encode_state
from pipelines.training.distributed import use_checkpoint_sink

log = logging.getLogger(__name__)

TRAIN_FOLDER = "ray-train"  # Ray Train's run state (and epoch checkpoints) under the run store
STATE_FILE, MANIFEST_FILE = "state.pt", "checkpoint.json"


class RayTrainCheckpointSink:
    """Epoch checkpoints of a data-parallel stage through Ray Train (the ``pipelines.training.checkpoints.CheckpointSink``
    protocol). Every rank calls ``save`` at the same epochs (``ray.train.report`` is a barrier); rank 0 attaches
    the state (``torch.save`` bytes + a JSON manifest with its sha256), the others report without a checkpoint.
    Saves outside the periodic schedule (SIGTERM, which only one rank may see) are skipped: a preempted group
    resumes from its last periodic checkpoint."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.saved = 0

    def load_latest(self):
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as folder:
            manifest = json.loads((Path(folder) / MANIFEST_FILE).read_text())
            data = (Path(folder) / STATE_FILE).read_bytes()
        if sha256_bytes(data) != manifest["sha256"]:
            raise ValueError(f"Ray Train checkpoint {checkpoint.path}: {STATE_FILE} does not match its sha256 "
                             f"{manifest['sha256']}")
        return EpochCheckpoint(int(manifest["epochs_done"]), decode_state(data))

    def save(self, checkpoint) -> None:
        import ray.train

        step = int(checkpoint.state.get("step_in_epoch", 0) or 0)
        if step:
            log.warning("data-parallel stage: checkpoint after epoch %d step %d skipped (only periodic checkpoints "
                        "are taken by every rank at once)", checkpoint.epochs_done, step)
            return
        metrics = {"epochs_done": checkpoint.epochs_done}
        name = f"epoch-{checkpoint.epochs_done:05d}"
        if ray.train.get_context().get_world_rank() != 0:
            ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=name)
        else:
            data = encode_state(checkpoint.state)
            with tempfile.TemporaryDirectory() as folder:
                (Path(folder) / STATE_FILE).write_bytes(data)
                (Path(folder) / MANIFEST_FILE).write_text(json.dumps(
                    {"epochs_done": checkpoint.epochs_done, "sha256": sha256_bytes(data), "size": len(data)}))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder),
                                 checkpoint_dir_name=name)
            self.saved += 1
        # durable on return: the controller has registered it, so a group restarted from now on restores it (a
        # worker dying before the controller's next poll would otherwise fall back to the previous checkpoint)
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)


def worker_resources(options: dict) -> tuple[dict, bool]:
    """(resources_per_worker, use_gpu) for Ray Train from a node's task options (num_cpus, num_gpus, memory)."""
    resources: dict[str, float] = {"CPU": float(options["num_cpus"])}
    gpus = float(options.get("num_gpus") or 0.0)
    if gpus > 0:
        resources["GPU"] = gpus
    if options.get("memory"):
        resources["memory"] = float(options["memory"])
    return resources, gpus > 0


def train_storage(store_root: str, stage_key: str) -> tuple[str, Any]:
    """(storage_path, storage_filesystem) of a stage's Ray Train run: ``<store>/ray-train`` on the store's own
    pyarrow filesystem (local or S3, configured by cluster.storage.s3); the run is named after the stage key."""
    filesystem, path = cio.resolve(cio.join(store_root, TRAIN_FOLDER))
    return path, filesystem


def run_data_parallel_node(store_root: str, stage: Stage, settings: RunSettings, code_version: str, options: dict,
                           max_failures: int, setup: Callable[[], None] | None = None,
                           storage_access: Any = None, fence: LeaseFence | None = None) -> NodeResult:
    """Body of a data-parallel node's Ray task: fit a TorchTrainer of ``stage.resources.num_workers`` workers.

    settings: how the run's stages run (``StageGraph.settings``). options: the node's task options (per worker).
    fence: the driver's run-folder lease, which every worker (and this task's cleanup) writes under. Returns rank
    0's :class:`cluster.ray.worker.NodeResult`.
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if storage_access is not None:
        configure_object_storage(storage_access)
    resources, use_gpu = worker_resources(options)
    storage_path, filesystem = train_storage(store_root, stage.key)
    trainer = TorchTrainer(
        _train_worker,
        train_loop_config={"store_root": store_root, "stage": stage, "settings": settings, "code_version": code_version,
                           "use_gpu": use_gpu, "setup": setup, "storage_access": storage_access,
                           "fence": fence},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=int(stage.resources.num_workers), use_gpu=use_gpu,
                                     resources_per_worker=resources),
        run_config=RunConfig(name=stage.key, storage_path=storage_path, storage_filesystem=filesystem,
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=1)),
    )
    result = trainer.fit().return_value
    store = RunStore(store_root)
    if store.has(stage.key):  # committed: its Ray Train state and checkpoints are garbage
        with hold_fence(store_root, fence):
            store.delete_tree(f"{TRAIN_FOLDER}/{stage.key}")
    return result


def _train_worker(loop: dict) -> NodeResult:
    """One Ray Train worker: the one worker body executes the stage (rank 0 commits it and returns its records)."""
    import ray.train
    import torch

    if loop["use_gpu"]:
        import ray.train.torch

        torch.cuda.set_device(ray.train.torch.get_device())  # "cuda" in the config means this worker's GPU
    context = ray.train.get_context()
    use_checkpoint_sink(RayTrainCheckpointSink)
    try:
        # the manifest names rank 0's node (it commits) and the size of the worker group
        return run_stage_in_worker(loop["store_root"], loop["stage"], loop["settings"], loop["code_version"],
                                   setup=loop["setup"], storage_access=loop["storage_access"], fence=loop["fence"],
                                   keep_records=context.get_world_rank() == 0,
                                   placement={"workers": context.get_world_size()})
    finally:
        use_checkpoint_sink(None)


__all__ = ["RayTrainCheckpointSink", "TRAIN_FOLDER", "run_data_parallel_node", "train_storage", "worker_resources"]
