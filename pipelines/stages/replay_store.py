"""The replay memory of a model line as real shards under the run store (the Parquet format of
:mod:`compat_core.data.replay_parquet`): written after each task with the exemplars' images, read by the next task instead of the
old tasks' source data.

Layout: ``<run>/replay/<stage key>/shards/replay/task-NNN.parquet`` + its manifest (one folder per stage, so lines
and replacements never share a shard). The memory is appended, not rewritten: a stage's shard holds only the
exemplars its task adds, and the model record keeps ``memory.shard`` = {"folder": path relative to the run, "task",
"sha256", "rows", "stage_key", "parts": [one such entry per shard of the memory, oldest first, this one last]}: the
memory after task t is its parts' rows in order (the quota per class never drops an exemplar), so storage grows with
the new exemplars only. A reader checks every part's committed manifest against the part's sha256 first, then the file
against the manifest (size, sha256, row count, schema, each row's content hash). A record without ``parts`` (runs
written before appending) is one shard holding the whole memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compat_core import io as cio
from compat_core.data.encoded import EncodedImages
from compat_core.data.replay import ReplayMemory
from compat_core.data.replay_parquet import (
    concatenate_images,
    corrupt_shard,
    encoded_images,
    read_replay_shard,
    shard_uris,
    write_replay_shard,
)
from compat_core.data.stream import keep_rows
from compat_core.integrity import IntegrityError
from pipelines.records.payloads import ReplayShard, ShardPart

REPLAY_FOLDER = "replay"


def shard_folder(stage_key: str) -> str:
    """Folder of a stage's replay shard, relative to the run root."""
    return f"{REPLAY_FOLDER}/{stage_key}"


def write_memory_shard(store, stage_key: str, task: int, memory: ReplayMemory, source,
                       previous: ReplayShard | None = None) -> ReplayShard:
    """Write the exemplars ``memory`` after 0-based ``task`` with their images read from ``source`` (uint8 HWC or
    encoded); returns the record stored in the model artifact.

    previous: the shard record of the memory before this task, whose parts come first (``memory`` then holds only
    the rows this task adds); None: ``memory`` is the whole memory."""
    folder = shard_folder(stage_key)
    manifest = write_replay_shard(cio.join(store.root, folder), task, memory, source)
    part = ShardPart(folder, int(task), manifest.sha256, manifest.rows, stage_key)
    parts = (memory_parts(previous) if previous is not None else []) + [part]
    return ReplayShard(folder, int(task), manifest.sha256, manifest.rows, stage_key, parts=parts)


def memory_parts(shard: ReplayShard | dict) -> list[ShardPart]:
    """The shards holding a recorded memory, oldest first (a record without parts is one whole-memory shard)."""
    return ReplayShard.from_json(shard, "memory.shard").memory_parts()


def read_memory_shard(store, shard: ReplayShard | dict) -> tuple[ReplayMemory, np.ndarray]:
    """(memory, images uint8 (M, H, W, C) or EncodedImages decoded on indexing) of a recorded memory, its parts
    concatenated; an IntegrityError naming bucket/key and the expected sha256 (and ``stage_key``, the stage that
    wrote the part) when a part is missing or differs from the record or its manifest."""
    memories, images = [], []
    for part in memory_parts(shard):
        memory, part_images = _read_part(store, part)
        memories.append(memory)
        images.append(part_images)
    if len(memories) == 1:
        return memories[0], images[0]
    joined = ReplayMemory(*(np.concatenate([getattr(m, name) for m in memories])
                            for name in ("indices", "labels", "slots", "source_task")))
    return joined, concatenate_images(images)


