"""JPEG decode on the training device (``training.decode: gpu``), run here with ``device="cpu"``: the same images as
the ingested shards' CPU decoder within a stated tolerance, and the training path that decodes on the device."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from compat_core.data.device_decode import decode_on_device
from compat_core.data.encoded import EncodedImages, decode_batch

# torchvision's and OpenCV's resizers round differently: no resize or an enlargement differ by at most 1 level of 255,
# a shrink (antialiased bilinear against OpenCV's pixel-area average) by at most 6 levels, at most 2 on average (0.8
# at CelebA's 178 x 218 to 64 or 32 px; 1.65 at a 1.5x shrink of a noisy image, the worst measured)
ENLARGE_MAX, SHRINK_MAX, SHRINK_MEAN = 1, 6, 2.0


def _photo(height: int, width: int, seed: int, fmt: str = "JPEG") -> bytes:
    """A smooth gradient with noise, as a photo's statistics (an all-noise image would magnify resampling
    differences no real image has)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], -1)
    pixels = np.clip(pixels + rng.integers(-20, 20, pixels.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    # CelebA's 178 x 218, a square, a small one, a wide one and a PNG (decoded on the CPU and moved)
    shapes = [(218, 178), (224, 224), (40, 30), (100, 300)]
    return [_photo(h, w, seed) for seed, (h, w) in enumerate(shapes)] + [_photo(64, 48, 9, "PNG")]


def test_device_decode_equals_the_cpu_decoder_within_tolerance(blobs):
    for size in (224, 64, 32):
        reference = decode_batch(blobs, size, "test").astype(np.int64)
        decoded = decode_on_device(blobs, size, "cpu", "test")
        assert decoded.dtype == torch.uint8 and tuple(decoded.shape) == (len(blobs), size, size, 3)
        difference = np.abs(decoded.numpy().astype(np.int64) - reference)
        for row, blob in enumerate(blobs):
            side = min(Image.open(io.BytesIO(blob)).size)
            if side == size:   # decoded only: the same libjpeg-turbo / PNG decoder, identical pixels
                assert difference[row].max() == 0
            elif side < size:
                assert difference[row].max() <= ENLARGE_MAX, (size, row)
            else:
                assert difference[row].max() <= SHRINK_MAX and difference[row].mean() <= SHRINK_MEAN, (size, row)


def test_undecodable_bytes_name_the_data():
    with pytest.raises(ValueError, match="cannot decode an image of shard x"):
        decode_on_device([b"\xff\xd8 not a jpeg"], 8, "cpu", "shard x")
    assert tuple(decode_on_device([], 8, "cpu", "empty").shape) == (0, 8, 8, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (nvJPEG)")
@pytest.mark.cuda
def test_cuda_decode_equals_the_cpu_decoder_within_tolerance(blobs):
    reference = decode_batch(blobs, 224, "test").astype(np.int64)
    decoded = decode_on_device(blobs, 224, "cuda", "test")
    assert decoded.device.type == "cuda"
    difference = np.abs(decoded.cpu().numpy().astype(np.int64) - reference)
    assert difference.max() <= SHRINK_MAX and difference.mean() <= SHRINK_MEAN


class EncodedPool:
    """An image source of JPEG bytes: ``read`` decodes like ``decode_on_device`` on the CPU (``device_pixels``) or
    like the shards' CPU decoder, and ``encoded_images`` hands out the bytes."""

    image_shape = (32, 32, 3)
    hflip = False

    def __init__(self, count: int, device_pixels: bool) -> None:
        self.name = "jpegs"
        self.blobs = [_photo(40 + i % 3, 36, i) for i in range(count)]
        self.labels = np.arange(count) % 6
        self.class_names = [str(c) for c in range(6)]
        self.mean, self.std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
        self.device_pixels = device_pixels

    def __len__(self) -> int:
        return len(self.blobs)

    def encoded_images(self, indices):
        return EncodedImages([self.blobs[int(i)] for i in np.asarray(indices).reshape(-1)], self.image_shape,
                             "torchvision")

    def read(self, indices) -> np.ndarray:
        picked = self.encoded_images(indices).blobs
        if self.device_pixels:
            return decode_on_device(picked, 32, "cpu", self.name).numpy()
        return decode_batch(picked, 32, self.name)


def test_training_with_device_decode_sees_the_device_decoder_s_pixels(monkeypatch):
    """training.decode: gpu on a CPU device (CUDA faked present for the setting's check): the loop streams bytes and
    decodes each batch on its device; it trains bit-identically to a CPU-decoded loop whose reader returns those same
    pixels, and a pool without encoded images is refused naming the setting."""
    from compat_core.data.source import ArraySource
    from compat_core.models.compat_model import create_model
    from pipelines.methods import get_method
    from pipelines.training import settings
    from pipelines.training.loop import train_task
    from pipelines.training.settings import TrainConfig
    from pipelines.training.task_data import TaskData

    monkeypatch.setattr(settings, "cuda_available", lambda: True)

    def trained(source, decode: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = create_model("cnn4", 16, classifier="simplex", backbone_config={"width": 4})
        indices = np.flatnonzero(source.labels < 3)
        data = TaskData(source=source, task=0, indices=indices, slots=15 - source.labels[indices],
                        num_old_classes=0, num_new_classes=3)
        config = TrainConfig(epochs=2, batch_size=6, optimizer={"lr": 0.05}, autocast=False, decode=decode,
                             channels_last="off", seed=2)
        return train_task(model, None, get_method("dsimplex-hoc"), data, config).model.state_dict()

    on_device = trained(EncodedPool(36, device_pixels=False), "gpu")
    same_pixels = trained(EncodedPool(36, device_pixels=True), "cpu")
    assert all(torch.equal(on_device[name], same_pixels[name]) for name in on_device)
    cpu_decoder = trained(EncodedPool(36, device_pixels=False), "cpu")
    assert not all(torch.equal(on_device[name], cpu_decoder[name]) for name in on_device)  # really another path
    pixels = ArraySource(name="pixels", images=np.zeros((12, 32, 32, 3), np.uint8), labels=np.arange(12) % 6,
                         class_names=[str(c) for c in range(6)])
    with pytest.raises(ValueError, match="training.decode: gpu decodes encoded images on the device"):
        trained(pixels, "gpu")


def test_gpu_decode_is_refused_at_config_load_without_cuda():
    from pydantic import ValidationError

    from pipelines.training.settings import TrainConfig

    if torch.cuda.is_available():
        assert TrainConfig(decode="gpu").decode == "gpu"
        return
    with pytest.raises(ValidationError, match=r"decode\n.*CUDA device .*torch.cuda.is_available\(\) is False"):
        TrainConfig(decode="gpu")


def test_a_task_with_replay_memory_hands_out_bytes_in_batch_order():
    from pipelines.stages.replay_store import WithMemory

    pool = EncodedPool(12, device_pixels=False)
    memory = EncodedImages([_photo(50, 50, 100 + i) for i in range(3)], (32, 32, 3), "torchvision")
    source = WithMemory(pool, memory, np.array([0, 1, 2]))
    rows = np.array([13, 2, 12, 5, 14])
    encoded = source.encoded_images(rows)
    assert encoded.blobs == [memory.blobs[1], pool.blobs[2], memory.blobs[0], pool.blobs[5], memory.blobs[2]]
    assert np.array_equal(encoded[:], source.read(rows))   # the bytes decode to what the source reads
