"""Labeled Faces in the Wild: the images named by ``pairs.txt`` and its 10-fold verification pairs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compat_core import io
from compat_core.data.datasets import register_dataset
from compat_core.data.formats._shared import (
    EncodedImageSource,
    check_image_files,
    contained_path,
    locate_dir,
    parse_int,
    read_text_lines,
    require_root,
)

PAIRS_FORMAT = (
    "pairs.txt: first line '<folds>\\t<n>' (10\\t300), then per fold n same-person lines '<name>\\t<i>\\t<j>' "
    "followed by n different-person lines '<name1>\\t<i>\\t<name2>\\t<j>' (1-based image numbers)"
)
LAYOUT = f"<root>/ with lfw/<name>/<name>_<4-digit number>.jpg and {PAIRS_FORMAT}"


@dataclass(frozen=True)
class VerificationPairs:
    """1:1 verification pairs over a source's samples: ``left``/``right`` 0-based sample indices (P,), ``same`` (P,)
    bool, ``fold`` (P,) 0-based fold of the published 10-fold protocol."""

    left: np.ndarray
    right: np.ndarray
    same: np.ndarray
    fold: np.ndarray

    def __len__(self) -> int:
        return int(self.left.shape[0])


def parse_pairs(uri: str, lines: dict | None = None) -> tuple[list[tuple[str, int, str, int, bool, int]], int, int]:
    """Rows ``(name1, i, name2, j, same, fold)`` of a published pairs.txt, plus (folds, pairs per half-fold).

    lines: filled with ``(name, image number) -> first line naming it`` (for errors about that image)."""
    rows = read_text_lines("lfw", uri, PAIRS_FORMAT)
    if not rows or len(rows[0][1]) != 2:
        raise ValueError(f"lfw: {uri} line 1: expected the header '<folds>\\t<n>'; {PAIRS_FORMAT}")
    folds = parse_int("lfw", uri, rows[0][0], rows[0][1][0], PAIRS_FORMAT)
    per_half = parse_int("lfw", uri, rows[0][0], rows[0][1][1], PAIRS_FORMAT)
    body = rows[1:]
    if len(body) != 2 * folds * per_half:
        raise ValueError(f"lfw: {uri} has {len(body)} pair lines, the header '{folds}\\t{per_half}' announces {2 * folds * per_half}")
    pairs = []
    for position, (number, fields) in enumerate(body):
        fold, within = divmod(position, 2 * per_half)
        same_expected = within < per_half
        if same_expected and len(fields) != 3:
            raise ValueError(f"lfw: {uri} line {number}: expected a same-person line '<name>\\t<i>\\t<j>', got {fields}")
        if not same_expected and len(fields) != 4:
            raise ValueError(f"lfw: {uri} line {number}: expected a different-person line '<name1>\\t<i>\\t<name2>\\t<j>', got {fields}")
        if same_expected:
            name1, name2 = fields[0], fields[0]
            i, j = fields[1], fields[2]
        else:
            name1, i, name2, j = fields
        first = parse_int("lfw", uri, number, i, PAIRS_FORMAT)
        second = parse_int("lfw", uri, number, j, PAIRS_FORMAT)
        for value in (first, second):
            if value < 1:
                raise ValueError(f"lfw: {uri} line {number}: image number {value} is not a 1-based image number; "
                                 f"expected {PAIRS_FORMAT}")
        if lines is not None:
            lines.setdefault((name1, first), number)
            lines.setdefault((name2, second), number)
        pairs.append((name1, first, name2, second, same_expected, fold))
    return pairs, folds, per_half


@register_dataset(
    "lfw",
    summary="LFW 1:1 verification: the images referenced by pairs.txt (6,000 pairs in 10 folds) with person labels",
    splits=("pairs",),
    layout=LAYOUT,
    options={
        "image_size": "side in pixels of the square images read() returns (default 112, the CASIA-trained models' input)",
        "cache_size": "decoded images kept in memory (LRU, default 256; 0 disables)",
    },
)
def load_lfw(root: str | None, split: str, image_size: int = 112, cache_size: int = 256) -> EncodedImageSource:
    """LFW images used by pairs.txt (sorted by person and number); ``source.pairs`` is a :class:`VerificationPairs`.

    Labels are 0-based person ids in sorted-name order; ``class_names`` are the person names.
    """
    root = require_root("lfw", root, LAYOUT)
    base = locate_dir("lfw", root, [], ["pairs.txt"], LAYOUT)
    pairs_uri, lines = io.join(base, "pairs.txt"), {}
    pairs, _, _ = parse_pairs(pairs_uri, lines)
    image_dir = io.join(base, "lfw")
    keys = sorted({(p[0], p[1]) for p in pairs} | {(p[2], p[3]) for p in pairs})
    position = {key: i for i, key in enumerate(keys)}
    people = sorted({name for name, _ in keys})
    person = {name: i for i, name in enumerate(people)}
    # a name is a folder and a file stem: one that leaves lfw/ (../, an absolute path) is refused by its line
    locations = [contained_path("lfw", image_dir, f"{name}/{name}_{number:04d}.jpg", pairs_uri, lines[(name, number)])
                 for name, number in keys]
    # every image exists, is not empty and looks like an image, before any is decoded (one recursive listing of
    # lfw/, a few requests on an object store, not one per image or per person)
    check_image_files("lfw", locations, [f"{pairs_uri} line {lines[key]}" for key in keys], root=image_dir)
    source = EncodedImageSource(
        "lfw/pairs",
        locations,
        np.asarray([person[name] for name, _ in keys], dtype=np.int64),
        people,
        image_size=image_size,
        hflip=True,
        cache_size=cache_size,
    )
    source.pairs = VerificationPairs(  # type: ignore[attr-defined]
        left=np.asarray([position[(p[0], p[1])] for p in pairs], dtype=np.int64),
        right=np.asarray([position[(p[2], p[3])] for p in pairs], dtype=np.int64),
        same=np.asarray([p[4] for p in pairs], dtype=bool),
        fold=np.asarray([p[5] for p in pairs], dtype=np.int64),
    )
    return source
