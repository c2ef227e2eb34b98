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
