"""A small pool in CIFAR-100's and CIFAR-10's "python version" formats (the files both codes read).

Images are uniform random uint8, distinct per row; every file keeps its rows grouped by class in class-id order,
so a reader that takes the first n images of each class in file order (CIFAR100R, the public code's
``subsample_dataset``) sees the rows in file order. Keys are ``str`` (as torchvision's reader, which the public code
uses, indexes them after ``encoding="latin1"``); ours reads ``str`` and ``bytes`` keys alike.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CIFAR100_CLASSES = 100
CIFAR100_COARSE = 20
CIFAR10_CLASSES = 10
CIFAR10_TRAIN_FILES = 5


@dataclass(frozen=True)
class PoolShape:
    """classes: CIFAR-100 fine classes written (ids 0..classes-1); *_per_class: images per class per split."""

    classes: int = 6
    train_per_class: int = 24
    test_per_class: int = 2
    cifar10_train_per_class: int = 10
    cifar10_test_per_class: int = 5
    structured: bool = False  # a class = its own coarse colour pattern + noise, the same in every split


def _images(rng: np.random.Generator, count: int) -> np.ndarray:
    """(count, 3072) uint8 rows (R, G, B planes of 32x32), all distinct."""
    rows = rng.integers(0, 256, size=(count, 3072), dtype=np.uint8)
    if len({row.tobytes() for row in rows}) != count:
        raise RuntimeError("random pool images collided; use another seed")
    return rows


def _patterns(rng: np.random.Generator, classes: int, structured: bool) -> np.ndarray | None:
    """Per class a 4x4 colour pattern upsampled to 32x32 ``(classes, 3, 32, 32)``, shared by a dataset's splits."""
    if not structured:
        return None
    return rng.integers(96, 161, size=(classes, 3, 4, 4)).repeat(8, axis=2).repeat(8, axis=3)


def _class_images(rng: np.random.Generator, labels: np.ndarray, patterns: np.ndarray | None) -> np.ndarray:
    """Rows for ``labels``: uniform noise, or each class's low-contrast pattern (values 96..160) plus uniform noise
    in [-96, 96]: classes a network can tell apart, not all at once."""
    if patterns is None:
        return _images(rng, labels.size)
    noise = rng.integers(-96, 97, size=(labels.size, 3, 32, 32))
    rows = np.clip(patterns[labels] + noise, 0, 255).astype(np.uint8).reshape(labels.size, 3072)
    if len({row.tobytes() for row in rows}) != labels.size:
        raise RuntimeError("pool images collided; use another seed")
    return rows


def _grouped_labels(classes: int, per_class: int) -> np.ndarray:
    return np.repeat(np.arange(classes, dtype=np.int64), per_class)


def _dump(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        pickle.dump(record, handle, protocol=2)


def write_cifar_pool(root: str | Path, shape: PoolShape = PoolShape(), seed: int = 0) -> dict[str, np.ndarray]:
    """Write ``root/cifar-100-python/{train,test,meta}`` and ``root/cifar-10-batches-py/`` (five train batches,
    ``test_batch``, ``batches.meta``); returns the written arrays by split name (``cifar100_train`` ...) as
    ``(N, 3072)`` rows and ``*_labels``."""
    if not 1 <= shape.classes <= CIFAR100_CLASSES:
        raise ValueError(f"PoolShape.classes must be in [1, {CIFAR100_CLASSES}], got {shape.classes}")
    rng = np.random.default_rng(seed)
    root = Path(root)
    written: dict[str, np.ndarray] = {}
    patterns100 = _patterns(rng, shape.classes, shape.structured)
    patterns10 = _patterns(rng, CIFAR10_CLASSES, shape.structured)
    fine_names = [f"class_{i:02d}" for i in range(CIFAR100_CLASSES)]
    coarse_names = [f"super_{i:02d}" for i in range(CIFAR100_COARSE)]
    for split, per_class in (("train", shape.train_per_class), ("test", shape.test_per_class)):
        labels = _grouped_labels(shape.classes, per_class)
        data = _class_images(rng, labels, patterns100)
        _dump(root / "cifar-100-python" / split, {"data": data, "fine_labels": labels.tolist(),
                                                   "coarse_labels": (labels % CIFAR100_COARSE).tolist()})
        written[f"cifar100_{split}"], written[f"cifar100_{split}_labels"] = data, labels
    _dump(root / "cifar-100-python" / "meta", {"fine_label_names": fine_names, "coarse_label_names": coarse_names})
    base = root / "cifar-10-batches-py"
    train_labels = _grouped_labels(CIFAR10_CLASSES, shape.cifar10_train_per_class)
    train = _class_images(rng, train_labels, patterns10)
    parts = np.array_split(np.arange(train_labels.size), CIFAR10_TRAIN_FILES)
    for number, rows in enumerate(parts, start=1):
        _dump(base / f"data_batch_{number}", {"data": train[rows], "labels": train_labels[rows].tolist()})
    test_labels = _grouped_labels(CIFAR10_CLASSES, shape.cifar10_test_per_class)
    test = _class_images(rng, test_labels, patterns10)
    _dump(base / "test_batch", {"data": test, "labels": test_labels.tolist()})
    _dump(base / "batches.meta", {"label_names": [f"c10_{i}" for i in range(CIFAR10_CLASSES)]})
    written.update(cifar10_train=train, cifar10_train_labels=train_labels, cifar10_test=test,
                   cifar10_test_labels=test_labels)
    return written