def _read_part(store, part: ShardPart) -> tuple[ReplayMemory, np.ndarray]:
    root = cio.join(store.root, part.folder)
    parquet_uri, manifest_uri = shard_uris(root, part.task)
    try:
        if not cio.exists(parquet_uri):
            raise corrupt_shard(parquet_uri, "sha256", part.sha256, "file missing")
        try:
            loaded = read_replay_shard(root, part.task)
        except FileNotFoundError:
            raise corrupt_shard(parquet_uri, "sha256", part.sha256,
                                f"shard missing (no manifest at {manifest_uri})") from None
        if loaded.manifest.sha256 != part.sha256:
            raise corrupt_shard(parquet_uri, "sha256", part.sha256, loaded.manifest.sha256,
                                "the shard was rewritten after the model record was committed")
    except IntegrityError as error:
        error.stage_key = part.stage_key  # the stage to recompute
        raise
    return loaded.memory, loaded.images


class WithMemory:
    """An ImageSource: a task's source followed by the replay shard's images (rows ``len(source) + m``), so the
    training loop reads old exemplars from the shard and only the current task from the source."""

    def __init__(self, source, images, labels: np.ndarray) -> None:
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

    @property
    def worker_root(self):
        """The long-lived source whose persistent input workers read this view (``compat_core.data.stream``)."""
        return self.source

    def worker_parts(self, directory: str) -> "MemoryView":
        """The replay rows written to ``directory`` (pixels as one ``.npy``, encoded images as their bytes and
        offsets) and the picklable view that rebuilds this source over the root in an input worker."""
        folder = Path(directory)
        labels = self.labels[self.base:]
        np.save(folder / "labels.npy", labels)
        if isinstance(self.images, EncodedImages):
            sizes = np.asarray([len(blob) for blob in self.images.blobs], dtype=np.int64)
            np.save(folder / "offsets.npy", np.concatenate([[0], np.cumsum(sizes)]))
            np.save(folder / "images.npy", np.frombuffer(b"".join(self.images.blobs), dtype=np.uint8))
            return MemoryView(str(folder), self.images.decoder)
        np.save(folder / "images.npy", self.images)
        return MemoryView(str(folder), None)

    def keep_rows(self, indices: np.ndarray) -> None:
        """Keep the task rows among ``indices`` resident in the task's source (the replay rows are in memory)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        keep_rows(self.source, indices[indices < self.base])

    def encoded_images(self, indices: np.ndarray) -> EncodedImages | None:
        """The encoded bytes of samples ``indices`` in order (task rows from the source, replay rows from the
        shard), or None when either part holds pixels."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        from_memory = indices >= self.base
        task = encoded_images(self.source, indices[~from_memory])
        if task is None or not isinstance(self.images, EncodedImages):
            return None
        memory = self.images.take(indices[from_memory] - self.base)
        blobs, task_blobs, memory_blobs = [], iter(task.blobs), iter(memory.blobs)
        for is_memory in from_memory:
            blobs.append(next(memory_blobs) if is_memory else next(task_blobs))
        return EncodedImages(blobs, self.image_shape, task.decoder)

    def read(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = np.empty((indices.size, *self.image_shape), dtype=np.uint8)
        from_memory = indices >= self.base
        if (~from_memory).any():
            out[~from_memory] = self.source.read(indices[~from_memory])
        if from_memory.any():
            out[from_memory] = self.images[indices[from_memory] - self.base]
        return out


@dataclass(frozen=True)
class MemoryView:
    """A task's source with its replay memory, as an input worker rebuilds it over the long-lived pool: the memory
    rows' files in ``folder`` (written by :meth:`WithMemory.worker_parts`); ``decoder``: the encoded images'
    decoder, None for pixels (memory-mapped, not copied)."""

    folder: str
    decoder: str | None

    @property
    def key(self) -> str:
        return self.folder

    def __call__(self, root) -> WithMemory:
        folder = Path(self.folder)
        labels = np.load(folder / "labels.npy")
        images = np.load(folder / "images.npy", mmap_mode="r" if labels.size else None)  # no map of 0 bytes
        if self.decoder is not None:
            offsets, data = np.load(folder / "offsets.npy"), images.tobytes()
            images = EncodedImages([data[start:stop] for start, stop in zip(offsets[:-1], offsets[1:])],
                                   tuple(root.image_shape), self.decoder)
        return WithMemory(root, images, labels)
