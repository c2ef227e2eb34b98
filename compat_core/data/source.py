"""The image-source contract every dataset reader returns, and its in-memory implementation."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class ImageSource(Protocol):
    """A labelled image collection that decodes on demand.

    ``labels`` are 0-based dataset class ids; ``read`` returns uint8 images ``(n, H, W, C)``; ``mean``/``std`` are
    per-channel statistics in [0, 1] units used for normalisation; ``hflip`` says whether a horizontal flip keeps
    the class (False for characters, True for natural images and faces).
    """

    name: str
    labels: np.ndarray
    class_names: list[str]
    coarse_labels: np.ndarray | None
    image_shape: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    hflip: bool

    def __len__(self) -> int: ...

    @property
    def num_classes(self) -> int: ...

    def read(self, indices: np.ndarray) -> np.ndarray:
        """Decoded images at 0-based ``indices`` (n,), in that order: uint8 ``(n, H, W, C)``."""
        ...


@dataclass
class ArraySource:
    """An :class:`ImageSource` held in memory as one uint8 array ``(N, H, W, C)``."""

    name: str
    images: np.ndarray
    labels: np.ndarray
    class_names: list[str]
    coarse_labels: np.ndarray | None = None
    mean: tuple[float, ...] = field(default=())
    std: tuple[float, ...] = field(default=())
    hflip: bool = True

    def __post_init__(self) -> None:
        images = np.asarray(self.images)
        if images.ndim == 3:
            images = images[..., None]
        if images.ndim != 4 or images.dtype != np.uint8:
            raise ValueError(
                f"{self.name}: images must be a uint8 array (N, H, W, C), got dtype {images.dtype} and shape {images.shape}"
            )
        labels = np.asarray(self.labels, dtype=np.int64)
        if labels.shape != (images.shape[0],):
            raise ValueError(f"{self.name}: labels must have shape ({images.shape[0]},), got {labels.shape}")
        if labels.size and (labels.min() < 0 or labels.max() >= len(self.class_names)):
            raise ValueError(
                f"{self.name}: labels must lie in [0, {len(self.class_names)}) (one class name per class), "
                f"got range [{labels.min()}, {labels.max()}]"
            )
        if self.coarse_labels is not None:
            coarse = np.asarray(self.coarse_labels, dtype=np.int64)
            if coarse.shape != labels.shape:
                raise ValueError(f"{self.name}: coarse_labels must have shape {labels.shape}, got {coarse.shape}")
            self.coarse_labels = coarse
        self.images = images
        self.labels = labels
        channels = images.shape[-1]
        if not self.mean:
            per_channel = images.reshape(-1, channels).mean(axis=0) / 255.0 if images.size else np.zeros(channels)
            self.mean = tuple(float(v) for v in per_channel)
        if not self.std:
            per_channel = images.reshape(-1, channels).std(axis=0) / 255.0 if images.size else np.ones(channels)
            self.std = tuple(float(max(v, 1e-3)) for v in per_channel)
        if len(self.mean) != channels or len(self.std) != channels:
            raise ValueError(f"{self.name}: mean and std need {channels} values (one per channel)")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(int(v) for v in self.images.shape[1:])  # type: ignore[return-value]

    def read(self, indices: np.ndarray) -> np.ndarray:
        """The images at 0-based ``indices`` (n,), in that order: uint8 ``(n, H, W, C)`` (a copy)."""
        return self.images[np.asarray(indices, dtype=np.int64)]

    def subset(self, indices: np.ndarray, name: str | None = None) -> "ArraySource":
        """The samples at ``indices`` (class ids and names unchanged, normalisation statistics kept)."""
        indices = np.asarray(indices, dtype=np.int64)
        return ArraySource(
            name=name or self.name,
            images=self.images[indices],
            labels=self.labels[indices],
            class_names=self.class_names,
            coarse_labels=None if self.coarse_labels is None else self.coarse_labels[indices],
            mean=self.mean,
            std=self.std,
            hflip=self.hflip,
        )


def keep_rows(source, indices: np.ndarray) -> None:
    """Before a training task reads ``source[indices]`` in shuffled orders: let a source over row-group storage
    (``keep_rows`` method: ingested shards, views of them) keep those rows' stored bytes in memory, so that random
    batches decode from memory instead of re-reading whole row groups. Other sources: nothing to do."""
    method = getattr(source, "keep_rows", None)
    if method is not None:
        method(np.asarray(indices, dtype=np.int64))
