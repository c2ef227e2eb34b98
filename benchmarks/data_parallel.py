"""Data-parallel training (Ray Train, DDP over gloo on CPU): 1 process vs N workers on the same d-Simplex-HOC task.

    python benchmarks/data_parallel.py [--workers 2] [--backbone lenetpp|cnn4] [--batch-size 32] [--epochs 2]

One synthetic HOC task (16x16 grey images, 4 classes x ``--per-class`` images, half the classes in the replay
memory, an old model) is trained with ``pipelines.training.loop.train_task`` once in this process (1 torch thread) and
once on ``--workers`` Ray Train workers (1 CPU, 1 torch thread each), with one record per step. Printed: the largest
relative per-step loss difference and the largest absolute weight difference (lenetpp has no batch norm: float
summation order only; cnn4 has batch norm, which CPU ranks normalise by their own rows), then throughput as images/s
of the stage and per worker. On a shared machine, read the ratios of one run, and print ``uptime`` alongside.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BACKBONES = {"lenetpp": {"in_chans": 1, "img_size": 16, "embed_dim": 8}, "cnn4": {"in_chans": 1, "width": 8}}


def make_task(options: dict):
    """(model, old model, method, TaskData, TrainConfig) of the benchmark task, the same in every process."""
    from compat_core.data.source import ArraySource
    from compat_core.models.compat_model import create_model
    from compat_core.models.compat_model import frozen_copy
    from pipelines.methods import get_method
    from pipelines.training.settings import TrainConfig
    from pipelines.training.task_data import TaskData

    rng = np.random.default_rng(7)
    per_class = options["per_class"]
    patterns = np.random.default_rng(1).integers(0, 256, size=(4, 16, 16, 1))
    images = np.clip(np.repeat(patterns, per_class, 0) + rng.normal(0, 25, (4 * per_class, 16, 16, 1)), 0, 255)
    labels = np.repeat(np.arange(4), per_class)
    source = ArraySource("bench", images.astype(np.uint8), labels, [f"c{i}" for i in range(4)], hflip=True)
    torch.manual_seed(0)
    model = create_model(options["backbone"], num_slots=10, backbone_config=BACKBONES[options["backbone"]])
    task = np.flatnonzero(labels >= 2)
    memory = np.flatnonzero(labels < 2)[::4]
    data = TaskData(source=source, task=1, indices=task, slots=9 - labels[task], num_old_classes=2,
                    num_new_classes=2, memory_indices=memory, memory_slots=9 - labels[memory])
    config = TrainConfig(epochs=options["epochs"], batch_size=options["batch_size"],
                         optimizer={"name": "sgd", "lr": 0.05}, log_every_steps=1, autocast="off", seed=3)
    return model, frozen_copy(model), get_method("dsimplex-hoc"), data, config


def train(options: dict) -> dict:
    """Train the task here (or as one Ray Train worker); per-step losses, final weights, images/s of the stage."""
    from pipelines.training.loop import train_task

    torch.set_num_threads(1)
    model, old_model, method, data, config = make_task(options)
    result = train_task(model, old_model, method, data, config)
    return {"losses": [r.loss for r in result.records], "images_per_s": result.images_per_s,
            "weights": {k: v.detach().numpy().copy() for k, v in result.model.state_dict().items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--backbone", choices=sorted(BACKBONES), default="lenetpp")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--per-class", type=int, default=64)
    args = parser.parse_args(argv)
    options = {"backbone": args.backbone, "batch_size": args.batch_size, "epochs": args.epochs,
               "per_class": args.per_class}

    import tempfile

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from cluster.ray.loopback import prepare_loopback

    prepare_loopback()
    ray.init(num_cpus=args.workers, object_store_memory=150 * 1024 * 1024, include_dashboard=False,
             _node_ip_address="127.0.0.1", configure_logging=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        single = train(options)
        with tempfile.TemporaryDirectory() as storage:
            trainer = TorchTrainer(train, train_loop_config=options, torch_config=TorchConfig(backend="gloo"),
                                   scaling_config=ScalingConfig(num_workers=args.workers,
                                                                resources_per_worker={"CPU": 1}),
                                   run_config=RunConfig(name="data-parallel-benchmark", storage_path=storage))
            parallel = trainer.fit().return_value
    finally:
        ray.shutdown()
    losses, reference = np.asarray(parallel["losses"]), np.asarray(single["losses"])
    weights = max(float(np.max(np.abs(parallel["weights"][k] - v))) for k, v in single["weights"].items()
                  if v.dtype.kind == "f")
    print(f"backbone {args.backbone}, batch {args.batch_size}, {len(reference)} steps, {args.workers} workers")
    print(f"max relative per-step loss difference: {np.max(np.abs(losses - reference) / np.abs(reference)):.2e} "
          f"(first step {abs(losses[0] - reference[0]) / abs(reference[0]):.2e}); max |weight difference| "
          f"{weights:.2e}")
    per_worker = parallel["images_per_s"] / args.workers
    print(f"images/s: 1 process {single['images_per_s']:.1f}; {args.workers} workers {parallel['images_per_s']:.1f} "
          f"(stage), {per_worker:.1f} per worker; per-worker ratio {per_worker / single['images_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
