"""Datasets (published formats and the offline glyph set), task sequences, transforms and replay memory."""
from compat_core.data.source import ArraySource, ImageSource
from compat_core.data.datasets import DATASETS, DatasetInfo, dataset_info, dataset_names, load_dataset, register_dataset
from compat_core.data.formats._shared import EncodedImageSource

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
