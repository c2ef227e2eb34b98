"""CelebA aligned faces with identity labels and the published train/valid/test partition."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Iterable

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

SPLIT_CODES = {"train": 0, "valid": 1, "test": 2}
LAYOUT = (
    "<root>/ (or <root>/celeba/) with img_align_celeba/*.jpg, identity_CelebA.txt ('000001.jpg 2880': file and "
    "1-based identity per line) and list_eval_partition.txt ('000001.jpg 0': file and 0 = train, 1 = valid, 2 = test); "
    "the two text files may also sit in Anno/ and Eval/"
)


@dataclass(frozen=True)
class CelebaIndex:
    """Parsed CelebA text files: per image file name, its 1-based identity and its partition code (0/1/2)."""

    files: list[str]
    identities: np.ndarray  # (N,) int64, published 1-based identity numbers
    partitions: np.ndarray  # (N,) int64, 0 train / 1 valid / 2 test
    image_dir: str


def _text_file(base: str, filename: str, folder: str) -> str:
    for candidate in (io.join(base, filename), io.join(base, folder, filename)):
        if io.exists(candidate):
            return candidate
    raise FileNotFoundError(f"celeba: missing {filename} under {base} (or {base}/{folder}); expected {LAYOUT}")


def _two_column(uri: str, expected: str) -> dict[str, int]:
    """``file -> value``: duplicate files and names that leave the image folder refused, naming the line."""
    table: dict[str, int] = {}
    lines: dict[str, int] = {}
    for number, fields in read_text_lines("celeba", uri, LAYOUT):
        if len(fields) != 2 or not fields[0].lower().endswith(".jpg"):
            raise ValueError(f"celeba: {uri} line {number}: expected '{expected}', got {' '.join(fields)!r}")
        contained_path("celeba", "img_align_celeba", fields[0], uri, number)
        add_unique("celeba", uri, number, table, lines, fields[0], parse_int("celeba", uri, number, fields[1], expected))
    return table


def read_celeba_index(root: str) -> CelebaIndex:
    """Parse identity_CelebA.txt and list_eval_partition.txt (images sorted by file name)."""
    base = locate_dir("celeba", root, ["celeba"], ["img_align_celeba"], LAYOUT)
    identity_uri = _text_file(base, "identity_CelebA.txt", "Anno")
    partition_uri = _text_file(base, "list_eval_partition.txt", "Eval")
    identity = _two_column(identity_uri, "<file>.jpg <identity>")
    partition = _two_column(partition_uri, "<file>.jpg <0|1|2>")
    if set(identity) != set(partition):
        only = sorted(set(identity) ^ set(partition))[:5]
        raise ValueError(f"celeba: {identity_uri} and {partition_uri} list different images (e.g. {only})")
    files = sorted(identity)
    partitions = np.asarray([partition[f] for f in files], dtype=np.int64)
    bad = sorted({int(p) for p in partitions} - set(SPLIT_CODES.values()))
    if bad:
        raise ValueError(f"celeba: {partition_uri}: partition codes must be 0 (train), 1 (valid) or 2 (test), found {bad}")
    return CelebaIndex(files, np.asarray([identity[f] for f in files], dtype=np.int64), partitions, io.join(base, "img_align_celeba"))


@dataclass(frozen=True)
class IdentityOverlap:
    """Which CelebA partitions share identities. ``shared[(a, b)]`` = sorted 1-based identities in both a and b."""

    identities_per_split: dict[str, int]
    images_per_split: dict[str, int]
    shared: dict[tuple[str, str], list[int]]

    @property
    def disjoint(self) -> bool:
        return not any(self.shared.values())

    def summary(self) -> str:
        counts = ", ".join(f"{s}: {self.identities_per_split[s]} identities / {self.images_per_split[s]} images" for s in SPLIT_CODES)
        pairs = "; ".join(f"{a}&{b}: {len(ids)} shared" for (a, b), ids in self.shared.items())
        return f"{counts}; {pairs}; identity-disjoint: {self.disjoint}"


def check_identity_disjointness(root: str) -> IdentityOverlap:
    """Compare the identity sets of the train/valid/test partitions of the CelebA files under ``root``."""
    index = read_celeba_index(require_root("celeba", root, LAYOUT))
    sets = {s: set(index.identities[index.partitions == code].tolist()) for s, code in SPLIT_CODES.items()}
    return IdentityOverlap(
        identities_per_split={s: len(ids) for s, ids in sets.items()},
        images_per_split={s: int(np.sum(index.partitions == code)) for s, code in SPLIT_CODES.items()},
        shared={(a, b): sorted(sets[a] & sets[b]) for a, b in combinations(SPLIT_CODES, 2)},
    )


@register_dataset(
    "celeba",
    summary="CelebA aligned faces: 10,177 identities, 202,599 images; published partition train/valid/test",
    splits=("train", "valid", "test", "all"),
    layout=LAYOUT,
    options={
        "identities": "only these published 1-based identity numbers (iterable of ints); default every identity of the split",
        "min_images": "drop identities with fewer images than this in the selection (default 1)",
        "image_size": "side in pixels of the square images read() returns (default 224); shorter side scaled, centre crop",
        "cache_size": "decoded images kept in memory (LRU, default 256; 0 disables)",
    },
)
def load_celeba(
    root: str | None,
    split: str,
    identities: Iterable[int] | None = None,
    min_images: int = 1,
    image_size: int = 224,
    cache_size: int = 256,
) -> EncodedImageSource:
    """CelebA images of one partition; labels 0..n-1 follow the sorted published identity numbers of the selection.

    ``source.identity_ids[label]`` gives the published 1-based identity; ``class_names`` are those numbers as text.
    """
    index = read_celeba_index(require_root("celeba", root, LAYOUT))
    keep = np.ones(len(index.files), dtype=bool) if split == "all" else index.partitions == SPLIT_CODES[split]
    if identities is not None:
        wanted = np.asarray(sorted({int(i) for i in identities}), dtype=np.int64)
        unknown = np.setdiff1d(wanted, index.identities[keep])
        if unknown.size:
            raise ValueError(f"celeba: identities {unknown[:5].tolist()} have no image in split {split!r}")
        keep &= np.isin(index.identities, wanted)
    ids, counts = np.unique(index.identities[keep], return_counts=True)
    ids = ids[counts >= int(min_images)]
    keep &= np.isin(index.identities, ids)
    rows = np.flatnonzero(keep)
    labels = np.searchsorted(ids, index.identities[rows])
    locations = [io.join(index.image_dir, index.files[i]) for i in rows]
    check_image_files("celeba", locations)
    source = EncodedImageSource(
        f"celeba/{split}",
        locations,
        labels,
        [str(i) for i in ids],
        image_size=image_size,
        hflip=True,
        cache_size=cache_size,
    )
    source.identity_ids = ids  # type: ignore[attr-defined]
    return source
