"""Time to the first step of a run's tasks after the first, and their input stall, with input workers started per
task against workers that outlive a task (``training.persistent_workers``), each with the task's first batches read
when its epochs start or while its trainer prepares (``training.prefetch_first_batches``), in one process, as
consecutive stages on one executor process run.

``--tasks`` tasks of one in-memory pool (``--images`` RGB images of ``--size`` px, 4 classes per task), each trained
by ``pipelines.training.loop.train_task`` (d-Simplex-HOC on a small CNN, ``--workers`` input workers, ``--steps``
steps) as IAM-CL2R trains them: from the second task on with a replay memory (``--memory-per-class`` exemplars of
every earlier class, JPEG bytes as a replay shard of a JPEG pool holds them, decoded by the workers), so each such
task reads a new source object (the pool followed by its memory, ``pipelines.stages.replay_store.WithMemory``), as a
fine-tuning stage builds it. Interleaved rounds of every variant; ``--repeats`` rounds. ``--decode-ms`` adds that
many milliseconds of sleep per pool image read in the workers, standing in for JPEG decode (0: the in-memory pool's
copy). Prints, per variant, the median over rounds and tasks 2..T of the time to first step (from the trainer's
start, which includes forking the workers where they are started per task, and writing the memory for the workers
where they persist) and its ratio to the per-stage baseline without prefetch of the same run, the median input stall
(seconds waiting for a batch over the task's training seconds), whether the workers' processes stayed the same over
the run, and the load average::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/persistent_workers.py
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compat_core.data.encoded import EncodedImages  # noqa: E402
from compat_core.data.source import ArraySource  # noqa: E402
from compat_core.data.stream import close_persistent_workers, persistent_worker_pids  # noqa: E402
from compat_core.models.compat_model import create_model, frozen_copy  # noqa: E402
from pipelines.methods import get_method  # noqa: E402
from pipelines.stages.replay_store import WithMemory  # noqa: E402
from pipelines.training.loop import train_task  # noqa: E402
from pipelines.training.settings import TrainConfig  # noqa: E402
from pipelines.training.task_data import TaskData  # noqa: E402

K = 16


def pool(images: int, size: int, decode_ms: float = 0.0, classes: int = 8) -> ArraySource:
    rng = np.random.default_rng(0)
    labels = np.arange(images) % classes
    pixels = rng.integers(0, 255, size=(images, size, size, 3), dtype=np.uint8)
    source = SlowDecode(name="bench", images=pixels, labels=labels, class_names=[str(c) for c in range(classes)])
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


def _jpeg(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def replay_memories(source: ArraySource, tasks: int, per_class: int) -> list[WithMemory | None]:
    """Per task, the source it trains on: the pool for the first, then a new ``WithMemory`` over the pool with
    ``per_class`` JPEG-encoded exemplars of every earlier class (made before the timing, as a stage reads its
    replay shard before its trainer starts)."""
    sources: list = [source]
    for task in range(1, tasks):
        exemplars = np.concatenate([np.flatnonzero(source.labels == c)[:per_class] for c in range(4 * task)])
        blobs = [_jpeg(source.images[i]) for i in exemplars]
        sources.append(WithMemory(source, EncodedImages(blobs, tuple(source.image_shape)), source.labels[exemplars]))
    return sources


def later_tasks_first_step(source: ArraySource, workers: int, steps: int, persistent: bool, prefetch_first: bool,
                           tasks: int = 3, per_class: int = 8) -> tuple[list[float], list[float], bool]:
    """Per task after the first: seconds from its start to the end of its first step and its input stall fraction;
    and whether every task was read by the same worker processes."""
    torch.manual_seed(0)
    model = create_model("cnn4", K, classifier="simplex", backbone_config={"width": 8})
    config = TrainConfig(epochs=1, steps_per_epoch=steps, batch_size=32, optimizer={"lr": 0.01}, autocast=False,
                         input_workers=workers, persistent_workers=persistent, augment=False,
                         prefetch_first_batches=prefetch_first)
    seconds, stall, pids = [], [], []
    for task, train_source in enumerate(replay_memories(source, tasks, per_class)):
        indices = np.flatnonzero(np.isin(source.labels, range(4 * task, 4 * task + 4)))
        memory = {}
        if task:
            memory_labels = train_source.labels[train_source.base:]
            memory = {"memory_indices": train_source.memory_indices(), "memory_slots": K - 1 - memory_labels}
        data = TaskData(source=train_source, task=task, indices=indices, slots=K - 1 - source.labels[indices],
                        num_old_classes=4 * task, num_new_classes=4, **memory)
        old = frozen_copy(model) if task else None
        result = train_task(model, old, get_method("dsimplex-hoc"), data, config)
        model = result.model
        pids.append(tuple(persistent_worker_pids(train_source)))
        if task:
            seconds.append(result.first_step_seconds)
            stall.append(result.input_stall_seconds / max(result.seconds, 1e-9))
    close_persistent_workers()
    return seconds, stall, bool(pids[0]) and len(set(pids)) == 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--memory-per-class", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-ms", type=float, default=0.0, help="sleep per image read (a decode's cost)")
    args = parser.parse_args(argv)
    result = measure(args.images, args.size, args.workers, args.steps, args.repeats, args.decode_ms, args.tasks,
                     args.memory_per_class)
    print(f"tasks 2..{args.tasks} (each with a new replay memory of {args.memory_per_class} JPEG exemplars per earlier "
          f"class), {args.workers} input workers, {args.decode_ms:g} ms decode per pool image, {args.steps} steps per "
          f"task, medians over {args.repeats} rounds x {args.tasks - 1} tasks (load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs):")
    base = result["per-stage workers"]["first_step_s"]
    for name, values in result.items():
        print(f"  {name:22s} first step {values['first_step_s']:.3f} s ({values['first_step_s'] / base:.2f}x "
              f"per-stage), input stall {values['input_stall_fraction'] * 100:.1f} %, same worker processes over "
              f"the run: {values['same_workers']}  (per task: {values['per_task_first_step_s']})")
    return 0


def measure(images: int, size: int, workers: int, steps: int, repeats: int, decode_ms: float = 0.0, tasks: int = 3,
            per_class: int = 8) -> dict[str, dict]:
    """Per variant (VARIANTS, in interleaved rounds): the medians over rounds and tasks 2..T of the time to first
    step and input stall fraction, each task's median time to first step, and whether every round's tasks were read
    by the same worker processes."""
    if tasks < 2:
        raise ValueError(f"tasks must be >= 2 (the first task has no replay memory), got {tasks}")
    source = pool(images, size, decode_ms, classes=4 * tasks)
    first: dict[str, list[list[float]]] = {name: [] for name in VARIANTS}
    stall: dict[str, list[float]] = {name: [] for name in VARIANTS}
    same: dict[str, list[bool]] = {name: [] for name in VARIANTS}
    for _ in range(repeats):  # interleaved rounds
        for name, (persistent, prefetch_first) in VARIANTS.items():
            seconds, fractions, same_workers = later_tasks_first_step(source, workers, steps, persistent,
                                                                      prefetch_first, tasks, per_class)
            first[name].append(seconds)
            stall[name].extend(fractions)
            same[name].append(same_workers)
    return {name: {"first_step_s": statistics.median(v for round_ in first[name] for v in round_),
                   "input_stall_fraction": statistics.median(stall[name]),
                   "per_task_first_step_s": [round(statistics.median(column), 3) for column in zip(*first[name])],
                   "same_workers": all(same[name])} for name in VARIANTS}


if __name__ == "__main__":
    sys.exit(main())
