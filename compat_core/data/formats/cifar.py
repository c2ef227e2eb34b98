"""CIFAR-10 / CIFAR-100 "python version" pickle batches, and CIFAR100R (300 training images per class)."""
from __future__ import annotations

import numpy as np

from compat_core import io
from compat_core.data.source import ArraySource
from compat_core.data.datasets import register_dataset
from compat_core.data.formats._shared import (
    decode_names,
    load_pickle_dict,
    locate_dir,
    planar_rows_to_images,
    require_key,
    require_root,
)

# Per-channel statistics of the training sets, fractions of 255 (published with the datasets' common baselines
# and reproducible from the training batches).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

CIFAR10_LAYOUT = (
    "<root>/cifar-10-batches-py/ with data_batch_1 .. data_batch_5, test_batch and batches.meta: Python pickles of "
    "dicts with byte-string keys b'data' (N x 3072 uint8: the R, G, B 32x32 planes row-major), b'labels' (N ints "
    "0..9); batches.meta has b'label_names'"
)
CIFAR100_LAYOUT = (
    "<root>/cifar-100-python/ with train, test and meta: Python pickles of dicts with byte-string keys b'data' "
    "(N x 3072 uint8: the R, G, B 32x32 planes row-major), b'fine_labels' (N ints 0..99), b'coarse_labels' "
    "(N ints 0..19); meta has b'fine_label_names' and b'coarse_label_names'"
)
CIFAR100R_PER_CLASS = 300


def _check_labels(dataset: str, uri: str, key: str, labels: np.ndarray, count: int, num_classes: int) -> np.ndarray:
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != (count,):
        raise ValueError(f"{dataset}: {uri}: {key!r} must hold {count} labels (one per row of 'data'), got {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"{dataset}: {uri}: {key!r} must lie in [0, {num_classes}) (0-based class ids), got [{labels.min()}, {labels.max()}]"
        )
    return labels


def _read_batch(dataset: str, uri: str, label_keys: tuple[str, ...], class_counts: tuple[int, ...], layout: str):
    record = load_pickle_dict(dataset, uri, layout)
    images = planar_rows_to_images(dataset, uri, require_key(dataset, uri, record, "data", layout))
    labels = [
        _check_labels(dataset, uri, key, require_key(dataset, uri, record, key, layout), len(images), count)
        for key, count in zip(label_keys, class_counts)
    ]
    return images, labels


@register_dataset(
    "cifar10",
    summary="CIFAR-10, 10 classes, 50,000 train / 10,000 test 32x32 RGB images",
    splits=("train", "test"),
    layout=CIFAR10_LAYOUT,
)
def load_cifar10(root: str | None, split: str) -> ArraySource:
    """CIFAR-10 as an ArraySource ``(N, 32, 32, 3)`` uint8 with 0-based labels in file order."""
    name = "cifar10"
    base = locate_dir(name, require_root(name, root, CIFAR10_LAYOUT), ["cifar-10-batches-py"], ["batches.meta"], CIFAR10_LAYOUT)
    meta_uri = io.join(base, "batches.meta")
    meta = load_pickle_dict(name, meta_uri, CIFAR10_LAYOUT)
    class_names = decode_names(require_key(name, meta_uri, meta, "label_names", CIFAR10_LAYOUT))
    files = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    parts = [_read_batch(name, io.join(base, f), ("labels",), (len(class_names),), CIFAR10_LAYOUT) for f in files]
    return ArraySource(
        name=f"{name}/{split}",
        images=np.concatenate([p[0] for p in parts]),
        labels=np.concatenate([p[1][0] for p in parts]),
        class_names=class_names,
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
        hflip=True,
    )


def _load_cifar100_split(split: str, root: str | None, dataset: str) -> ArraySource:
    base = locate_dir(dataset, require_root(dataset, root, CIFAR100_LAYOUT), ["cifar-100-python"], ["meta"], CIFAR100_LAYOUT)
    meta_uri = io.join(base, "meta")
    meta = load_pickle_dict(dataset, meta_uri, CIFAR100_LAYOUT)
    fine_names = decode_names(require_key(dataset, meta_uri, meta, "fine_label_names", CIFAR100_LAYOUT))
    coarse_names = decode_names(require_key(dataset, meta_uri, meta, "coarse_label_names", CIFAR100_LAYOUT))
    uri = io.join(base, split)
    images, (fine, coarse) = _read_batch(
        dataset, uri, ("fine_labels", "coarse_labels"), (len(fine_names), len(coarse_names)), CIFAR100_LAYOUT
    )
    source = ArraySource(
        name=f"{dataset}/{split}",
        images=images,
        labels=fine,
        class_names=fine_names,
        coarse_labels=coarse,
        mean=CIFAR100_MEAN,
        std=CIFAR100_STD,
        hflip=True,
    )
    source.coarse_class_names = coarse_names  # type: ignore[attr-defined]
    return source


@register_dataset(
    "cifar100",
    summary="CIFAR-100, 100 fine / 20 coarse classes, 50,000 train / 10,000 test 32x32 RGB images",
    splits=("train", "test"),
    layout=CIFAR100_LAYOUT,
    class_space="cifar100",
)
def load_cifar100(root: str | None, split: str) -> ArraySource:
    """CIFAR-100 with fine labels as ``labels`` and the 20 superclasses as ``coarse_labels`` (both 0-based)."""
    return _load_cifar100_split(split, root, "cifar100")


def first_per_class(labels: np.ndarray, per_class: int) -> np.ndarray:
    """Indices (ascending) of the first ``per_class`` samples of every class, in file order."""
    labels = np.asarray(labels)
    keep = np.zeros(labels.shape, dtype=bool)
    for label in np.unique(labels):
        keep[np.flatnonzero(labels == label)[:per_class]] = True
    return np.flatnonzero(keep)


@register_dataset(
    "cifar100r",
    summary="CIFAR100R (IAM-CL2R): the first 300 training images of each CIFAR-100 class in file order; "
    "split 'test' is the full CIFAR-100 test set",
    splits=("train", "test"),
    layout=CIFAR100_LAYOUT,
    class_space="cifar100",
    options={"per_class": f"images kept per class from the training file, in file order (default {CIFAR100R_PER_CLASS})"},
)
def load_cifar100r(root: str | None, split: str, per_class: int = CIFAR100R_PER_CLASS) -> ArraySource:
    """Reduced CIFAR-100: ``per_class`` training images per class (30,000 for the default 300)."""
    if int(per_class) <= 0:
        raise ValueError(f"cifar100r: per_class must be a positive number of images, got {per_class}")
    full = _load_cifar100_split(split, root, "cifar100r")
    if split != "train":
        return full
    reduced = full.subset(first_per_class(full.labels, int(per_class)), name="cifar100r/train")
    reduced.coarse_class_names = full.coarse_class_names  # type: ignore[attr-defined]
    return reduced
