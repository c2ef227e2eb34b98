"""Streaming input: read + decode the next batches on CPU workers while the accelerator runs the current step.

One engine: ``torch.utils.data.DataLoader`` over a dataset whose items are whole batches (a batch of positions
in, a uint8 ``(n, H, W, C)`` tensor out), so an image source's own batched ``read`` (row-group reads of a shard,
decode of encoded files) runs in ``workers`` processes, ``prefetch`` batches ahead per worker. The batch order is
fixed by the caller (a list of position arrays), and DataLoader returns items in that order whatever the number of
workers, so the stream is deterministic for a given seed. On CUDA the batches come in pinned memory, so the
host-to-device copy can be ``non_blocking``.

``workers=0`` reads in the calling thread, exactly as a plain loop (no processes to start: the right choice for
tiny data and for a 1-2 core budget).

``persistent=True`` keeps the workers of a source alive after the stream ends, for the next stream of the same
source in this process (the next task of a run: pools are cached per process, so consecutive stages on one
executor process share the source): that stream starts without forking workers. A task's source that is a view
over a long-lived one (a pool followed by the task's replay memory, made anew for each task) keeps the pool's
workers too: such a source names its long-lived source ``worker_root`` and offers ``worker_parts(directory)``,
which writes what the root lacks (the memory's images) to files under ``directory`` (a folder the pool owns, in
shared memory where the system has ``/dev/shm``) and returns a small picklable ``view``: ``view(root)`` rebuilds
the task's source in a worker, ``view.key`` names it. Each batch then travels as ``(rows, view)``; a worker
rebuilds the view once per task, so it reads exactly what the task's source reads. The pool is rebuilt when the
root, the worker count, the prefetch depth or the image shape differ, or a batch is larger than its buffers, and a
process holds one pool at a time. Rows a later task asks a source over row-group storage to keep in memory
(``keep_rows``) after the workers started are read from storage by them instead.

``stream_encoded`` yields the batches' encoded bytes instead, for a consumer that decodes them on its device.
"""
from __future__ import annotations

import os
import tempfile
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from compat_core.data.encoded import EncodedImages
from compat_core.data.replay_parquet import encoded_images
from compat_core.data.source import keep_rows


class _BatchReads(torch.utils.data.Dataset):
    """Item ``positions`` -> (positions, uint8 images of ``source[indices[positions]]``).

    With ``buffers`` (one list of shared-memory batch buffers per worker, made by the consuming process before the
    workers start), a worker copies its images into its next buffer in turn and returns only ``(positions,
    worker, slot, rows)``: the consumer reads the buffer it already maps. Returning a fresh tensor instead costs,
    per batch, a new shared-memory segment whose pages fault in (7-10 ms per batch of 64 at 224 px against 0.5-1 ms
    with reused buffers) and a file-descriptor hand-over through a socket to the consumer (~1.5 ms of the
    consumer's CPU time per batch)."""

    def __init__(self, source, indices: np.ndarray | None, buffers: list[list[torch.Tensor]] | None = None) -> None:
        self.source = source
        self.indices = None if indices is None else np.asarray(indices, dtype=np.int64)  # None: items are rows
        self.buffers = buffers
        self._reads = 0
        self._view_key, self._view_source = None, None   # a persistent worker's rebuilt view of the current task

    def __len__(self) -> int:
        return int(len(self.source) if self.indices is None else self.indices.shape[0])

    def read(self, positions) -> np.ndarray:
        """uint8 images ``(n, H, W, C)`` of ``source[indices[positions]]`` (of ``source[positions]`` without
        indices)."""
        positions = np.asarray(positions, dtype=np.int64)
        return np.ascontiguousarray(self.source.read(positions if self.indices is None else self.indices[positions]))

    def _source_of(self, view):
        """The source a persistent worker reads for ``view`` (None: the root), rebuilt once per view."""
        if view is None:
            return self.source
        if view.key != self._view_key:
            self._view_key, self._view_source = view.key, view(self.source)
        return self._view_source

    def __getitem__(self, item):
        view = None
        if isinstance(item, tuple):  # a persistent pool's item: (rows, view of the task's source or None)
            item, view = item
        positions = np.asarray(item, dtype=np.int64)
        if view is None:
            images = self.read(positions)
        else:
            images = np.ascontiguousarray(self._source_of(view).read(positions))
        worker = torch.utils.data.get_worker_info()
        ring = self.buffers[worker.id]
        slot = self._reads % len(ring)
        self._reads += 1
        if images.shape[1:] != tuple(ring[slot].shape[1:]) or images.shape[0] > ring[slot].shape[0]:
            raise ValueError(f"{getattr(self.source, 'name', 'source')}: read returned images of shape "
                             f"{images.shape}, expected (<= {ring[slot].shape[0]}, *image_shape "
                             f"{tuple(ring[slot].shape[1:])})")
        ring[slot][: images.shape[0]].copy_(torch.from_numpy(images))
        return positions, worker.id, slot, images.shape[0]


