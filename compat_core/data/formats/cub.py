"""CUB-200-2011 text files and image folders, with the CUB180 / CUB20 open-set class split."""
from __future__ import annotations

import numpy as np

from compat_core import io
from compat_core.data.datasets import register_dataset
from compat_core.data.formats._shared import (
    EncodedImageSource,
    add_unique,
    check_image_files,
    contained_path,
    locate_dir,
    parse_int,
    read_text_lines,
    require_root,
)

LAYOUT = (
    "<root>/CUB_200_2011/ with images.txt ('<image_id> <relative path>' per line), image_class_labels.txt "
    "('<image_id> <class_id>', 1-based), classes.txt ('<class_id> <class name>'), train_test_split.txt "
    "('<image_id> <1 = train, 0 = test>') and images/<class folder>/<file>.jpg"
)
FILES = ("images.txt", "image_class_labels.txt", "classes.txt", "train_test_split.txt")
OPTIONS = {
    "image_size": "side in pixels of the square images read() returns (default 224); shorter side scaled, centre crop",
    "cache_size": "decoded images kept in memory (LRU, default 256; 0 disables)",
}
# (first class id, last class id), 1-based inclusive, of each registered variant.
VARIANTS = {"cub200": (1, 200), "cub180": (1, 180), "cub20": (181, 200)}


def _two_column(name: str, uri: str, expected: str, second_is_int: bool,
                lines: dict[int, int] | None = None) -> dict[int, object]:
    """``id -> value`` of a two-column file (duplicate ids refused); ``lines`` receives each id's line number."""
    table: dict[int, object] = {}
    lines = {} if lines is None else lines
    for number, fields in read_text_lines(name, uri, LAYOUT):
        if len(fields) != 2:
            raise ValueError(f"{name}: {uri} line {number}: expected '{expected}', got {len(fields)} fields")
        key = parse_int(name, uri, number, fields[0], expected)
        value = parse_int(name, uri, number, fields[1], expected) if second_is_int else fields[1]
        add_unique(name, uri, number, table, lines, key, value)
    return table


def _load_cub(name: str, root: str | None, split: str, image_size: int, cache_size: int) -> EncodedImageSource:
    first, last = VARIANTS[name]
    base = locate_dir(name, require_root(name, root, LAYOUT), ["CUB_200_2011"], FILES, LAYOUT)
    path_lines: dict[int, int] = {}
    class_lines: dict[int, int] = {}
    images_uri, labels_uri = io.join(base, "images.txt"), io.join(base, "image_class_labels.txt")
    paths = _two_column(name, images_uri, "<image_id> <relative path>", False, path_lines)
    classes = _two_column(name, labels_uri, "<image_id> <class_id>", True, class_lines)
    class_names = _two_column(name, io.join(base, "classes.txt"), "<class_id> <class name>", False)
    is_train = _two_column(name, io.join(base, "train_test_split.txt"), "<image_id> <0|1>", True)
    for table, filename in ((classes, "image_class_labels.txt"), (is_train, "train_test_split.txt")):
        missing = sorted(set(paths) - set(table))
        if missing:
            raise ValueError(f"{name}: {io.join(base, filename)} has no line for image id(s) {missing[:5]} of images.txt")
    wanted = range(first, last + 1)
    absent = [c for c in wanted if c not in class_names]
    if absent:
        raise ValueError(f"{name}: {io.join(base, 'classes.txt')} lacks class id(s) {absent[:5]}; {name} uses classes {first}..{last}")
    locations, labels, origins = [], [], []
    images_dir = io.join(base, "images")
    for image_id in sorted(paths):
        class_id = classes[image_id]
        if class_id not in class_names or not 1 <= class_id <= VARIANTS["cub200"][1]:
            raise ValueError(f"{name}: {labels_uri} line {class_lines[image_id]}: class id {class_id} of image "
                             f"{image_id} is not in classes.txt (1..{VARIANTS['cub200'][1]})")
        location = contained_path(name, images_dir, str(paths[image_id]), images_uri, path_lines[image_id])
        if not first <= class_id <= last:
            continue
        if split != "all" and bool(is_train[image_id]) != (split == "train"):
            continue
        locations.append(location)
        labels.append(class_id - first)
        origins.append(f"{images_uri} line {path_lines[image_id]}")
    check_image_files(name, locations, origins)
    return EncodedImageSource(
        f"{name}/{split}",
        locations,
        np.asarray(labels, dtype=np.int64),
        [str(class_names[c]) for c in wanted],
        image_size=image_size,
        hflip=True,
        cache_size=cache_size,
    )


def _register(name: str, summary: str) -> None:
    @register_dataset(name, summary=summary, splits=("train", "test", "all"), layout=LAYOUT, options=OPTIONS)
    def _loader(root: str | None, split: str, image_size: int = 224, cache_size: int = 256) -> EncodedImageSource:
        return _load_cub(name, root, split, image_size, cache_size)

    _loader.__doc__ = (
        f"{summary}. Labels are 0-based (published 1-based class id - {VARIANTS[name][0]}); split train/test follows "
        "train_test_split.txt, 'all' takes every image."
    )


_register("cub200", "CUB-200-2011, 200 bird classes (11,788 images)")
_register("cub180", "CUB180: CUB-200-2011 classes 1..180 (training classes of the open-set split)")
_register("cub20", "CUB20: CUB-200-2011 classes 181..200 (open-set test classes; train = query, test = gallery)")
