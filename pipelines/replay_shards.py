"""The replay memory of a model line as real shards under the run store (the Parquet format of
:mod:`compat_core.data.replay_shards`): written after each task with the exemplars' images, read by the next task instead of the
old tasks' source data.

Layout: ``<run>/replay/<stage key>/shards/replay/task-NNN.parquet`` + its manifest (one folder per stage, so lines
and replacements never share a shard). The model record keeps ``memory.shard`` = {"folder": path relative to the
run, "task", "sha256", "rows"}; a reader checks the committed manifest against that sha256 first, then the file
against the manifest (size, sha256, row count, schema, each row's content hash).
"""
from __future__ import annotations

import numpy as np

from compat_core import io as cio
from compat_core.data.replay import ReplayMemory

REPLAY_FOLDER = "replay"


def shard_folder(stage_key: str) -> str:
    """Folder of a stage's replay shard, relative to the run root."""
    return f"{REPLAY_FOLDER}/{stage_key}"


def write_memory_shard(store, stage_key: str, task: int, memory: ReplayMemory, source) -> dict:
    """Write the memory after 0-based ``task`` with its images read from ``source`` (uint8 HWC); returns the
    record stored in the model artifact."""
    from compat_core.data.replay_shards import write_replay_shard

    folder = shard_folder(stage_key)
    manifest = write_replay_shard(cio.join(store.root, folder), task, memory, source)
    return {"folder": folder, "task": int(task), "sha256": manifest.sha256, "rows": manifest.rows}


def read_memory_shard(store, shard: dict) -> tuple[ReplayMemory, np.ndarray]:
    """(memory, images uint8 (M, H, W, C) or EncodedImages decoded on indexing) of a recorded shard;
    CorruptShardError naming bucket/key and the
    expected sha256 when the file is missing or differs from the record or its manifest."""
    from compat_core.data.replay_shards import CorruptShardError, read_replay_shard, shard_uris

    root = cio.join(store.root, shard["folder"])
    parquet_uri, manifest_uri = shard_uris(root, int(shard["task"]))
    if not cio.exists(parquet_uri):
        raise CorruptShardError(parquet_uri, "sha256", shard["sha256"], "file missing")
    try:
        loaded = read_replay_shard(root, int(shard["task"]))
    except FileNotFoundError:
        raise CorruptShardError(parquet_uri, "sha256", shard["sha256"], "shard missing (no manifest at "
                                f"{manifest_uri})") from None
    if loaded.manifest.sha256 != shard["sha256"]:
        raise CorruptShardError(parquet_uri, "sha256", shard["sha256"], loaded.manifest.sha256,
                                "the shard was rewritten after the model record was committed")
    return loaded.memory, loaded.images


class WithMemory:
    """An ImageSource: a task's source followed by the replay shard's images (rows ``len(source) + m``), so the
    training loop reads old exemplars from the shard and only the current task from the source."""

    def __init__(self, source, images, labels: np.ndarray) -> None:
        from compat_core.data.replay_shards import EncodedImages

        self.source = source
        # encoded exemplars stay encoded and are decoded per batch (EncodedImages indexes like an array)
        self.images = images if isinstance(images, EncodedImages) else np.asarray(images, dtype=np.uint8)
        self.base = len(source)
        self.name = getattr(source, "name", "pool")
        self.labels = np.concatenate([np.asarray(source.labels, dtype=np.int64), np.asarray(labels, np.int64)])
        self.class_names = list(source.class_names)
        coarse = getattr(source, "coarse_labels", None)
        self.coarse_labels = None if coarse is None else np.concatenate([coarse, np.full(len(labels), -1)])
        self.image_shape = tuple(source.image_shape)
        self.mean, self.std, self.hflip = tuple(source.mean), tuple(source.std), bool(source.hflip)
        if self.images.shape[1:] != self.image_shape:
            raise ValueError(f"replay shard images are {self.images.shape[1:]}, the task source's are "
                             f"{self.image_shape}")

    def __len__(self) -> int:
        return self.base + int(self.images.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def memory_indices(self) -> np.ndarray:
        """Sample indices of the replay rows."""
        return np.arange(self.base, len(self), dtype=np.int64)

    def keep_rows(self, indices: np.ndarray) -> None:
        """Keep the task rows among ``indices`` resident in the task's source (the replay rows are in memory)."""
        from compat_core.data.stream import keep_rows

        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        keep_rows(self.source, indices[indices < self.base])

    def read(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = np.empty((indices.size, *self.image_shape), dtype=np.uint8)
        from_memory = indices >= self.base
        if (~from_memory).any():
            out[~from_memory] = self.source.read(indices[~from_memory])
        if from_memory.any():
            out[from_memory] = self.images[indices[from_memory] - self.base]
        return out