def _as_is(item):
    """DataLoader's per-item conversion, left out: the item's numpy positions travel pickled, not as tensors."""
    return item


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU ``tensor`` on ``device`` without a host-device sync on CUDA: pinned, then copied ``non_blocking``. A
    plain copy from pageable memory waits for every kernel already queued, so the host could not prepare the next
    step (receive its batch, launch its transforms) while the accelerator runs this one. Elsewhere: ``.to``."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)
    return tensor.to(device)


def _worker_init(_: int) -> None:
    import cv2  # the JPEG decoder's resize

    torch.set_num_threads(1)  # each worker decodes on one core; the workers are the parallelism
    cv2.setNumThreads(1)


class _Batches(torch.utils.data.Sampler):
    """The sampler of a persistent pool: the rows of the current stream's batches, set before each pass."""

    def __init__(self) -> None:
        self.batches: list[np.ndarray] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _shared_folder() -> tempfile.TemporaryDirectory:
    """A folder for the views' files, in shared memory where the system has it (removed with the pool)."""
    return tempfile.TemporaryDirectory(prefix="compat-input-views-",
                                       dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


class _Pool:
    """Workers of one source that outlive a stream: a DataLoader with persistent workers over source rows (of the
    root source, or of a task's view over it)."""

    def __init__(self, source, workers: int, prefetch: int, rows: int, shape: tuple[int, ...]) -> None:
        self.source, self.workers, self.prefetch, self.rows, self.shape = source, workers, prefetch, rows, shape
        self.folder: tempfile.TemporaryDirectory | None = None   # the current view's files
        self.view_of: tuple[object, object] | None = None          # (task source, its view), written once
        self.buffers = [[torch.empty((rows, *shape), dtype=torch.uint8).share_memory_() for _ in range(prefetch + 2)]
                        for _ in range(workers)]
        self.sampler = _Batches()
        self.loader = torch.utils.data.DataLoader(
            _BatchReads(source, None, self.buffers), sampler=self.sampler, batch_size=None, num_workers=workers,
            prefetch_factor=prefetch, collate_fn=_as_is, worker_init_fn=_worker_init, persistent_workers=True)

    def fits(self, source, workers: int, prefetch: int, rows: int, shape: tuple[int, ...]) -> bool:
        return (source is self.source and workers == self.workers and prefetch == self.prefetch
                and rows <= self.rows and shape == self.shape)

    def view(self, source) -> tuple[object | None, tempfile.TemporaryDirectory | None]:
        """The view of task ``source`` (None for the root itself) and the folder it replaced, to remove once no
        worker reads it (after the next ``iter``: the workers finish the items queued before it)."""
        if source is self.source:
            return None, None
        if self.view_of is not None and self.view_of[0] is source:
            return self.view_of[1], None
        replaced, self.folder = self.folder, _shared_folder()
        view = source.worker_parts(self.folder.name)
        self.view_of = (source, view)
        return view, replaced

    def worker_pids(self) -> list[int]:
        """The process ids of the running workers (empty before the first stream)."""
        iterator = getattr(self.loader, "_iterator", None)
        return [] if iterator is None else [worker.pid for worker in iterator._workers]

    def close(self) -> None:
        """Stop the workers now (they also stop with the process) and remove the views' files."""
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()
            self.loader._iterator = None
        if self.folder is not None:
            self.folder.cleanup()
            self.folder, self.view_of = None, None


_POOLS: dict[int, _Pool] = {}   # id(root source) -> its persistent pool (one pool in this process)


def close_persistent_workers() -> None:
    """Stop every persistent pool of this process."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def root_source(source):
    """The long-lived source whose persistent workers read ``source``: its ``worker_root`` for a task's view over
    one (module docstring), else ``source`` itself."""
    return getattr(source, "worker_root", source)


def persistent_worker_pids(source) -> list[int]:
    """Process ids of the persistent input workers that read ``source`` in this process (empty when none)."""
    pool = _POOLS.get(id(root_source(source)))
    return [] if pool is None else pool.worker_pids()


def _persistent_pool(source, workers: int, prefetch: int, rows: int, shape: tuple[int, ...]) -> _Pool:
    """The pool of ``source``'s root if it fits, else a new one; a new pool stops every other pool of this process
    first (one pool at a time: a root that changes would otherwise leave one idle pool of workers behind)."""
    root = root_source(source)
    pool = _POOLS.get(id(root))
    if pool is not None and pool.fits(root, workers, prefetch, rows, shape):
        return pool
    close_persistent_workers()
    pool = _POOLS[id(root)] = _Pool(root, workers, prefetch, rows, shape)
    return pool


def stream_batches(source, indices: np.ndarray, batches: Iterable[np.ndarray] | Sequence[np.ndarray], *,
                   workers: int = 0, prefetch: int = 2, pin_memory: bool = False, persistent: bool = False
                   ) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
    """Yield ``(positions, images)`` for each batch of ``batches`` in order: positions index ``indices``; images
    are uint8 ``(n, H, W, C)`` CPU tensors of ``source.read(indices[positions])`` (pinned when ``pin_memory``).

    workers: decoding processes (0: in this thread). prefetch: batches read ahead per worker.
    With workers, the workers get their first ``prefetch`` batches each when this function returns (not at the
    first ``next``), so a caller that opens the stream before other set-up work has its first batches decoded
    meanwhile; close the returned iterator (``.close()``) when it is not drained.
    A yielded ``images`` tensor is then a view of a shared buffer that its worker reuses: it stays valid
    while the consumer works on it and the next batch is drawn (each worker cycles through ``prefetch + 2``
    buffers, at most ``prefetch`` of them written ahead), but not beyond that: copy it (``.clone()``) to keep it.
    Pinned batches (``pin_memory``) are copies already. persistent: keep the workers for the next stream of the same
    source (module docstring); one such stream of a source at a time.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers must be an int >= 0 (decoding processes), got {workers!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be an int >= 1 (batches read ahead per worker), got {prefetch!r}")
    batches = [np.asarray(b, dtype=np.int64) for b in batches]
    if workers == 0:
        return _read_in_thread(_BatchReads(source, indices), batches, pin_memory)
    # each worker cycles through prefetch + 2 buffers: at most `prefetch` of its batches are in flight while the
    # consumer holds one, so the batch in use and the one before it are never overwritten
    rows = max((b.size for b in batches), default=0)
    shape = tuple(int(v) for v in source.image_shape)
    if persistent:
        pool = _persistent_pool(source, workers, prefetch, rows, shape)
        view, replaced = pool.view(source)
        indices = np.asarray(indices, dtype=np.int64)
        pool.sampler.batches = [(indices[positions], view) for positions in batches]
        reads = iter(pool.loader)  # the reads start here (after the workers finished any earlier stream's items)
        if replaced is not None:
            replaced.cleanup()
        return _from_workers(batches, reads, pool.buffers, pin_memory)
    buffers = [[torch.empty((rows, *shape), dtype=torch.uint8).share_memory_() for _ in range(prefetch + 2)]
               for _ in range(workers)]
    loader = torch.utils.data.DataLoader(
        _BatchReads(source, indices, buffers), sampler=batches, batch_size=None, num_workers=workers,
        prefetch_factor=prefetch, collate_fn=_as_is, worker_init_fn=_worker_init, persistent_workers=False,
    )
    return _from_workers(batches, iter(loader), buffers, pin_memory)  # iter(): the workers start and read here


def stream_encoded(source, indices: np.ndarray, batches: Iterable[np.ndarray] | Sequence[np.ndarray]
                   ) -> Iterator[tuple[np.ndarray, EncodedImages]]:
    """Yield ``(positions, encoded)`` for each batch of ``batches`` in order: the encoded bytes of
    ``source[indices[positions]]`` (``source.encoded_images``), gathered in the calling thread and decoded by the
    consumer (on its device: ``compat_core.data.device_decode``). A ValueError naming the source when it holds
    pixels, not encoded files."""
    indices = np.asarray(indices, dtype=np.int64)
    for positions in batches:
        positions = np.asarray(positions, dtype=np.int64)
        encoded = encoded_images(source, indices[positions])
        if encoded is None:
            raise ValueError(f"{getattr(source, 'name', 'source')}: holds decoded pixels, not encoded images; "
                             f"decoding on the device needs a pool of JPEG files (e.g. ingested shards)")
        yield positions, encoded


def _read_in_thread(dataset: _BatchReads, batches: list[np.ndarray], pin_memory: bool
                    ) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
    for positions in batches:
        images = torch.from_numpy(dataset.read(positions))
        yield positions, (images.pin_memory() if pin_memory else images)


def _from_workers(batches: list[np.ndarray], reads: Iterator, buffers: list[list[torch.Tensor]], pin_memory: bool
                  ) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
    """The batches of a started DataLoader iterator ``reads`` whose items name a worker's buffer slot."""
    for positions, (_, worker, slot, count) in zip(batches, reads):
        images = buffers[worker][slot][:count]
        yield positions, (images.pin_memory() if pin_memory else images)


__all__ = ["close_persistent_workers", "keep_rows", "persistent_worker_pids", "root_source", "stream_batches",
           "stream_encoded", "to_device"]
