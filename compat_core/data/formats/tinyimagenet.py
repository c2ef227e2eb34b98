"""Tiny ImageNet 200 folders, and the TinyImageNet20 open-set test classes of the 2026 paper (Appendix C).

TinyImageNet20 is *not* a subset of Tiny ImageNet 200: its 20 ImageNet-1k synsets appear in none of the 200 Tiny
ImageNet classes (the paper trains on all 200 classes, K = 200, and tests on 25,478 query / 1,000 gallery images,
i.e. the ImageNet-1k train / val images of those 20 synsets). It is read from an ImageNet-1k folder tree.
"""
from __future__ import annotations

import numpy as np

from compat_core import io
from compat_core.data.datasets import register_dataset
from compat_core.data.formats._shared import (
    EncodedImageSource,
    contained_path,
    locate_dir,
    read_text_lines,
    require_root,
)

# Appendix C of "Stationary compatible representation" (2026), in the paper's order.
TINYIMAGENET20_WNIDS = (
    "n04116512", "n03447721", "n11939491", "n02951585", "n02437616",
    "n03538406", "n02095889", "n02169497", "n03127925", "n01532829",
    "n03394916", "n02727426", "n09835506", "n02105641", "n03598930",
    "n04228054", "n03743016", "n01582220", "n04485082", "n03483316",
)
IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")

TINY_LAYOUT = (
    "<root>/tiny-imagenet-200/ with wnids.txt (one WordNet id per line, 200 lines), optional words.txt "
    "('<wnid>\\t<names>' per line), train/<wnid>/images/*.JPEG, val/images/*.JPEG and val/val_annotations.txt "
    "('<file>\\t<wnid>\\t<x0>\\t<y0>\\t<x1>\\t<y1>' per line)"
)
IMAGENET20_LAYOUT = (
    "an ImageNet-1k folder tree <root>/train/<wnid>/*.JPEG (query split) and <root>/val/<wnid>/*.JPEG (gallery "
    "split, val images sorted into one folder per synset) for the 20 TinyImageNet20 synsets "
    + ", ".join(TINYIMAGENET20_WNIDS)
)
COMMON_OPTIONS = {
    "image_size": "side in pixels of the square images read() returns (default 64, the papers' input size)",
    "cache_size": "decoded images kept in memory (LRU, default 256; 0 disables)",
}


def _image_files(folder: str) -> list[str]:
    return [n for n in io.list_dir(folder) if n.lower().endswith(IMAGE_EXTENSIONS)]


def _read_words(base: str) -> dict[str, str]:
    uri = io.join(base, "words.txt")
    if not io.exists(uri):
        return {}
    names = {}
    for line in io.read_bytes(uri).decode("utf-8").splitlines():
        wnid, _, words = line.partition("\t")
        if wnid and words:
            names[wnid.strip()] = words.strip()
    return names


@register_dataset(
    "tinyimagenet200",
    summary="Tiny ImageNet 200: 200 classes, 100,000 train / 10,000 val 64x64 RGB images (test labels are unpublished)",
    splits=("train", "val"),
    layout=TINY_LAYOUT,
    options=COMMON_OPTIONS,
)
def load_tinyimagenet200(root: str | None, split: str, image_size: int = 64, cache_size: int = 256) -> EncodedImageSource:
    """Tiny ImageNet 200; class ids 0..199 follow the sorted WordNet ids (torchvision ImageFolder order)."""
    name = "tinyimagenet200"
    base = locate_dir(name, require_root(name, root, TINY_LAYOUT), ["tiny-imagenet-200"], ["wnids.txt"], TINY_LAYOUT)
    wnids_uri = io.join(base, "wnids.txt")
    wnids = []
    for number, fields in read_text_lines(name, wnids_uri, TINY_LAYOUT):
        if len(fields) != 1 or not fields[0].startswith("n"):
            raise ValueError(f"{name}: {wnids_uri} line {number}: expected one WordNet id like 'n01443537', got {fields}")
        wnids.append(fields[0])
    if len(set(wnids)) != len(wnids):
        raise ValueError(f"{name}: {wnids_uri} lists a WordNet id twice")
    wnids = sorted(wnids)
    class_of = {wnid: i for i, wnid in enumerate(wnids)}
    locations, labels = [], []
    if split == "train":
        for wnid in wnids:
            folder = io.join(base, "train", wnid, "images")
            if not io.is_dir(folder):
                raise FileNotFoundError(f"{name}: missing folder {folder}; expected {TINY_LAYOUT}")
            files = _image_files(folder)
            locations += [io.join(folder, f) for f in files]
            labels += [class_of[wnid]] * len(files)
    else:
        annotations = io.join(base, "val", "val_annotations.txt")
        for number, fields in read_text_lines(name, annotations, TINY_LAYOUT):
            if len(fields) != 6:
                raise ValueError(
                    f"{name}: {annotations} line {number}: expected '<file>\\t<wnid>\\t<x0>\\t<y0>\\t<x1>\\t<y1>', got {fields}"
                )
            if fields[1] not in class_of:
                raise ValueError(f"{name}: {annotations} line {number}: WordNet id {fields[1]!r} is not in wnids.txt")
            locations.append(contained_path(name, io.join(base, "val", "images"), fields[0], annotations, number))
            labels.append(class_of[fields[1]])
    words = _read_words(base)
    return EncodedImageSource(
        f"{name}/{split}",
        locations,
        np.asarray(labels, dtype=np.int64),
        [words.get(w, w) for w in wnids],
        image_size=image_size,
        hflip=True,
        cache_size=cache_size,
    )


@register_dataset(
    "tinyimagenet20",
    summary="TinyImageNet20 open-set test classes (2026 paper, Appendix C): 20 ImageNet-1k synsets absent from "
    "Tiny ImageNet 200; split 'train' = query (ImageNet train images), 'val' = gallery (ImageNet val images)",
    splits=("train", "val"),
    layout=IMAGENET20_LAYOUT,
    options=COMMON_OPTIONS,
)
def load_tinyimagenet20(root: str | None, split: str, image_size: int = 64, cache_size: int = 256) -> EncodedImageSource:
    """The 20 Appendix-C synsets read from an ImageNet-1k tree; class ids 0..19 follow the paper's list order."""
    name = "tinyimagenet20"
    root = require_root(name, root, IMAGENET20_LAYOUT)
    missing = [w for w in TINYIMAGENET20_WNIDS if not io.is_dir(io.join(root, split, w))]
    if missing:
        raise FileNotFoundError(
            f"{name}: missing {len(missing)} synset folder(s) under {io.join(root, split)}: {', '.join(missing)}; "
            f"expected {IMAGENET20_LAYOUT}"
        )
    locations, labels = [], []
    for label, wnid in enumerate(TINYIMAGENET20_WNIDS):
        folder = io.join(root, split, wnid)
        files = _image_files(folder)
        locations += [io.join(folder, f) for f in files]
        labels += [label] * len(files)
    return EncodedImageSource(
        f"{name}/{split}",
        locations,
        np.asarray(labels, dtype=np.int64),
        list(TINYIMAGENET20_WNIDS),
        image_size=image_size,
        hflip=True,
        cache_size=cache_size,
    )
