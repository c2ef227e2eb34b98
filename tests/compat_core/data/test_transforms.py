"""Batch transforms: exact normalisation, per-sample crop offsets, flips only where the domain allows them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compat_core.data.source import ArraySource
from compat_core.data.transforms import make_transforms


def test_eval_normalises_a_constant_image_exactly():
    images = torch.full((3, 5, 6, 1), 100, dtype=torch.uint8)
    out = make_transforms(((0.2,), (0.5,)), train=False)(images)
    assert out.dtype == torch.float32 and out.shape == (3, 1, 5, 6)
    # (100 / 255 - 0.2) / 0.5 = (0.392156862... - 0.2) / 0.5 = 0.384313725...
    assert torch.allclose(out, torch.full_like(out, 0.38431372549), atol=1e-6)


def test_channels_keep_their_own_statistics():
    images = torch.zeros((2, 4, 4, 3), dtype=torch.uint8)
    images[..., 0], images[..., 1], images[..., 2] = 0, 51, 255
    out = make_transforms(((0.5, 0.1, 1.0), (0.25, 0.2, 0.5)), train=False)(images)
    # channel 0: (0 - 0.5) / 0.25 = -2; channel 1: (0.2 - 0.1) / 0.2 = 0.5; channel 2: (1 - 1) / 0.5 = 0
    expected = torch.tensor([-2.0, 0.5, 0.0]).view(1, 3, 1, 1).expand(2, 3, 4, 4)
    assert torch.allclose(out, expected, atol=1e-6)


def _windows(image: np.ndarray, pad: int) -> dict[tuple[int, int], np.ndarray]:
    """Every crop of the zero-padded image: (top, left) -> (H, W) window."""
    height, width = image.shape
    padded = np.pad(image, pad)
    return {(top, left): padded[top:top + height, left:left + width]
            for top in range(2 * pad + 1) for left in range(2 * pad + 1)}


def _decode(out: torch.Tensor) -> np.ndarray:
    """Undo normalisation with mean 0, std 1/255: the original uint8 values."""
    return np.rint(out[:, 0].numpy()).astype(np.int64)


def _match(sample: np.ndarray, windows) -> tuple[set, set]:
    plain = {offset for offset, window in windows.items() if np.array_equal(sample, window)}
    flipped = {offset for offset, window in windows.items() if np.array_equal(sample, window[:, ::-1])}
    return plain, flipped


def _identity_stats_source(hflip: bool, image: np.ndarray, copies: int) -> ArraySource:
    images = np.repeat(image[None, :, :, None], copies, axis=0).astype(np.uint8)
    return ArraySource("probe", images, np.zeros(copies, dtype=np.int64), ["c"], mean=(0.0,), std=(1 / 255,),
                       hflip=hflip)


IMAGE = (np.arange(48).reshape(6, 8) + 1).astype(np.uint8)  # distinct, non-zero values: padding is visible


def test_random_crop_draws_one_offset_per_sample_and_no_flip_when_domain_forbids():
    source = _identity_stats_source(hflip=False, image=IMAGE, copies=64)
    transform = make_transforms(source, train=True, crop_padding=2, seed=0)
    out = transform(torch.from_numpy(source.images))
    assert out.shape == (64, 1, 6, 8)
    windows = _windows(IMAGE.astype(np.int64), 2)
    offsets = []
    for sample in _decode(out):
        plain, flipped = _match(sample, windows)
        assert len(plain) == 1, "every output is exactly one unflipped crop of the padded image"
        offsets.append(plain.pop())
    assert len(set(offsets)) > 5, "offsets must differ between samples of one batch"


def test_flip_happens_per_sample_when_domain_allows():
    source = _identity_stats_source(hflip=True, image=IMAGE, copies=64)
    out = make_transforms(source, train=True, crop_padding=0, seed=1)(torch.from_numpy(source.images))
    decoded = _decode(out)
    flipped = [np.array_equal(sample, IMAGE[:, ::-1]) for sample in decoded]
    plain = [np.array_equal(sample, IMAGE) for sample in decoded]
    assert all(f != p for f, p in zip(flipped, plain))
    assert 0 < sum(flipped) < 64
    # An explicit override switches flips off for a flip-friendly source.
    off = make_transforms(source, train=True, crop_padding=0, hflip=False, seed=1)(torch.from_numpy(source.images))
    assert all(np.array_equal(sample, IMAGE) for sample in _decode(off))


def test_seeded_transforms_repeat_and_eval_is_deterministic():
    source = _identity_stats_source(hflip=True, image=IMAGE, copies=16)
    batch = torch.from_numpy(source.images)
    a = make_transforms(source, train=True, seed=5)(batch)
    b = make_transforms(source, train=True, seed=5)(batch)
    c = make_transforms(source, train=True, seed=6)(batch)
    assert torch.equal(a, b) and not torch.equal(a, c)
    evaluated = make_transforms(source, train=False)(batch)
    assert torch.equal(evaluated[:, 0], torch.from_numpy(np.repeat(IMAGE[None], 16, 0)).float())


def test_channels_last_output_and_input_errors():
    transform = make_transforms(((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)), train=True, channels_last=True, seed=0)
    out = transform(torch.zeros((4, 8, 8, 3), dtype=torch.uint8))
    assert out.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="uint8 tensor"):
        transform(torch.zeros((4, 8, 8, 3)))
    with pytest.raises(ValueError, match="3 values"):
        transform(torch.zeros((4, 8, 8, 1), dtype=torch.uint8))
    with pytest.raises(ValueError, match="std values must be > 0"):
        make_transforms(((0.5,), (0.0,)), train=False)
    with pytest.raises(ValueError, match="ImageSource"):
        make_transforms("cifar", train=False)


def test_rows_of_a_batch_get_the_whole_batch_draws():
    """Data-parallel ranks transform their rows of a global batch with the draws one process makes for all of it."""
    source = _identity_stats_source(hflip=True, image=IMAGE, copies=7)
    batch = torch.from_numpy(source.images)
    whole = make_transforms(source, train=True, seed=5)(batch)
    parts = [make_transforms(source, train=True, seed=5)(batch[start:stop], rows=(start, stop, 7))
             for start, stop in ((0, 4), (4, 7))]
    assert torch.equal(torch.cat(parts), whole)
    assert not torch.equal(parts[1], make_transforms(source, train=True, seed=5)(batch[4:7]))
    with pytest.raises(ValueError, match="rows"):
        make_transforms(source, train=True, seed=5)(batch[:3], rows=(0, 4, 7))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_batch_reaches_cuda_without_a_host_sync():
    """The step's input path (pinned batch, targets, augmentation draws, normalisation statistics) queues its
    copies without waiting for the device, so the host prepares the next step while the accelerator runs this one;
    the values equal the CPU transform's with the same seed."""
    from compat_core.data.stream import to_device

    images = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (8, 12, 12, 3), dtype=np.uint8))
    expected = make_transforms(((0.5, 0.4, 0.3), (0.2, 0.25, 0.3)), train=True, hflip=True, seed=3)(images)
    transform = make_transforms(((0.5, 0.4, 0.3), (0.2, 0.25, 0.3)), train=True, hflip=True, seed=3)
    device = torch.device("cuda")
    transform(to_device(images[:1], device))  # per-device statistics made once, outside the checked step
    transform.generator.manual_seed(3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = transform(to_device(images.pin_memory(), device))
        targets = to_device(torch.arange(8), device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.allclose(out.cpu(), expected, atol=1e-6) and targets.cpu().tolist() == list(range(8))
