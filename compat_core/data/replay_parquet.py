"""Replay shards: each task's replay memory and its exemplar images as one Parquet file under a JSON manifest.

Layout under a run root (local folder or ``s3://bucket/prefix``; resolved by :mod:`compat_core.io`, so both are
the same code)::

    shards/replay/task-003.parquet         rows of the memory (0-based task 3 in the name)
    shards/replay/task-003.manifest.json   {"sha256", "size", "rows", "schema", ...}, written after the Parquet file

A shard exists exactly when its manifest exists: a crash after the Parquet file and before the manifest leaves no
shard, and writing again replaces the orphan. Readers verify size, sha256, row count, schema and every row's
content hash, and raise :class:`~compat_core.integrity.IntegrityError` naming bucket, key, expected and actual values.

Images of encoded sources (JPEG/PNG folders, CelebA, CASIA-WebFace, ingested encoded shards: any source with
``encoded_images(indices)``) are stored as their original encoded bytes (``image_encoding`` ``encoded/<decoder>``)
and decoded on read, batch by batch, exactly as the source decodes them (:class:`EncodedImages`): a CelebA exemplar
is ~10 KB of JPEG instead of 147 KB of decoded 224 px pixels. Images of array sources (CIFAR pickles, glyphs) are
stored raw: uint8 bytes in (H, W, C) order (``raw-uint8-hwc``) plus ``height``/``width``/``channels`` columns.
Raw bytes are lossless for any channel count and need no codec on the training path; on 32 px CIFAR-like images
zstd-compressed raw rows are about as small as PNG while PNG costs an encode per exemplar and a decode per read
(``benchmarks/replay_encoding.py``).

Feature shards are not duplicated here: :func:`pipelines.store.run_store.feature_blobs` already writes fp16 ``.npy`` shards
inside a RunStore stage (sha256-verified on read), and RunStore works on ``s3://`` through the same filesystem.
"""
from __future__ import annotations

import hashlib
import os
import struct
import uuid
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from compat_core import io as cio
from compat_core.codec import decode_manifest, encode_manifest, from_json
from compat_core.data.encoded import DECODERS, ENCODED_PREFIX, EncodedImages
from compat_core.data.replay import ReplayMemory
from compat_core.integrity import IntegrityError

SHARD_FORMAT = "compat-replay-shard/1"
IMAGE_ENCODING = "raw-uint8-hwc"
REPLAY_PREFIX = "shards/replay"

REPLAY_SCHEMA = pa.schema([
    pa.field("index", pa.int64(), nullable=False),        # sample key into the task's image source
    pa.field("label", pa.int64(), nullable=False),        # dataset class id
    pa.field("slot", pa.int64(), nullable=False),         # classifier slot / d-Simplex column
    pa.field("source_task", pa.int64(), nullable=False),  # 0-based task the sample came from
    pa.field("height", pa.int32(), nullable=False),
    pa.field("width", pa.int32(), nullable=False),
    pa.field("channels", pa.int32(), nullable=False),
    pa.field("image", pa.large_binary(), nullable=False),  # uint8 bytes (H, W, C) row-major, or encoded bytes
    pa.field("content_hash", pa.string(), nullable=False),  # sha256 hex of the row, see row_content_hash
])


def corrupt_shard(uri: str, field: str, expected: Any, actual: Any, detail: str = "") -> IntegrityError:
    """The integrity error of a replay shard that differs from its manifest or record (names bucket and key, or the
    local file, then ``field``, the expected and the actual value)."""
    return IntegrityError.mismatch("corrupt replay shard", uri, field, expected, actual, detail)


@dataclass(frozen=True)
class ShardManifest:
    """What a reader checks a replay shard against. ``task`` is 0-based; ``size`` in bytes; ``sha256`` hex."""

    task: int
    parquet_file: str  # name next to the manifest
    sha256: str
    size: int
    rows: int
    schema: str  # str(pyarrow schema) of the Parquet file
    image_shape: tuple[int, int, int]  # (H, W, C) of every image in the shard
    image_encoding: str = IMAGE_ENCODING
    format: str = SHARD_FORMAT


def _read_manifest(data: bytes, uri: str) -> ShardManifest:
    """The manifest stored at ``uri``; an integrity error naming ``uri`` when it is not a version-1 manifest."""
    document = decode_manifest(data, uri, "corrupt replay shard")
    if document.get("format") != SHARD_FORMAT:
        raise corrupt_shard(uri, "manifest format", SHARD_FORMAT, document.get("format"))
    expected = {spec.name for spec in fields(ShardManifest)}
    if set(document) != expected:
        raise corrupt_shard(uri, "manifest fields", sorted(expected), sorted(document))
    shape = document["image_shape"]
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and v >= 0 for v in shape)):
        raise corrupt_shard(uri, "manifest image_shape", "[H, W, C] of integers >= 0", shape)
    return from_json(ShardManifest, document, uri)


