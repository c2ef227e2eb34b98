"""Time to the first step of a run's second task with input workers started per task against workers that outlive
the first task (``training.persistent_workers``), in one process, as consecutive stages on one executor process run.

Two tasks of one in-memory pool (``--images`` RGB images of ``--size`` px, 2 x 4 classes), each trained by
``pipelines.training.loop.train_task`` (d-Simplex-HOC on a small CNN, ``--workers`` input workers, ``--steps`` steps),
per-stage workers first, then persistent ones; ``--repeats`` rounds, medians. Prints the second task's time to its
first step (from the trainer's start, which includes forking the workers where they are started per task), its
ratio to the per-stage baseline of the same run, and the load average::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/persistent_workers.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compat_core.data.source import ArraySource  # noqa: E402
from compat_core.data.stream import close_persistent_workers  # noqa: E402
from compat_core.models.compat_model import create_model, frozen_copy  # noqa: E402
from pipelines.methods import get_method  # noqa: E402
from pipelines.training.loop import train_task  # noqa: E402
from pipelines.training.settings import TrainConfig  # noqa: E402
from pipelines.training.task_data import TaskData  # noqa: E402

K = 16


def pool(images: int, size: int) -> ArraySource:
    rng = np.random.default_rng(0)
    labels = np.arange(images) % 8
    pixels = rng.integers(0, 255, size=(images, size, size, 3), dtype=np.uint8)
    return ArraySource(name="bench", images=pixels, labels=labels, class_names=[str(c) for c in range(8)])


def second_task_first_step(source: ArraySource, workers: int, steps: int, persistent: bool) -> float:
    """Seconds from the second task's start to the end of its first step."""
    torch.manual_seed(0)
    model = create_model("cnn4", K, classifier="simplex", backbone_config={"width": 8})
    config = TrainConfig(epochs=1, steps_per_epoch=steps, batch_size=32, optimizer={"lr": 0.01}, autocast=False,
                         input_workers=workers, persistent_workers=persistent, augment=False)
    seconds = []
    for task, classes in enumerate(((0, 1, 2, 3), (4, 5, 6, 7))):
        indices = np.flatnonzero(np.isin(source.labels, classes))
        data = TaskData(source=source, task=task, indices=indices, slots=K - 1 - source.labels[indices],
                        num_old_classes=4 * task, num_new_classes=4)
        old = frozen_copy(model) if task else None
        result = train_task(model, old, get_method("dsimplex-hoc"), data, config)
        model = result.model
        seconds.append(result.first_step_seconds)
    close_persistent_workers()
    return seconds[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    source = pool(args.images, args.size)
    times: dict[str, list[float]] = {"per-stage workers": [], "persistent workers": []}
    for _ in range(args.repeats):  # interleaved rounds
        times["per-stage workers"].append(second_task_first_step(source, args.workers, args.steps, False))
        times["persistent workers"].append(second_task_first_step(source, args.workers, args.steps, True))
    base = statistics.median(times["per-stage workers"])
    print(f"second task's time to first step, {args.workers} input workers, median of {args.repeats} "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs):")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:20s} {median:.3f} s  ({median / base:.2f}x per-stage; rounds {[round(v, 3) for v in values]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
