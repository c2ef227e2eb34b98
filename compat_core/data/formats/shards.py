"""Ingested datasets: one dataset split as Parquet shards of images + labels under a verified JSON manifest.

Written by ``compat ingest`` (:mod:`cluster.storage.ingest`), read back as the registered dataset ``shards``::

    <root>/<split>/manifest.json          DatasetManifest: source dataset, classes, normalisation, one entry per file
    <root>/<split>/part-00000.parquet     rows [0, n0) of the split: index (source sample), label, image
    <root>/<split>/part-00000.json        the part's own record (written after the part, used to resume an ingest)

Images keep the source's own bytes: published JPEG/PNG files are stored as they are (``encoding: encoded``) and
decoded exactly like the source reader decodes them, in-memory arrays (CIFAR, glyphs...) as raw uint8 (H, W, C)
(``encoding: raw-uint8-hwc``). So the ingested split reads back bit-identical to the published one, in the same
sample order, with the same labels, class names and normalisation statistics.

Opening a split checks every part against the manifest (size and sha256) before anything is returned, and raises
an :class:`~compat_core.integrity.IntegrityError` naming bucket, key and the expected sha256 when a part is missing
or differs.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from compat_core import io as cio
from compat_core.codec import decode_manifest, encode_manifest, from_json
from compat_core.data.datasets import DATASETS, DatasetInfo, register_dataset
from compat_core.data.encoded import DECODERS, EncodedImages, decode_batch, decode_image
from compat_core.integrity import IntegrityError

FORMAT = "compat-dataset-shards/1"
ENCODED = "encoded"  # the published JPEG/PNG bytes, decoded and fitted to image_shape on read
RAW = "raw-uint8-hwc"  # uint8 bytes in (H, W, C) row-major order
MANIFEST_NAME = "manifest.json"
SCHEMA = pa.schema([
    pa.field("index", pa.int64(), nullable=False),  # 0-based sample index in the source split
    pa.field("label", pa.int64(), nullable=False),  # 0-based class id of the source
    pa.field("image", pa.large_binary(), nullable=False),
])
DEFAULT_ROW_GROUP_BYTES = 32 * 1024 * 1024  # large ranged reads: one S3 GET brings tens of MB


def _corrupt(uri: str, field: str, expected: Any, actual: Any) -> IntegrityError:
    """The integrity error of an ingested part or manifest (names bucket and key, or the local file)."""
    return IntegrityError.mismatch("dataset shard", uri, field, expected, actual)


@dataclass(frozen=True)
class PartRecord:
    """One Parquet part: ``name`` next to the manifest, ``start`` the first row (= source index), ``rows``,
    ``size`` in bytes, ``sha256`` hex of the file, ``row_groups``."""

    name: str
    start: int
    rows: int
    size: int
    sha256: str
    row_groups: int


@dataclass(frozen=True)
class DatasetManifest:
    """What an ingested split holds. ``image_shape`` (H, W, C) of every decoded image; ``mean``/``std`` per channel
    in [0, 1] units; ``source`` the dataset, split and options that were ingested."""

    source: dict
    encoding: str
    image_shape: tuple[int, int, int]
    rows: int
    class_names: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    hflip: bool
    parts: tuple[PartRecord, ...]
    coarse_labels: list[int] | None = None
    format: str = FORMAT


def _read_manifest(data: bytes, uri: str) -> DatasetManifest:
    """The dataset manifest stored at ``uri``; an integrity error naming ``uri`` when it is not a version-1 one."""
    document = decode_manifest(data, uri, "dataset shard")
    if document.get("format") != FORMAT:
        raise _corrupt(uri, "manifest format", FORMAT, document.get("format"))
    try:
        return from_json(DatasetManifest, document, uri)
    except (ValueError, TypeError) as error:
        raise _corrupt(uri, "manifest fields", sorted(spec.name for spec in fields(DatasetManifest)),
                       f"{error}") from None


def split_root(root: str, split: str) -> str:
    """Folder (or prefix) of one ingested split."""
    return cio.join(os.fspath(root), split)


def part_name(number: int) -> str:
    return f"part-{number:05d}.parquet"


# ---- writing (used by cluster.storage.ingest) ----------------------------------------------------------------------------
def source_encoding(source) -> str:
    """ENCODED for sources that hold published encoded files (they expose ``encoded_bytes``), RAW otherwise."""
    return ENCODED if hasattr(source, "encoded_bytes") else RAW


def rows_table(source, start: int, stop: int) -> pa.Table:
    """Rows ``[start, stop)`` of ``source`` as a table of SCHEMA (encoded bytes as stored, or raw uint8 HWC)."""
    indices = np.arange(start, stop, dtype=np.int64)
    if source_encoding(source) == ENCODED:
        images = pa.array([source.encoded_bytes(int(i)) for i in indices], pa.large_binary())
    else:
        block = np.ascontiguousarray(source.read(indices), dtype=np.uint8)
        row_bytes = int(np.prod(block.shape[1:]))
        offsets = pa.py_buffer(np.arange(indices.size + 1, dtype=np.int64) * row_bytes)
        images = pa.LargeBinaryArray.from_buffers(pa.large_binary(), indices.size,
                                                  [None, offsets, pa.py_buffer(block.reshape(-1))])
    labels = np.asarray(source.labels, dtype=np.int64)[indices]
    return pa.Table.from_arrays([pa.array(indices), pa.array(labels), images], schema=SCHEMA)


def write_part(folder: str, number: int, table: pa.Table, row_group_bytes: int = DEFAULT_ROW_GROUP_BYTES) -> PartRecord:
    """Write one part (zstd, row groups of about ``row_group_bytes``) and its record; the record is written last,
    so a part exists exactly when its record does. Returns the record."""
    name = part_name(number)
    uri = cio.join(folder, name)
    per_row = max(1, table.nbytes // max(table.num_rows, 1))
    rows_per_group = max(1, int(row_group_bytes // per_row))
    fs, path = cio.resolve(uri)
    local = isinstance(fs, pafs.LocalFileSystem)
    parent = path.rpartition("/")[0]
    if local:
        fs.create_dir(parent, recursive=True)
    target = f"{parent}/.tmp-{uuid.uuid4().hex}-{name}" if local else path
    digest, size = hashlib.sha256(), 0
    try:
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer, compression="zstd", row_group_size=rows_per_group)
        data = buffer.getvalue().to_pybytes()
        digest.update(data)
        size = len(data)
        with fs.open_output_stream(target, compression=None) as handle:
            handle.write(data)
        if local:
            fs.move(target, path)
    finally:
        if local and fs.get_file_info(target).type != pafs.FileType.NotFound:
            fs.delete_file(target)
    groups = -(-table.num_rows // rows_per_group) if table.num_rows else 0
    record = PartRecord(name=name, start=int(table.column("index")[0].as_py()) if table.num_rows else 0,
                        rows=table.num_rows, size=size, sha256=digest.hexdigest(), row_groups=groups)
    cio.write_bytes(cio.join(folder, name.replace(".parquet", ".json")), encode_manifest(record))
    return record


def committed_part(folder: str, number: int, start: int, rows: int) -> PartRecord | None:
    """The record of part ``number`` when it is committed with the expected rows and its file still matches it
    (size and sha256); None when the part must be (re)written."""
    record_uri = cio.join(folder, part_name(number).replace(".parquet", ".json"))
    if not cio.exists(record_uri):
        return None
    try:
        record = from_json(PartRecord, decode_manifest(cio.read_bytes(record_uri), record_uri, "dataset part"))
    except (ValueError, TypeError, IntegrityError):
        return None
    if record.start != start or record.rows != rows:
        return None
    try:
        verify_part(folder, record)
    except IntegrityError:
        return None
    return record


def write_manifest(folder: str, manifest: DatasetManifest) -> str:
    """Commit the manifest (the split exists from this moment). Returns its URI."""
    return cio.write_bytes(cio.join(folder, MANIFEST_NAME), encode_manifest(manifest))


# ---- reading ------------------------------------------------------------------------------------------------------
def verify_part(folder: str, record: PartRecord, check_sha256: bool = True) -> None:
    """Raise IntegrityError (bucket, key, expected sha256) when the part is missing or differs."""
    uri = cio.join(folder, record.name)
    fs, path = cio.resolve(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise _corrupt(uri, "sha256", record.sha256, "file missing")
    if info.size != record.size:
        raise _corrupt(uri, "sha256", f"{record.sha256} ({record.size} bytes)", f"{info.size} bytes")
    if check_sha256:
        digest = hashlib.sha256()
        with fs.open_input_stream(path) as handle:
            while chunk := handle.read(8 * 1024 * 1024):
                digest.update(chunk)
        if digest.hexdigest() != record.sha256:
            raise _corrupt(uri, "sha256", record.sha256, digest.hexdigest())


def read_manifest(root: str, split: str) -> DatasetManifest:
    """The manifest of an ingested split; FileNotFoundError naming the URI when the split was never committed."""
    uri = cio.join(split_root(root, split), MANIFEST_NAME)
    if not cio.exists(uri):
        raise FileNotFoundError(f"shards: no manifest at {uri}; expected an ingested split (run `compat ingest`)")
    return _read_manifest(cio.read_bytes(uri), uri)


def _nothing_kept() -> tuple[np.ndarray, pa.Array]:
    """``ShardSource``'s kept rows when none are kept: no sample index, no stored bytes."""
    return np.zeros(0, dtype=np.int64), pa.array([], type=pa.large_binary())