def encoded_images(source, indices) -> EncodedImages | None:
    """The encoded bytes of samples ``indices`` of ``source`` when it has them (``source.encoded_images``), else
    None (array sources)."""
    method = getattr(source, "encoded_images", None)
    return None if method is None else method(np.asarray(indices, dtype=np.int64))


def concatenate_images(parts: list) -> "np.ndarray | EncodedImages":
    """Rows of several uint8 arrays / EncodedImages in order: EncodedImages when every part is encoded the same
    way, else a decoded uint8 array."""
    if parts and all(isinstance(p, EncodedImages) for p in parts) and \
            len({(p.image_shape, p.decoder) for p in parts}) == 1:
        return EncodedImages([b for p in parts for b in p.blobs], parts[0].image_shape, parts[0].decoder)
    return np.concatenate([np.asarray(p) if not isinstance(p, EncodedImages) else p[:] for p in parts], axis=0)


@dataclass(frozen=True)
class ReplayShard:
    """A verified replay shard: the memory record, its images in memory order (uint8 ``(M, H, W, C)``, or
    :class:`EncodedImages` decoded on indexing for an encoded shard), the per-row content hashes (sha256 hex,
    ``(M,)``) and the manifest it was checked against."""

    memory: ReplayMemory
    images: "np.ndarray | EncodedImages"
    content_hashes: tuple[str, ...]
    manifest: ShardManifest


def shard_uris(store_or_root, task: int) -> tuple[str, str]:
    """(Parquet URI, manifest URI) of the replay shard of 0-based ``task`` under a RunStore or a root URI/path."""
    root = _root_of(store_or_root)
    _check_task(task)
    stem = cio.join(root, REPLAY_PREFIX, f"task-{task:03d}")
    return f"{stem}.parquet", f"{stem}.manifest.json"


def row_content_hash(index: int, label: int, slot: int, source_task: int, image: np.ndarray) -> str:
    """sha256 hex of one row: little-endian int64 index, label, slot, source_task, int32 H, W, C, then the image's
    uint8 bytes in (H, W, C) order. The same exemplar gets the same hash in every shard that holds it."""
    height, width, channels = image.shape
    return _row_hash(index, label, slot, source_task, (height, width, channels),
                     np.ascontiguousarray(image, dtype=np.uint8).tobytes())


def _row_hash(index: int, label: int, slot: int, source_task: int, shape: tuple, data: bytes) -> str:
    """sha256 hex of one row: the header of :func:`row_content_hash`, then the stored image bytes (raw pixels,
    or the encoded file for an encoded shard)."""
    header = struct.pack("<qqqqiii", index, label, slot, source_task, *shape)
    return hashlib.sha256(header + data).hexdigest()


def write_replay_shard(store_or_root, task: int, memory: ReplayMemory, source) -> ShardManifest:
    """Write the replay memory after 0-based ``task`` with its images; the manifest is committed last.

    source: an image source with ``read(indices) -> uint8 (n, H, W, C)`` (the samples' dataset; ``memory.indices``
    are its keys; its encoded bytes are stored when it has ``encoded_images``), or a uint8 array / EncodedImages
    ``(M, H, W, C)`` aligned with the memory's rows.
    Returns the committed manifest.
    """
    if not isinstance(memory, ReplayMemory):
        raise TypeError(f"memory must be a ReplayMemory, got {type(memory).__name__}")
    parquet_uri, manifest_uri = shard_uris(store_or_root, task)
    images = _images_for(memory, source)
    table = _replay_table(memory, images)

    fs, path = cio.resolve(parquet_uri)
    local = isinstance(fs, pafs.LocalFileSystem)
    parent, _, name = path.rpartition("/")
    if local:
        fs.create_dir(parent, recursive=True)
    # locally: write under a temporary name and rename, so a crash never leaves a truncated file at the final name
    target = f"{parent}/.tmp-{uuid.uuid4().hex}-{name}" if local else path
    try:
        with fs.open_output_stream(target, compression=None) as raw:
            sink = _HashingSink(raw)
            pq.write_table(table, sink, compression="zstd")
        if local:
            fs.move(target, path)
    finally:
        if local and fs.get_file_info(target).type != pafs.FileType.NotFound:
            fs.delete_file(target)
    manifest = ShardManifest(task=int(task), parquet_file=parquet_uri.rsplit("/", 1)[1],
                             sha256=sink.sha256.hexdigest(), size=sink.size, rows=table.num_rows,
                             schema=str(table.schema), image_shape=tuple(int(v) for v in images.shape[1:]),
                             image_encoding=images.encoding if isinstance(images, EncodedImages) else IMAGE_ENCODING)
    cio.write_bytes(manifest_uri, encode_manifest(manifest))
    return manifest


