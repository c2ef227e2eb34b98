"""scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes), split by a seeded stratified draw."""
from __future__ import annotations

import numpy as np

from compat_core.data.source import ArraySource
from compat_core.data.datasets import register_dataset

SKLEARN_MAX = 16  # load_digits pixels are counts 0..16 of the 4x4 blocks set in the original 32x32 bitmaps


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) indices: per class, ``round(n_c * test_fraction)`` samples drawn with ``seed`` go to test."""
    rng = np.random.default_rng(seed)
    test = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        test.append(rng.permutation(members)[: int(round(len(members) * test_fraction))])
    test_idx = np.sort(np.concatenate(test))
    train_idx = np.setdiff1d(np.arange(len(labels)), test_idx)
    return train_idx, test_idx


@register_dataset(
    "digits",
    summary="scikit-learn load_digits: 1,797 8x8 grayscale digits (bundled; root is ignored)",
    splits=("train", "test", "all"),
    layout="nothing on disk: bundled with scikit-learn (sklearn.datasets.load_digits)",
    options={
        "test_fraction": "fraction (0..1) of each class drawn into the test split (default 0.25)",
        "seed": "seed of the stratified train/test draw (default 0)",
    },
)
def load_digits(root: str | None, split: str, test_fraction: float = 0.25, seed: int = 0) -> ArraySource:
    """Digits as ``(N, 8, 8, 1)`` uint8 with pixels ``round(v * 255 / 16)``; labels 0..9."""
    from sklearn.datasets import load_digits as sklearn_load_digits

    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"digits: test_fraction must lie strictly between 0 and 1, got {test_fraction}")
    bunch = sklearn_load_digits()
    images = np.rint(bunch.images * (255.0 / SKLEARN_MAX)).astype(np.uint8)
    labels = bunch.target.astype(np.int64)
    if split == "all":
        indices = np.arange(len(labels))
    else:
        train_idx, test_idx = stratified_split(labels, float(test_fraction), int(seed))
        indices = train_idx if split == "train" else test_idx
    # Digits change meaning when mirrored, so no horizontal flip; mean/std are computed over the split by ArraySource.
    return ArraySource(f"digits/{split}", images[indices], labels[indices], [str(d) for d in range(10)], hflip=False)
