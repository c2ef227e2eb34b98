"""Time to the first step of a run's second task, and its input stall, with input workers started per task against
workers that outlive the first task (``training.persistent_workers``), each with the task's first batches read
when its epochs start or while its trainer prepares (``training.prefetch_first_batches``), in one process, as
consecutive stages on one executor process run.

Two tasks of one in-memory pool (``--images`` RGB images of ``--size`` px, 2 x 4 classes), each trained by
``pipelines.training.loop.train_task`` (d-Simplex-HOC on a small CNN, ``--workers`` input workers, ``--steps`` steps),
in interleaved rounds of every variant; ``--repeats`` rounds, medians. ``--decode-ms`` adds that many
milliseconds of sleep per image read in the workers, standing in for JPEG decode (0: the in-memory pool's copy).
Prints the second task's time to its first step (from the trainer's start, which includes forking the workers
where they are started per task) and its ratio to the per-stage baseline without prefetch of the same run, the
second task's input stall (seconds waiting for a batch over its training seconds), and the load average::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/persistent_workers.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
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


def pool(images: int, size: int, decode_ms: float = 0.0) -> ArraySource:
    rng = np.random.default_rng(0)
    labels = np.arange(images) % 8
    pixels = rng.integers(0, 255, size=(images, size, size, 3), dtype=np.uint8)
    source = SlowDecode(name="bench", images=pixels, labels=labels, class_names=[str(c) for c in range(8)])
    source.decode_ms = decode_ms
    return source


VARIANTS = {  # name: (persistent_workers, prefetch_first_batches)
    "per-stage workers": (False, False),
    "per-stage + prefetch": (False, True),
    "persistent workers": (True, False),
    "persistent + prefetch": (True, True),
}


class SlowDecode(ArraySource):
    """An in-memory pool whose reads take ``decode_ms`` per image more, as a JPEG decode does."""

    decode_ms: float = 0.0

    def read(self, indices):
        time.sleep(self.decode_ms * 1e-3 * len(indices))
        return super().read(indices)


def second_task_first_step(source: ArraySource, workers: int, steps: int, persistent: bool,
                           prefetch_first: bool) -> tuple[float, float]:
    """Seconds from the second task's start to the end of its first step, and its input stall fraction."""
    torch.manual_seed(0)
    model = create_model("cnn4", K, classifier="simplex", backbone_config={"width": 8})
    config = TrainConfig(epochs=1, steps_per_epoch=steps, batch_size=32, optimizer={"lr": 0.01}, autocast=False,
                         input_workers=workers, persistent_workers=persistent, augment=False,
                         prefetch_first_batches=prefetch_first)
    seconds, stall = [], []
    for task, classes in enumerate(((0, 1, 2, 3), (4, 5, 6, 7))):
        indices = np.flatnonzero(np.isin(source.labels, classes))
        data = TaskData(source=source, task=task, indices=indices, slots=K - 1 - source.labels[indices],
                        num_old_classes=4 * task, num_new_classes=4)
        old = frozen_copy(model) if task else None
        result = train_task(model, old, get_method("dsimplex-hoc"), data, config)
        model = result.model
        seconds.append(result.first_step_seconds)
        stall.append(result.input_stall_seconds / max(result.seconds, 1e-9))
    close_persistent_workers()
    return seconds[1], stall[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-ms", type=float, default=0.0, help="sleep per image read (a decode's cost)")
    args = parser.parse_args(argv)
    result = measure(args.images, args.size, args.workers, args.steps, args.repeats, args.decode_ms)
    print(f"second task, {args.workers} input workers, {args.decode_ms:g} ms decode per image, median of "
          f"{args.repeats} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs):")
    base = result["per-stage workers"]["first_step_s"]
    for name, values in result.items():
        print(f"  {name:22s} first step {values['first_step_s']:.3f} s ({values['first_step_s'] / base:.2f}x "
              f"per-stage), input stall {values['input_stall_fraction'] * 100:.1f} %  (rounds {values['rounds']})")
    return 0


def measure(images: int, size: int, workers: int, steps: int, repeats: int, decode_ms: float = 0.0
            ) -> dict[str, dict]:
    """Per variant (VARIANTS, in interleaved rounds): the medians of the second task's time to first step and input
    stall fraction, and each round's time to first step."""
    source = pool(images, size, decode_ms)
    first: dict[str, list[float]] = {name: [] for name in VARIANTS}
    stall: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(repeats):  # interleaved rounds
        for name, (persistent, prefetch_first) in VARIANTS.items():
            seconds, fraction = second_task_first_step(source, workers, steps, persistent, prefetch_first)
            first[name].append(seconds)
            stall[name].append(fraction)
    return {name: {"first_step_s": statistics.median(first[name]),
                   "input_stall_fraction": statistics.median(stall[name]),
                   "rounds": [round(v, 3) for v in first[name]]} for name in VARIANTS}


if __name__ == "__main__":
    sys.exit(main())
