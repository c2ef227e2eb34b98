"""Fashion-MNIST IDX files (the MNIST file format), found under Debian's install path when no root is given."""
from __future__ import annotations

import gzip
import struct

import numpy as np

from compat_core import io
from compat_core.data.source import ArraySource
from compat_core.data.datasets import register_dataset
from compat_core.data.formats._shared import require_root

DEBIAN_ROOT = "/usr/share/datasets/fashion-mnist"
IMAGES_MAGIC = 0x00000803  # IDX: unsigned bytes, 3 dimensions
LABELS_MAGIC = 0x00000801  # IDX: unsigned bytes, 1 dimension
CLASS_NAMES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
# Published training-set statistics (fractions of 255).
MEAN = (0.2860,)
STD = (0.3530,)
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
LAYOUT = (
    "<root>/ with train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte "
    "(each optionally .gz): big-endian IDX, images = magic 0x00000803, count, rows, cols, then uint8 pixels; "
    f"labels = magic 0x00000801, count, then uint8 labels 0..9 (default root {DEBIAN_ROOT})"
)


def _read_idx(root: str, stem: str) -> tuple[str, bytes]:
    for candidate in (io.join(root, stem), io.join(root, stem + ".gz")):
        if io.exists(candidate):
            data = io.read_bytes(candidate)
            # Debian ships the files gzipped; detect by content, not only by name.
            return candidate, gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    raise FileNotFoundError(f"fashion_mnist: missing {io.join(root, stem)}(.gz); expected {LAYOUT}")


def parse_idx(uri: str, data: bytes, magic: int, ndim: int) -> np.ndarray:
    """Parse one uint8 IDX file with ``ndim`` dimensions; raises ValueError naming ``uri`` on a wrong magic or size."""
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"fashion_mnist: {uri} is {len(data)} bytes, shorter than the {header}-byte IDX header")
    found = struct.unpack(">I", data[:4])[0]
    if found != magic:
        raise ValueError(f"fashion_mnist: {uri} has magic 0x{found:08x}, expected 0x{magic:08x} (uint8 IDX, {ndim} dimension(s))")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    expected = int(np.prod(shape))
    if len(data) - header != expected:
        raise ValueError(f"fashion_mnist: {uri}: header announces shape {shape} ({expected} bytes), found {len(data) - header}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape).copy()


@register_dataset(
    "fashion_mnist",
    summary="Fashion-MNIST: 10 classes, 60,000 train / 10,000 test 28x28 grayscale images",
    splits=("train", "test"),
    layout=LAYOUT,
    default_root=DEBIAN_ROOT,
)
def load_fashion_mnist(root: str | None, split: str) -> ArraySource:
    """Fashion-MNIST as an ArraySource ``(N, 28, 28, 1)`` uint8 with labels 0..9 in file order."""
    root = require_root("fashion_mnist", root, LAYOUT)
    images_stem, labels_stem = FILES[split]
    images_uri, images_data = _read_idx(root, images_stem)
    labels_uri, labels_data = _read_idx(root, labels_stem)
    images = parse_idx(images_uri, images_data, IMAGES_MAGIC, 3)
    labels = parse_idx(labels_uri, labels_data, LABELS_MAGIC, 1)
    if labels.shape[0] != images.shape[0]:
        raise ValueError(f"fashion_mnist: {labels_uri} has {labels.shape[0]} labels for {images.shape[0]} images in {images_uri}")
    if labels.size and labels.max() >= len(CLASS_NAMES):
        raise ValueError(f"fashion_mnist: {labels_uri}: labels must lie in 0..9, found {labels.max()}")
    # Garments and shoes keep their class when mirrored, so flipping is a valid augmentation here.
    return ArraySource(f"fashion_mnist/{split}", images, labels, list(CLASS_NAMES), mean=MEAN, std=STD, hflip=True)