def read_replay_shard(store_or_root, task: int) -> ReplayShard:
    """Read and verify the replay shard of 0-based ``task``.

    Raises FileNotFoundError when no manifest is committed, IntegrityError (naming bucket, key, expected and
    actual) when the Parquet file is missing or differs in size, sha256, row count, schema or a row's content hash.
    """
    parquet_uri, manifest_uri = shard_uris(store_or_root, task)
    try:
        manifest_data = cio.read_bytes(manifest_uri)
    except FileNotFoundError as error:
        if type(error) is not FileNotFoundError:
            raise  # e.g. a missing bucket: its own message is more precise
        raise FileNotFoundError(f"replay shard of task {task} is not committed: no manifest at {manifest_uri}") \
            from None
    manifest = _read_manifest(manifest_data, manifest_uri)
    if manifest.task != task:
        raise corrupt_shard(manifest_uri, "task", task, manifest.task)
    try:
        data = cio.read_bytes(parquet_uri)
    except FileNotFoundError as error:
        if type(error) is not FileNotFoundError:
            raise
        raise corrupt_shard(parquet_uri, "size", f"{manifest.size} bytes", "file missing") from None
    if len(data) != manifest.size:
        raise corrupt_shard(parquet_uri, "size", f"{manifest.size} bytes", f"{len(data)} bytes")
    actual_sha = hashlib.sha256(data).hexdigest()
    if actual_sha != manifest.sha256:
        raise corrupt_shard(parquet_uri, "sha256", manifest.sha256, actual_sha)
    try:
        table = pq.read_table(pa.BufferReader(data))
    except pa.ArrowException as error:
        raise corrupt_shard(parquet_uri, "Parquet content", "a readable Parquet file", f"unreadable ({error})") \
            from None
    if table.num_rows != manifest.rows:
        raise corrupt_shard(parquet_uri, "row count", manifest.rows, table.num_rows)
    if str(table.schema) != manifest.schema:
        raise corrupt_shard(parquet_uri, "schema", repr(manifest.schema), repr(str(table.schema)))
    return _decode_table(table, manifest, parquet_uri)