class ShardSource:
    """An ImageSource over an ingested split. Labels come from the manifest's parts; images are read per Parquet
    row group (one ranged read each, an LRU of ``cache_groups`` groups) and decoded like the source reader."""

    def __init__(self, name: str, folder: str, manifest: DatasetManifest, labels: np.ndarray,
                 cache_groups: int = 4, decoder: str = "pil") -> None:
        self.name = name
        self.folder = folder
        self.manifest = manifest
        self.labels = labels
        self.class_names = list(manifest.class_names)
        self.coarse_labels = None if manifest.coarse_labels is None else np.asarray(manifest.coarse_labels, np.int64)
        self.image_shape = tuple(int(v) for v in manifest.image_shape)
        self.mean = tuple(manifest.mean)
        self.std = tuple(manifest.std)
        self.hflip = bool(manifest.hflip)
        self._starts = np.asarray([p.start for p in manifest.parts], dtype=np.int64)
        self.cache_groups = int(cache_groups)
        if decoder not in DECODERS:
            raise ValueError(f"shards: option decoder must be one of {DECODERS}, got {decoder!r}")
        self.decoder = decoder
        self._groups: OrderedDict[tuple[int, int], tuple[int, list]] = OrderedDict()
        self._group_starts: dict[int, np.ndarray] = {}
        # the rows a training task reads: sorted sample indices and their stored bytes in one Arrow array (one
        # buffer: forked input workers read it without copying pages, as touching per-row bytes objects would)
        self._kept_index, self._kept_rows = _nothing_kept()

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_groups"] = OrderedDict()  # row groups and kept rows stay behind when shipped to a Ray worker
        state["_kept_index"], state["_kept_rows"] = _nothing_kept()
        return state

    def _part_file(self, part: int) -> pq.ParquetFile:
        return pq.ParquetFile(cio.open_input(cio.join(self.folder, self.manifest.parts[part].name)))

    def _locate(self, index: int) -> tuple[int, int, int]:
        """(part, row group, row inside the group) of sample ``index``."""
        part = int(np.searchsorted(self._starts, index, side="right") - 1)
        if part not in self._group_starts:
            meta = self._part_file(part).metadata
            sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            self._group_starts[part] = np.concatenate([[0], np.cumsum(sizes)])[:-1].astype(np.int64)
        offset = index - int(self._starts[part])
        group = int(np.searchsorted(self._group_starts[part], offset, side="right") - 1)
        return part, group, offset - int(self._group_starts[part][group])

    def _group(self, part: int, group: int) -> list:
        key = (part, group)
        if key in self._groups:
            self._groups.move_to_end(key)
            return self._groups[key]
        images = self._part_file(part).read_row_group(group, columns=["image"]).column("image").to_pylist()
        self._groups[key] = images
        if len(self._groups) > max(self.cache_groups, 1):
            self._groups.popitem(last=False)
        return images

    def keep_rows(self, indices: np.ndarray) -> None:
        """Keep the stored bytes of samples ``indices`` in memory until the next call (which replaces them), read
        in storage order with one ranged read per row group that holds any of them.

        A training task reads its rows in a new random order every epoch: through the LRU of row groups, a shuffled
        batch of 64 touches dozens of ~32 MB groups and re-reads most of them (tens of times the decode cost, and
        a GET each from S3). Kept rows are read from memory in any order, also by DataLoader workers forked after
        this call. Memory: the stored size of those rows (a CelebA JPEG is ~10 KB)."""
        wanted = np.unique(np.asarray(indices, dtype=np.int64).reshape(-1))
        if wanted.size and (wanted[0] < 0 or wanted[-1] >= len(self)):
            raise IndexError(f"{self.name}: sample indices must lie in [0, {len(self)}), got "
                             f"[{wanted[0]}, {wanted[-1]}]")
        self._kept_index, self._kept_rows = _nothing_kept()
        by_group: dict[tuple[int, int], list[int]] = {}
        for index in wanted:  # sorted: groups come in storage order, each row after the previous one
            part, group, row = self._locate(int(index))
            by_group.setdefault((part, group), []).append(row)
        chunks = [self._part_file(part).read_row_group(group, columns=["image"]).column("image")
                  .take(pa.array(rows, type=pa.int64())) for (part, group), rows in by_group.items()]
        rows = pa.chunked_array(chunks, type=pa.large_binary()).combine_chunks() if chunks else self._kept_rows
        self._kept_index, self._kept_rows = wanted, rows

    def encoded_rows(self, indices: Sequence[int]) -> list[bytes]:
        """The stored bytes of samples ``indices`` (encoded files or raw uint8 HWC)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        out: list = [None] * indices.size
        if self._kept_index.size and indices.size:
            at = np.minimum(np.searchsorted(self._kept_index, indices), self._kept_index.size - 1)
            hit = np.flatnonzero(self._kept_index[at] == indices)
            for row, blob in zip(hit, self._kept_rows.take(pa.array(at[hit], type=pa.int64())).to_pylist()):
                out[row] = blob
        for row, index in enumerate(indices):
            if out[row] is None:
                part, group, offset = self._locate(int(index))
                out[row] = self._group(part, group)[offset]
        return out

    def encoded_images(self, indices: np.ndarray):
        """Encoded bytes of samples ``indices`` as replay-shard images decoded like :meth:`read` (None for a raw
        split: its rows are pixels already)."""
        if self.manifest.encoding != ENCODED:
            return None
        return EncodedImages(self.encoded_rows(indices), self.image_shape, self.decoder)

    def read(self, indices: np.ndarray) -> np.ndarray:
        """uint8 images ``(n, H, W, C)`` for 0-based sample ``indices``, in that order."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"{self.name}: sample indices must lie in [0, {len(self)}), got "
                             f"[{indices.min()}, {indices.max()}]")
        blobs = self.encoded_rows(indices)
        if self.manifest.encoding == ENCODED and self.decoder == "torchvision":
            return decode_batch(blobs, self.image_shape[0], self.name)
        out = np.empty((indices.size, *self.image_shape), dtype=np.uint8)
        for row, (index, data) in enumerate(zip(indices, blobs)):
            if self.manifest.encoding == RAW:
                out[row] = np.frombuffer(data, dtype=np.uint8).reshape(self.image_shape)
            else:
                out[row] = decode_image(data, self.image_shape[0], f"{self.name}: sample {int(index)}")
        return out

    def __repr__(self) -> str:
        return f"ShardSource(name={self.name!r}, samples={len(self)}, classes={self.num_classes}, folder={self.folder!r})"


