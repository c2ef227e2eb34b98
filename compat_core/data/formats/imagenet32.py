"""Downsampled ImageNet 32x32 (Chrabaszcz et al. 2017) pickle batches, with 1-based labels made 0-based."""
from __future__ import annotations

import numpy as np

from compat_core import io
from compat_core.data.source import ArraySource
from compat_core.data.datasets import register_dataset
from compat_core.data.formats._shared import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    load_pickle_dict,
    planar_rows_to_images,
    require_key,
    require_root,
)

NUM_CLASSES = 1000
TRAIN_BATCHES = tuple(f"train_data_batch_{i}" for i in range(1, 11))
LAYOUT = (
    "<root>/ (or <root>/Imagenet32_train and <root>/Imagenet32_val) with train_data_batch_1 .. train_data_batch_10 "
    "and val_data: Python pickles of dicts with keys 'data' (N x 3072 uint8: the R, G, B 32x32 planes row-major) and "
    "'labels' (N ints, 1-based ImageNet class ids 1..1000); the .npz variant with the same keys is accepted too"
)


def _find_batch(root: str, filename: str) -> str:
    for folder in (root, io.join(root, "Imagenet32_train"), io.join(root, "Imagenet32_val")):
        for candidate in (io.join(folder, filename), io.join(folder, filename + ".npz")):
            if io.exists(candidate):
                return candidate
    raise FileNotFoundError(f"imagenet32: missing {filename} under {root}; expected {LAYOUT}")


def _read_batch(uri: str) -> tuple[np.ndarray, np.ndarray]:
    if uri.endswith(".npz"):
        with io.open_input(uri) as handle, np.load(handle, allow_pickle=False) as archive:
            record = {key: archive[key] for key in archive.files}
    else:
        record = load_pickle_dict("imagenet32", uri, LAYOUT)
    data = require_key("imagenet32", uri, record, "data", LAYOUT)
    labels = np.asarray(require_key("imagenet32", uri, record, "labels", LAYOUT), dtype=np.int64).reshape(-1)
    if labels.shape[0] != np.shape(data)[0]:
        raise ValueError(f"imagenet32: {uri}: {labels.shape[0]} labels for {np.shape(data)[0]} rows of 'data'")
    if labels.size and (labels.min() < 1 or labels.max() > NUM_CLASSES):
        raise ValueError(
            f"imagenet32: {uri}: 'labels' must be 1-based class ids in [1, {NUM_CLASSES}], got [{labels.min()}, {labels.max()}]"
        )
    return np.asarray(data), labels - 1


@register_dataset(
    "imagenet32",
    summary="Downsampled ImageNet 32x32 (1,281,167 train / 50,000 val, 1000 classes)",
    splits=("train", "val"),
    layout=LAYOUT,
    options={
        "num_classes": "keep only the first n classes (0-based ids < n; e.g. 100/300/600 for the IAM-CL2R pools); "
        "default all 1000",
    },
)
def load_imagenet32(root: str | None, split: str, num_classes: int = NUM_CLASSES) -> ArraySource:
    """ImageNet32 as an ArraySource ``(N, 32, 32, 3)``; labels 0-based (published label - 1), batches in order.

    Rows of classes >= ``num_classes`` are dropped batch by batch so the full 3.9 GB training set is never held at once.
    """
    num_classes = int(num_classes)
    if not 1 <= num_classes <= NUM_CLASSES:
        raise ValueError(f"imagenet32: num_classes must lie in [1, {NUM_CLASSES}], got {num_classes}")
    root = require_root("imagenet32", root, LAYOUT)
    files = TRAIN_BATCHES if split == "train" else ("val_data",)
    images, labels = [], []
    for filename in files:
        uri = _find_batch(root, filename)
        data, batch_labels = _read_batch(uri)
        keep = batch_labels < num_classes
        images.append(planar_rows_to_images("imagenet32", uri, data[keep]))
        labels.append(batch_labels[keep])
    return ArraySource(
        name=f"imagenet32/{split}" + (f"/first{num_classes}" if num_classes < NUM_CLASSES else ""),
        images=np.concatenate(images),
        labels=np.concatenate(labels),
        class_names=[str(i + 1) for i in range(num_classes)],
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        hflip=True,
    )
