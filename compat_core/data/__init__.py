"""Datasets (published formats and the offline glyph set), task sequences, transforms and replay memory."""
from .base import ArraySource, ImageSource
from .formats._shared import EncodedImageSource
from .registry import DATASETS, DatasetInfo, dataset_info, dataset_names, load_dataset, register_dataset

__all__ = [
    "ArraySource",
    "ImageSource",
    "EncodedImageSource",
    "DATASETS",
    "DatasetInfo",
    "dataset_info",
    "dataset_names",
    "load_dataset",
    "register_dataset",
]