def open_shards(root: str, split: str, verify: str = "sha256", decoder: str = "pil") -> ShardSource:
    """Open an ingested split after checking every part against the manifest (``verify``: "sha256" reads every
    part once, "size" only compares sizes). Raises IntegrityError naming bucket, key and expected sha256."""
    if verify not in ("sha256", "size"):
        raise ValueError(f"shards: option verify must be 'sha256' or 'size', got {verify!r}")
    folder = split_root(root, split)
    manifest = read_manifest(root, split)
    labels = []
    for part in manifest.parts:
        verify_part(folder, part, check_sha256=verify == "sha256")
        table = pq.ParquetFile(cio.open_input(cio.join(folder, part.name))).read(columns=["label"])
        labels.append(table.column("label").to_numpy().astype(np.int64))
    labels_array = np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64)
    if labels_array.shape[0] != manifest.rows:
        raise _corrupt(cio.join(folder, MANIFEST_NAME), "rows", manifest.rows, labels_array.shape[0])
    dataset = manifest.source.get("dataset", "?")
    return ShardSource(f"{dataset}/{manifest.source.get('split', split)}", folder, manifest, labels_array,
                       decoder=decoder)


def _known_splits() -> tuple[str, ...]:
    """Every split name of the other registered datasets, plus common ones: an ingested split keeps its source split's
    name. Called when ``shards`` is looked up, once every reader is registered."""
    names = {"train", "test", "val", "valid", "pairs", "finetune", "pretrain", "query", "gallery", "all"}
    for name in DATASETS.names():
        entry = DATASETS.get(name)
        if isinstance(entry, DatasetInfo) and entry.derived_splits is None:
            names.update(entry.splits)
    return tuple(sorted(names))


@register_dataset(
    "shards",
    summary="a dataset split ingested by `compat ingest` into Parquet shards (verified against its manifest)",
    splits=_known_splits,
    layout="<root>/<split>/manifest.json and part-NNNNN.parquet files written by `compat ingest`",
    options={"verify": "'sha256' (default: hash every part before use) or 'size' (sizes only, for huge splits)",
             "decoder": "'pil' (default: pixels identical to the published reader) or 'torchvision' (batched "
                        "torchvision libjpeg-turbo decode + OpenCV resize, ~3x faster, slightly different pixels)"},
)
def load_shards(root: str | None, split: str, verify: str = "sha256", decoder: str = "pil") -> ShardSource:
    if root is None:
        raise ValueError("shards: root is required (the folder or s3:// prefix given to `compat ingest --out`)")
    return open_shards(root, split, verify=verify, decoder=decoder)


__all__ = [
    "DatasetManifest",
    "PartRecord",
    "ShardSource",
    "committed_part",
    "open_shards",
    "read_manifest",
    "rows_table",
    "write_manifest",
    "write_part",
]