# ---- helpers --------------------------------------------------------------------------------------------------------
class _HashingSink:
    """A write-only file object that forwards to a pyarrow output stream while hashing and counting the bytes."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.closed = False

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        self.raw.write(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass  # the underlying stream is flushed when it is closed by the caller

    def close(self) -> None:
        self.closed = True  # the caller owns and closes the underlying stream


def _root_of(store_or_root) -> str:
    root = getattr(store_or_root, "root", store_or_root)
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"store_or_root must be a RunStore or a root path/URI, got {type(store_or_root).__name__}")
    return os.fspath(root)


def _check_task(task) -> None:
    if isinstance(task, bool) or not isinstance(task, (int, np.integer)) or task < 0:
        raise ValueError(f"task must be a 0-based integer index, got {task!r}")


def _images_for(memory: ReplayMemory, source) -> "np.ndarray | EncodedImages":
    encoded = source if isinstance(source, EncodedImages) else None
    if encoded is None and not isinstance(source, np.ndarray) and len(memory):
        encoded = encoded_images(source, memory.indices)
    if encoded is not None:
        if len(encoded) != len(memory):
            raise ValueError(f"{type(source).__name__} gave {len(encoded)} encoded images but the memory has "
                             f"{len(memory)} rows")
        return encoded
    if isinstance(source, np.ndarray):
        images = source
        origin = "source array"
    elif hasattr(source, "read"):
        origin = f"{type(source).__name__}.read(memory.indices)"
        if len(memory):
            images = np.asarray(source.read(memory.indices))
        else:  # nothing to read; keep the source's image shape so the empty shard still records it
            images = np.zeros((0, *tuple(getattr(source, "image_shape", (0, 0, 1)))), dtype=np.uint8)
    else:
        raise TypeError(f"source must be an image source with read(indices) or a uint8 array (M, H, W, C), "
                        f"got {type(source).__name__}")
    if images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(f"{origin} must be uint8 (M, H, W, C), got {images.dtype} {images.shape}")
    if images.shape[0] != len(memory):
        raise ValueError(f"{origin} has {images.shape[0]} images but the memory has {len(memory)} rows")
    return np.ascontiguousarray(images)


def _replay_table(memory: ReplayMemory, images: "np.ndarray | EncodedImages") -> pa.Table:
    rows, height, width, channels = images.shape
    keys = list(zip(memory.indices, memory.labels, memory.slots, memory.source_task))
    if isinstance(images, EncodedImages):
        image_column = pa.array(images.blobs, pa.large_binary())
        hashes = [_row_hash(int(i), int(y), int(s), int(t), images.image_shape, images.blobs[r])
                  for r, (i, y, s, t) in enumerate(keys)]
    else:
        row_bytes = height * width * channels
        # one contiguous buffer + offsets: no per-row Python bytes objects for the image column
        offsets = pa.py_buffer(np.arange(rows + 1, dtype=np.int64) * row_bytes)
        image_column = pa.LargeBinaryArray.from_buffers(pa.large_binary(), rows,
                                                        [None, offsets, pa.py_buffer(images.reshape(-1))])
        hashes = [row_content_hash(int(i), int(y), int(s), int(t), images[r]) for r, (i, y, s, t) in enumerate(keys)]
    columns = {
        "index": pa.array(memory.indices, pa.int64()),
        "label": pa.array(memory.labels, pa.int64()),
        "slot": pa.array(memory.slots, pa.int64()),
        "source_task": pa.array(memory.source_task, pa.int64()),
        "height": pa.array(np.full(rows, height, np.int32)),
        "width": pa.array(np.full(rows, width, np.int32)),
        "channels": pa.array(np.full(rows, channels, np.int32)),
        "image": image_column,
        "content_hash": pa.array(hashes, pa.string()),
    }
    return pa.Table.from_pydict(columns, schema=REPLAY_SCHEMA)


def _decode_table(table: pa.Table, manifest: ShardManifest, uri: str) -> ReplayShard:
    encodings = (IMAGE_ENCODING, *(ENCODED_PREFIX + d for d in DECODERS))
    if manifest.image_encoding not in encodings:
        raise corrupt_shard(uri, "image_encoding", f"one of {encodings}", manifest.image_encoding)
    ints = {name: table.column(name).to_numpy().astype(np.int64) for name in ("index", "label", "slot",
                                                                                "source_task")}
    dims = [np.unique(table.column(name).to_numpy()) for name in ("height", "width", "channels")]
    rows = table.num_rows
    shape = tuple(manifest.image_shape)
    encoded = manifest.image_encoding != IMAGE_ENCODING
    if rows and (any(d.size != 1 for d in dims) or tuple(int(d[0]) for d in dims) != shape):
        raise corrupt_shard(uri, "image shape", f"{shape} for every row",
                                f"heights {dims[0][:5].tolist()}, widths {dims[1][:5].tolist()}, "
                                f"channels {dims[2][:5].tolist()}")
    if encoded:
        # kept encoded: rows are decoded when a batch indexes them (EncodedImages), checked here by their bytes
        blobs = table.column("image").to_pylist()
        images = EncodedImages(blobs, shape, manifest.image_encoding[len(ENCODED_PREFIX):])
        hashes = table.column("content_hash").to_pylist()
        for row in range(rows):
            actual = _row_hash(int(ints["index"][row]), int(ints["label"][row]), int(ints["slot"][row]),
                               int(ints["source_task"][row]), shape, blobs[row])
            if actual != hashes[row]:
                raise corrupt_shard(uri, f"content hash of row {row}", hashes[row], actual)
        memory = ReplayMemory(indices=ints["index"], labels=ints["label"], slots=ints["slot"],
                              source_task=ints["source_task"])
        return ReplayShard(memory=memory, images=images, content_hashes=tuple(hashes), manifest=manifest)
    if rows == 0:
        images = np.zeros((0, *shape), dtype=np.uint8)
    else:
        blobs = table.column("image").to_pylist()
        expected_bytes = shape[0] * shape[1] * shape[2]
        for row, blob in enumerate(blobs):
            if len(blob) != expected_bytes:
                raise corrupt_shard(uri, f"image bytes of row {row}", expected_bytes, len(blob))
        images = np.frombuffer(b"".join(blobs), dtype=np.uint8).reshape(rows, *shape)
    hashes = table.column("content_hash").to_pylist()
    for row in range(rows):
        actual = row_content_hash(int(ints["index"][row]), int(ints["label"][row]), int(ints["slot"][row]),
                                  int(ints["source_task"][row]), images[row])
        if actual != hashes[row]:
            raise corrupt_shard(uri, f"content hash of row {row}", hashes[row], actual)
    memory = ReplayMemory(indices=ints["index"], labels=ints["label"], slots=ints["slot"],
                          source_task=ints["source_task"])
    return ReplayShard(memory=memory, images=images, content_hashes=tuple(hashes), manifest=manifest)

