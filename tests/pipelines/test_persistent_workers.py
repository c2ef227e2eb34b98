"""Input workers that outlive a task (``training.persistent_workers``): the same batches, so the same weights, as
workers started per task, also across tasks whose source is new each time (the pool followed by the task's replay
memory), and the setting stays out of stage keys and config hashes."""
from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from compat_core.data.source import ArraySource
from compat_core.data.encoded import EncodedImages
from compat_core.data.stream import _POOLS, close_persistent_workers, persistent_worker_pids, stream_batches
from compat_core.models.compat_model import create_model, frozen_copy
from pipelines.config.load import HOW_NOT_WHAT
from pipelines.methods import get_method
from pipelines.stages.replay_store import WithMemory
from pipelines.training.loop import train_task
from pipelines.training.settings import TrainConfig
from pipelines.training.task_data import TaskData

K = 16


def run_parts(tasks: int, persistent: bool, prefetch_first: bool):
    """A pool of 16 random images per task (4 classes each), a fresh model and the training config."""
    rng = np.random.default_rng(0)
    labels = np.arange(32 * tasks) % (4 * tasks)
    source = ArraySource(name="pool", images=rng.integers(0, 255, size=(labels.size, 16, 16, 3), dtype=np.uint8),
                         labels=labels, class_names=[str(c) for c in range(4 * tasks)])
    torch.manual_seed(0)
    model = create_model("cnn4", K, classifier="simplex", backbone_config={"width": 4})
    config = TrainConfig(epochs=2, batch_size=8, optimizer={"lr": 0.05}, autocast=False, input_workers=2,
                         persistent_workers=persistent, prefetch_first_batches=prefetch_first, seed=1)
    return source, labels, model, config


def two_tasks(persistent: bool, prefetch_first: bool = False) -> dict[str, torch.Tensor]:
    source, labels, model, config = run_parts(2, persistent, prefetch_first)
    for task, classes in enumerate(((0, 1, 2, 3), (4, 5, 6, 7))):
        indices = np.flatnonzero(np.isin(labels, classes))
        data = TaskData(source=source, task=task, indices=indices, slots=K - 1 - labels[indices],
                        num_old_classes=4 * task, num_new_classes=4)
        model = train_task(model, frozen_copy(model) if task else None, get_method("dsimplex-hoc"), data,
                           config).model
        if persistent:
            assert id(source) in _POOLS  # the workers wait for the next task
    close_persistent_workers()
    return {name: value.clone() for name, value in model.state_dict().items()}


def test_persistent_workers_train_the_same_weights_as_per_task_workers():
    per_task, persistent = two_tasks(False), two_tasks(True)
    assert per_task.keys() == persistent.keys()
    assert all(torch.equal(per_task[name], persistent[name]) for name in per_task)
    assert "persistent_workers" in HOW_NOT_WHAT


def test_prefetching_the_first_batches_trains_the_same_weights():
    """The stream opened before the method's setup (``training.prefetch_first_batches``) yields the batches of the
    stream opened when the epochs start: bit-identical weights, with persistent and with per-task workers."""
    for persistent in (True, False):
        late, early = two_tasks(persistent, prefetch_first=False), two_tasks(persistent, prefetch_first=True)
        assert all(torch.equal(late[name], early[name]) for name in late)
    assert "prefetch_first_batches" in HOW_NOT_WHAT


def replay_tasks(persistent: bool, prefetch_first: bool = False) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Three tasks of one pool as a run trains them: task 0 on the pool, tasks 1 and 2 each on a new source (the pool
    followed by that task's replay memory: copies of earlier tasks' images, so a wrong row reads other pixels).
    Returns the final weights and, per task, the pids of the persistent workers after it."""
    source, labels, model, config = run_parts(3, persistent, prefetch_first)
    pids = []
    for task, classes in enumerate(((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))):
        indices = np.flatnonzero(np.isin(labels, classes))
        train_source, memory = source, {}
        if task:
            exemplars = np.flatnonzero(labels < 4 * task)[::3]  # the earlier tasks' exemplars, images copied
            train_source = WithMemory(source, source.images[exemplars][:, ::-1].copy(), labels[exemplars])
            memory = {"memory_indices": train_source.memory_indices(), "memory_slots": K - 1 - labels[exemplars]}
        data = TaskData(source=train_source, task=task, indices=indices, slots=K - 1 - labels[indices],
                        num_old_classes=4 * task, num_new_classes=4, **memory)
        model = train_task(model, frozen_copy(model) if task else None, get_method("dsimplex-hoc"), data,
                           config).model
        pids.append(persistent_worker_pids(train_source))
    close_persistent_workers()
    return {name: value.clone() for name, value in model.state_dict().items()}, pids


def test_persistent_workers_outlive_replay_tasks_with_the_same_weights():
    """Tasks whose source is new each time (pool + replay memory) keep the first task's worker processes, and train
    bit-identical weights to workers started per task, with and without the first batches read early."""
    per_task, no_pids = replay_tasks(False)
    assert no_pids == [[], [], []]
    for prefetch_first in (False, True):
        persistent, pids = replay_tasks(True, prefetch_first)
        assert len(pids[0]) == 2 and pids[0] == pids[1] == pids[2]
        assert all(torch.equal(per_task[name], persistent[name]) for name in per_task)


def jpeg(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def test_persistent_workers_read_a_replay_memory_of_encoded_images_as_the_source_reads_it():
    """Encoded exemplars (a replay shard of JPEG bytes) travel to the workers as bytes and decode there exactly as
    the task's source decodes them; a second memory over the same pool replaces the first without new workers."""
    rng = np.random.default_rng(3)
    pool = ArraySource(name="pool", images=rng.integers(0, 255, size=(40, 16, 16, 3), dtype=np.uint8),
                       labels=np.arange(40) % 4, class_names=[str(c) for c in range(4)])
    try:
        first_pids = None
        for count in (6, 9):
            blobs = [jpeg(image) for image in rng.integers(0, 255, size=(count, 16, 16, 3), dtype=np.uint8)]
            task_source = WithMemory(pool, EncodedImages(blobs, (16, 16, 3)), np.arange(count) % 4)
            indices = np.concatenate([np.arange(0, 40, 3), task_source.memory_indices()])
            batches = [np.arange(start, min(start + 5, indices.size)) for start in range(0, indices.size, 5)]
            for positions, images in stream_batches(task_source, indices, batches, workers=2, prefetch=1,
                                                    persistent=True):
                assert np.array_equal(images.numpy(), task_source.read(indices[positions]))
            pids = persistent_worker_pids(task_source)
            assert len(pids) == 2 and pids == (first_pids or pids)
            first_pids = pids
    finally:
        close_persistent_workers()
    assert not _POOLS
