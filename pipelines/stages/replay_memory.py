"""The replay memory of a model line: read back from the previous model's record (indices, class positions,
source task, and the images of its replay shard), updated with a task's exemplars (fixed quota per seen class), and
written as this stage's replay shard."""
from __future__ import annotations

import numpy as np

from compat_core.data import replay
from compat_core.data.replay import ReplayMemory
from compat_core.data.replay_parquet import EncodedImages, concatenate_images, encoded_images
from compat_core.integrity import IntegrityError
from pipelines.config.schema import ReplaySpec
from pipelines.records.payloads import ReplayShard
from pipelines.records.stage_records import ModelRecord
from pipelines.stages.context import StageContext
from pipelines.stages.replay_store import read_memory_shard, write_memory_shard
from pipelines.store.run_store import RunStore

_EMPTY = np.zeros(0, dtype=np.int64)


def memory_from_record(store: RunStore, model_record: ModelRecord | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pool indices, class positions, source task) of the replay memory stored with a model record."""
    memory = model_record.memory if model_record is not None else None
    if memory is None:
        return _EMPTY, _EMPTY, _EMPTY
    key = model_record.stage_key
    manifest = store.load_manifest(key)
    return (store.read_array(key, memory.indices_blob, manifest),
            store.read_array(key, memory.positions_blob, manifest),
            store.read_array(key, memory.tasks_blob, manifest))


def memory_images_from_record(store: RunStore, model_record: ModelRecord | None, memory: tuple) -> np.ndarray | None:
    """uint8 (M, H, W, C) images of the recorded replay shard, rows aligned with ``memory``; None when the record
    has no shard (runs written before replay shards)."""
    shard = model_record.memory.shard if model_record is not None and model_record.memory is not None else None
    if shard is None:
        return None
    try:
        stored, images = read_memory_shard(store, shard)
    except IntegrityError as error:
        # the stage that wrote the shard is the one to recompute (the CLI prints the --recompute fix)
        error.stage_key = error.stage_key or model_record.stage_key
        raise
    if not np.array_equal(stored.indices, memory[0]) or not np.array_equal(stored.source_task, memory[2]):
        raise ValueError(f"replay shard {shard.folder} (task {shard.task}) does not hold the memory recorded "
                         f"with model stage {model_record.stage_key}")
    return images


def write_task_memory_shard(ctx: StageContext, task: int, memory: tuple, memory_images: np.ndarray | None, pool,
                        indices: np.ndarray, positions: np.ndarray, tasks: np.ndarray,
                        previous_shard: ReplayShard | None = None) -> ReplayShard:
    """Write this stage's replay shard: the exemplars this task adds, appended to the previous shard's parts, when
    the updated memory is the previous one plus new rows (the fixed quota per class); else the whole memory, kept
    exemplars' images from the previous shard, new ones from this task's source."""
    kept = memory[0].size
    if (kept == 0 or (memory_images is not None and previous_shard is not None)) and \
            np.array_equal(indices[:kept], memory[0]) and np.array_equal(tasks[:kept], memory[2]) and \
            bool((tasks[kept:] == task).all()):
        added = slice(kept, None)
        new = encoded_images(pool, indices[added])
        record = ReplayMemory(indices=indices[added], labels=positions[added], slots=positions[added],
                              source_task=tasks[added])
        return write_memory_shard(ctx.store, ctx.stage.key, task, record,
                                  pool.read(indices[added]) if new is None else new,
                                  previous=previous_shard if kept else None)
    # kept exemplars come from the previous shard (its encoded bytes or pixels), new ones from this task's source
    from_previous = tasks != task
    parts = []
    if from_previous.any():
        if memory_images is None:
            parts.append(pool.read(indices[from_previous]))  # a run started before replay shards
        else:
            row_of = {int(index): row for row, index in enumerate(memory[0])}
            rows = np.asarray([row_of[int(i)] for i in indices[from_previous]], dtype=np.int64)
            parts.append(memory_images.take(rows) if isinstance(memory_images, EncodedImages)
                         else memory_images[rows])
    if (~from_previous).any():
        new = encoded_images(pool, indices[~from_previous])
        parts.append(pool.read(indices[~from_previous]) if new is None else new)
    if parts:
        joined = concatenate_images(parts)       # kept rows, then new rows: put them back in memory order
        order = np.argsort(np.concatenate([np.flatnonzero(from_previous), np.flatnonzero(~from_previous)]))
        images = joined.take(order) if isinstance(joined, EncodedImages) else joined[order]
    else:
        images = np.zeros((0, *pool.image_shape), dtype=np.uint8)
    record = ReplayMemory(indices=indices, labels=positions, slots=positions, source_task=tasks)
    return write_memory_shard(ctx.store, ctx.stage.key, task, record, images)


def updated_memory(replay_spec: ReplaySpec, seed: int, memory: tuple, new_indices, new_positions, task: int,
                   features: np.ndarray | None = None) -> tuple:
    """Add ``replay_spec.per_class`` samples of each new class; old classes keep theirs (fixed quota per seen class),
    selected with seed ``seed * 1000 + task`` (``seed``: the scenario seed).

    features: (n, K-1) features of the new samples for ``replay.strategy: herding`` (None for random)."""
    indices, positions, tasks = memory
    current = replay.ReplayMemory(indices=indices, labels=positions, slots=positions, source_task=tasks)
    updated = replay.update_memory(current, new_indices, new_positions, new_positions, task,
                                   replay_spec.per_class, strategy=replay_spec.strategy,
                                   seed=seed * 1000 + task, features=features)
    return (np.asarray(updated.indices, dtype=np.int64), np.asarray(updated.labels, dtype=np.int64),
            np.asarray(updated.source_task, dtype=np.int64))
