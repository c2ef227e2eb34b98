"""The streaming input: batches in the caller's order with any number of workers, and the workers' reused
shared-memory buffers never overwrite a batch the consumer still uses."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compat_core.data.stream import stream_batches


class _IndexImages:
    """Image ``i`` is a (3, 2, 1) uint8 array filled with ``i % 251``: each batch's content is known exactly."""

    image_shape = (3, 2, 1)

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def read(self, indices: np.ndarray) -> np.ndarray:
        values = (np.asarray(indices, dtype=np.int64) % 251).astype(np.uint8)
        return np.broadcast_to(values[:, None, None, None], (values.size, 3, 2, 1)).copy()


def _expected(indices: np.ndarray, positions: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(_IndexImages(0).read(indices[positions]))


@pytest.mark.parametrize("workers,prefetch", [(0, 1), (1, 1), (2, 1), (2, 3)])
def test_batches_arrive_in_order_with_their_images_and_survive_one_more_draw(workers, prefetch):
    """Varying batch sizes (the buffers grow for a larger one), a shuffled index map; the consumer keeps the
    previous batch while it works on the current one: both still hold their own images."""
    indices = np.random.default_rng(0).permutation(400)
    sizes = [5, 9, 3, 17, 1, 17, 8, 30, 2, 11, 17, 4]
    starts = np.cumsum([0] + sizes[:-1])
    batches = [np.arange(start, start + size) for start, size in zip(starts, sizes)]
    previous = None
    seen = []
    for positions, images in stream_batches(_IndexImages(400), indices, batches, workers=workers, prefetch=prefetch):
        seen.append(positions.tolist())
        assert torch.equal(images, _expected(indices, positions))
        if previous is not None:
            assert torch.equal(previous[1], _expected(indices, previous[0]))
        previous = (positions, images)
    assert seen == [b.tolist() for b in batches]


def test_workers_reuse_their_shared_buffers():
    """30 batches of one size from 2 workers at prefetch 1 arrive in 2 x (1 + 2) distinct shared-memory files
    (a fresh tensor per batch would be 30 files; addresses cannot tell, the kernel reuses freed mappings)."""
    import os

    indices = np.arange(240)
    batches = [np.arange(start, start + 8) for start in range(0, 240, 8)]
    files = set()
    for positions, images in stream_batches(_IndexImages(240), indices, batches, workers=2, prefetch=1):
        assert torch.equal(images, _expected(indices, positions))
        descriptor, _ = images.untyped_storage()._share_fd_cpu_()  # the received storage's own shared file
        files.add(os.fstat(descriptor).st_ino)
    assert len(files) == 6


def test_a_read_of_another_shape_than_image_shape_names_both():
    """The workers' buffers are shaped by ``image_shape``: a source whose reads disagree gets a clear error."""

    class Mislabelled(_IndexImages):
        image_shape = (4, 4, 1)

    with pytest.raises(ValueError, match=r"read returned images of shape \(5, 3, 2, 1\).*image_shape \(4, 4, 1\)"):
        list(stream_batches(Mislabelled(20), np.arange(20), [np.arange(5)], workers=1, prefetch=1))


class _PidImages(_IndexImages):
    """Images whose first pixel row holds the reading process's pid (mod 251) and the rest the row index."""

    def read(self, indices: np.ndarray) -> np.ndarray:
        import os

        images = super().read(indices)
        images[:, 0] = os.getpid() % 251
        return images


def test_persistent_workers_serve_the_next_stream_of_the_same_source_without_new_processes():
    """Two streams of one source with other index maps (two tasks of one pool): each batch holds its own rows, and
    the second stream's batches are read by the first stream's worker processes; another source gets its own
    workers, and the first source's stop."""
    from compat_core.data.stream import _POOLS, close_persistent_workers

    source = _PidImages(300)
    readers = []
    try:
        for seed, stop in ((0, 5), (1, None)):  # the first stream is left early, as a preempted task leaves it
            indices = np.random.default_rng(seed).permutation(300)[:200]
            batches = [np.arange(start, start + 10) for start in range(0, 200, 10)]
            pids = set()
            for count, (positions, images) in enumerate(stream_batches(source, indices, batches, workers=2, prefetch=1,
                                                                       persistent=True)):
                assert torch.equal(images[:, 1:], _expected(indices, positions)[:, 1:])
                pids.update(images[:, 0].flatten().tolist())
                if stop is not None and count + 1 == stop:
                    break
            readers.append(pids)
        assert len(readers[1]) == 2 and readers[1] == readers[0]
        first_pool = _POOLS[id(source)]
        other = _PidImages(300)
        list(stream_batches(other, np.arange(300), [np.arange(10)], workers=2, prefetch=1, persistent=True))
        # another source gets its own workers, and the first source's pool is stopped (one pool per process)
        assert list(_POOLS) == [id(other)] and first_pool.loader._iterator is None
    finally:
        close_persistent_workers()
    assert not _POOLS


class _MarkedReads(_IndexImages):
    """Each read leaves a file named after its first index in ``folder``: the consumer sees which batches a worker
    has read."""

    def __init__(self, count: int, folder) -> None:
        super().__init__(count)
        self.folder = folder

    def read(self, indices: np.ndarray) -> np.ndarray:
        (self.folder / f"read-{int(np.asarray(indices)[0])}").touch()
        return super().read(indices)


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_read_the_first_batches_before_the_first_draw(tmp_path, persistent):
    """Opening a stream with workers hands them their first batches: they are read while the consumer does other
    work, before it draws anything; then the stream yields every batch in order as usual."""
    import time

    from compat_core.data.stream import close_persistent_workers

    indices = np.arange(100)[::-1].copy()
    batches = [np.arange(start, start + 10) for start in range(0, 100, 10)]
    stream = stream_batches(_MarkedReads(100, tmp_path), indices, batches, workers=2, prefetch=1,
                            persistent=persistent)
    try:
        first = tmp_path / f"read-{int(indices[0])}"
        deadline = time.monotonic() + 60  # bounded: worker start-up on a loaded machine
        while not first.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.exists(), "the first batch was not read before the first draw"
        drawn = [(positions.tolist(), images.clone()) for positions, images in stream]
        assert [p for p, _ in drawn] == [b.tolist() for b in batches]
        assert all(torch.equal(images, _expected(indices, np.asarray(p))) for p, images in drawn)
    finally:
        stream.close()
        close_persistent_workers()
