"""Data-parallel training stages on Ray Train: ``resources.<stage>.num_workers: N`` runs one stage on N workers.

The engine's Ray backend (:mod:`cluster.ray_executor`) submits such a node as a small Ray task (no CPU of its own)
that runs a ``TorchTrainer`` of N workers, each holding the stage's ``num_cpus`` / ``num_gpus`` / ``memory`` (one
GPU each and NCCL when the stage asks for GPUs, gloo on CPUs). Every worker runs the same stage function
(:func:`pipelines.stages.execute_stage`); training inside it shards each global batch over the ranks and computes
the loss of the global batch (:mod:`pipelines.distributed`). Rank 0 commits the stage's artifacts and returns its
training records (the Result's return value); the other ranks write nothing. Ray Train's own run state goes under
``ray-train/<stage key>`` of the run store (a local folder or ``s3://``), so nothing needs a shared filesystem.
Worker failures restart the worker group up to ``max_failures`` times; a stage found committed is not retrained.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from pipelines.graph import Stage
from pipelines.progress import ProgressUpdate
from pipelines.store import RunStore

TRAIN_FOLDER = "ray-train"  # Ray Train's run state (and epoch checkpoints) under the run store


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
    pyarrow filesystem (local or S3, configured by cluster.storage); the run is named after the stage key."""
    from compat_core import io as cio

    filesystem, path = cio.resolve(cio.join(store_root, TRAIN_FOLDER))
    return path, filesystem


def run_data_parallel_node(store_root: str, stage: Stage, config: Any, code_version: str, options: dict,
                           max_failures: int, setup: Callable[[], None] | None = None,
                           storage_access: Any = None) -> dict:
    """Body of a data-parallel node's Ray task: fit a TorchTrainer of ``stage.resources.num_workers`` workers.

    options: the node's task options (per worker). Returns rank 0's {"key", "records", "pid", "computed"} (the
    shape :func:`cluster.ray_executor.run_node` returns).
    """
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if storage_access is not None:
        from cluster.storage import configure_object_storage

        configure_object_storage(storage_access)
    resources, use_gpu = worker_resources(options)
    storage_path, filesystem = train_storage(store_root, stage.key)
    trainer = TorchTrainer(
        _train_worker,
        train_loop_config={"store_root": store_root, "stage": stage, "config": config, "code_version": code_version,
                           "use_gpu": use_gpu, "setup": setup, "storage_access": storage_access},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=int(stage.resources.num_workers), use_gpu=use_gpu,
                                     resources_per_worker=resources),
        run_config=RunConfig(name=stage.key, storage_path=storage_path, storage_filesystem=filesystem,
                             failure_config=FailureConfig(max_failures=max_failures)),
    )
    return trainer.fit().return_value


def _train_worker(loop: dict) -> dict:
    """One Ray Train worker: execute the stage (rank 0 commits it); rank 0 returns its records."""
    import ray.train
    import torch

    from pipelines.stages import execute_stage

    if loop["storage_access"] is not None:
        from cluster.storage import configure_object_storage

        configure_object_storage(loop["storage_access"])
    if loop["setup"] is not None:
        loop["setup"]()
    if loop["use_gpu"]:
        import ray.train.torch

        torch.cuda.set_device(ray.train.torch.get_device())  # "cuda" in the config means this worker's GPU
    rank = ray.train.get_context().get_world_rank()
    stage: Stage = loop["stage"]
    store = RunStore(loop["store_root"])
    if store.has(stage.key):  # committed before a restart of the worker group
        return {"key": stage.key, "records": [], "pid": os.getpid(), "computed": False}
    records: list[Any] = []

    def emit(record: Any) -> None:
        if rank == 0 and not isinstance(record, ProgressUpdate):
            records.append(record)

    execute_stage(stage, loop["config"], store, emit, code_version=loop["code_version"])
    return {"key": stage.key, "records": records, "pid": os.getpid(), "computed": True}


__all__ = ["TRAIN_FOLDER", "run_data_parallel_node", "train_storage", "worker_resources"]
