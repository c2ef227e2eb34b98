"""Gallery index: content-addressed Parquet shards and manifests under one root (a local folder or ``s3://``).

Layout::

    ROOT/HEAD                      {"manifest": "<sha256>"}: the current manifest (one small object, replaced
                                   atomically: a local rename or one S3 PUT)
    ROOT/manifests/<sha256>.json   a manifest: the embedding width, item count, the image preprocessing, the model
                                   that built it, and its shards in order
    ROOT/shards/<sha256>.parquet   rows: position (int64, 0-based gallery position), item_id (string), embedding
                                   (fixed_size_list<float32>[D]), model_version (string), payload_uri (string,
                                   nullable), label (int64, nullable)
    ROOT/ann/<sha256>.faiss        the approximate search structure of an index built with --kind ivf / hnsw /
                                   ivfpq (``faiss.serialize_index`` bytes), described by the manifest's "search"
                                   entry: kind, build parameters, search effort, the measured recall and its sample;
                                   during a backfill into an approximate index, the "search_backfill" entry
                                   describes a second structure of the same kind over the rows re-embedded so far
    ROOT/rows/<sha256>.f16         an ivfpq structure's rows (fp16, row-major, as an ivf structure would store them),
                                   the "search" entry's "row_file": a replica re-ranks from them, read per candidate (a
                                   local copy of an s3:// root's, fetched once into ``COMPAT_ROW_FILE_CACHE``)

Every blob is named by the sha256 of its bytes and verified on read (an ``IntegrityError`` names the file, the
expected and the actual hash); manifests are stored by the one manifest codec (:mod:`compat_core.codec`). A position
may occur in several shards: the last shard listed wins, so a backfill writes the re-embedded rows of a chunk as a new shard and flips them all at once by committing a manifest that
lists it (one HEAD swap); readers see either the whole chunk in the new version or none of it.
"""
from __future__ import annotations

import ctypes
import hashlib
import io
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cluster.serving.string_column import StringColumn, gather_strings
from compat_core import io as cio
from compat_core.codec import decode_manifest, encode_manifest
from compat_core.integrity import IntegrityError
from compat_core.retrieval.ann import STORED_EXACT, AnnIndex
from compat_core.retrieval.row_file import RowFile
from pipelines.store.run_store import sha256_bytes

FORMAT = "compat-gallery-index/1"
HEAD = "HEAD"

__all__ = ["GalleryIndex", "shard_table", "write_shard", "commit_manifest", "read_head", "read_manifest",
           "load_index", "new_manifest", "write_ann", "write_row_file_blob", "search_entry", "FORMAT"]


@dataclass(frozen=True)
class GalleryIndex:
    """A loaded index, in gallery position order (position = row)."""

    manifest_sha: str
    manifest: dict
    item_ids: StringColumn        # (N,) str, held as one Arrow string array (decoded when read)
    embeddings: np.ndarray | None  # (N, D) float32 as stored; None when only the structure holds the rows
    versions: np.ndarray          # (N,) str: the model version that embedded each item
    payload_uris: StringColumn    # (N,) str or None
    labels: np.ndarray | None     # (N,) int64 or None
    ann: AnnIndex | None = None   # the approximate structure over the rows of manifest["search"]["model_version"]
    ann_backfill: AnnIndex | None = None   # manifest["search_backfill"]'s, over the rows re-embedded so far
    version_set: frozenset = field(init=False, repr=False)   # the distinct versions, found once at load

    def __post_init__(self) -> None:
        # a request naming another model version is checked against this set, not against the (N,) column
        object.__setattr__(self, "version_set", frozenset(str(v) for v in np.unique(self.versions).tolist()))

    def structures(self) -> dict[str, AnnIndex]:
        """model version -> the approximate structure over its rows (empty for an exact-only index)."""
        found = {}
        for structure, entry in ((self.ann, search_entry(self.manifest)),
                                 (self.ann_backfill, self.manifest.get("search_backfill") or {})):
            if structure is not None and entry.get("model_version"):
                found[str(entry["model_version"])] = structure
        return found

    @property
    def search_kind(self) -> str:
        return str(search_entry(self.manifest)["kind"])

    @property
    def size(self) -> int:
        return len(self.item_ids)

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    @property
    def rows_in_structure(self) -> bool:
        """Whether the approximate structure alone holds the gallery's rows (``embeddings`` is None): it stores
        them exactly (kinds ``STORED_EXACT``) or reads them from its row file (``ivfpq``), and every
        row is of the version it was built over."""
        return self.embeddings is None

    def row(self, position: int) -> np.ndarray:
        """(D,) float32: the stored row of gallery ``position`` (from the structure when it alone holds them)."""
        if self.embeddings is not None:
            return self.embeddings[int(position)]
        return self.ann.stored_rows(int(position), int(position) + 1)[0]


def shard_table(positions, item_ids, embeddings, version: str, payload_uris=None, labels=None) -> pa.Table:
    """One shard's rows as an Arrow table (embedding a fixed-size list of float32)."""
    embeddings = np.ascontiguousarray(np.asarray(embeddings, dtype=np.float32))
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings: expected (n, D), got shape {embeddings.shape}")
    count, dim = embeddings.shape
    columns = {
        "position": pa.array(np.asarray(positions, dtype=np.int64)),
        "item_id": pa.array([str(x) for x in item_ids], pa.string()),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(embeddings.reshape(-1)), dim),
        "model_version": pa.array([str(version)] * count, pa.string()),
        "payload_uri": pa.array(list(payload_uris) if payload_uris is not None else [None] * count, pa.string()),
        "label": pa.array(np.asarray(labels, dtype=np.int64) if labels is not None else [None] * count, pa.int64()),
    }
    for name, column in columns.items():
        if len(column) != count:
            raise ValueError(f"{name}: {len(column)} values for {count} embeddings")
    return pa.table(columns)


def _write_content_addressed(root: str, folder: str, suffix: str, data: bytes) -> tuple[str, str]:
    """Write ``data`` as ``<folder>/<sha256>.<suffix>`` under ``root`` unless that file exists (same name, same
    bytes); returns (its name relative to ``root``, its sha256)."""
    digest = sha256_bytes(data)
    name = f"{folder}/{digest}.{suffix}"
    target = cio.join(root, name)
    if not cio.exists(target):
        cio.write_bytes(target, data)
    return name, digest


def write_shard(root: str, table: pa.Table) -> dict:
    """Write a shard (content-addressed); returns its manifest entry."""
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    data = sink.getvalue()
    name, digest = _write_content_addressed(root, "shards", "parquet", data)
    versions = sorted(set(table.column("model_version").to_pylist()))
    return {"file": name, "sha256": digest, "rows": table.num_rows, "model_versions": versions}


def write_ann(root: str, data: bytes) -> dict:
    """Write an approximate structure's bytes (content-addressed); returns its file entry."""
    name, digest = _write_content_addressed(root, "ann", "faiss", data)
    return {"file": name, "sha256": digest, "bytes": len(data)}


def write_row_file_blob(root: str, data: bytes) -> dict:
    """Write an ivfpq structure's fp16 rows (content-addressed); returns the "row_file" entry."""
    name, digest = _write_content_addressed(root, "rows", "f16", data)
    return {"file": name, "sha256": digest, "bytes": len(data), "dtype": "float16"}


def _local_row_file(root: str, entry: dict, rows: int, dim: int) -> RowFile:
    """The "row_file" of search ``entry`` as a local file, its sha256 verified (streamed, never held
    whole); a remote root's is fetched once into ``COMPAT_ROW_FILE_CACHE`` (default: the system's temporary folder)
    and reused while its digest matches."""
    uri = cio.join(root, entry["file"])
    if cio.is_remote(uri):
        folder = os.environ.get("COMPAT_ROW_FILE_CACHE") or os.path.join(tempfile.gettempdir(), "compat-row-files")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{entry['sha256']}.f16")
        if not (os.path.exists(path) and _file_sha256(path) == entry["sha256"]):
            partial = f"{path}.{os.getpid()}.part"
            with cio.open_input(uri) as source, open(partial, "wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 23)
            os.replace(partial, path)
    else:
        path = uri
    actual = _file_sha256(path)
    if actual != entry["sha256"]:
        raise IntegrityError(f"{uri}: sha256 expected {entry['sha256']}, actual {actual}", uri=uri, field="sha256",
                             expected=entry["sha256"], actual=actual)
    try:
        return RowFile(path, rows, dim)
    except ValueError as error:
        raise IntegrityError(f"{uri}: {error}", uri=uri, field="row_file bytes") from None


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        for block in iter(lambda: source.read(1 << 23), b""):
            digest.update(block)
    return digest.hexdigest()


def search_entry(manifest: dict) -> dict:
    """The manifest's "search" entry ({"kind": "flat"} for an exact-only index)."""
    return manifest.get("search") or {"kind": "flat"}


def _load_ann(root: str, entry: dict, dim: int) -> AnnIndex | None:
    if entry.get("kind", "flat") == "flat":
        return None
    uri = cio.join(root, entry["file"])
    ann = AnnIndex.from_bytes(_verified(uri, entry["sha256"]), entry["kind"], entry["params"], entry["effort"], uri)
    if ann.dim != dim or ann.size != int(entry["rows"]):
        raise IntegrityError(f"{uri}: {ann.size} x {ann.dim} rows, the manifest says {entry['rows']} x {dim}",
                             uri=uri, field="ann rows", expected=[int(entry["rows"]), dim],
                             actual=[ann.size, ann.dim])
    return ann


def new_manifest(dim: int, count: int, model: dict, shards: list[dict], image: dict | None = None,
                 pool: dict | None = None, parent: str | None = None, **extra) -> dict:
    return {"format": FORMAT, "dim": int(dim), "count": int(count), "model": model, "image": image, "pool": pool,
            "shards": shards, "parent": parent, "created_unix": time.time(), **extra}


def commit_manifest(root: str, manifest: dict, expected_head: str | None = None) -> str:
    """Store ``manifest`` and point HEAD at it; returns its sha256. expected_head: refuse (ValueError) when HEAD
    moved since it was read (another writer), so no committed chunk is lost."""
    if expected_head is not None and read_head(root) != expected_head:
        raise ValueError(f"{root}/HEAD moved from {expected_head[:12]} while this manifest was prepared "
                         "(another backfill or build?); re-run it")
    data = encode_manifest(manifest)
    digest = sha256_bytes(data)
    cio.write_bytes(cio.join(root, f"manifests/{digest}.json"), data)
    cio.write_bytes(cio.join(root, HEAD), encode_manifest({"manifest": digest}))
    return digest


def read_head(root: str) -> str:
    """sha256 of the current manifest; FileNotFoundError naming the root when there is no index there."""
    uri = cio.join(root, HEAD)
    try:
        data = cio.read_bytes(uri)
    except FileNotFoundError:
        raise FileNotFoundError(f"{uri}: no gallery index here; build one with `compat index build`") from None
    document = decode_manifest(data, uri, "gallery index HEAD")
    digest = document.get("manifest")
    if not isinstance(digest, str) or len(digest) != 64:
        raise IntegrityError(f"{uri}: expected {{'manifest': '<sha256>'}}, got {document!r}"[:300], uri=uri)
    return digest


def _verified(uri: str, expected: str) -> bytes:
    data = cio.read_bytes(uri)
    actual = sha256_bytes(data)
    if actual != expected:
        raise IntegrityError(f"{uri}: sha256 expected {expected}, actual {actual}", uri=uri, field="sha256",
                             expected=expected, actual=actual)
    return data


def read_manifest(root: str, digest: str | None = None) -> tuple[str, dict]:
    """(sha256, manifest) of ``digest`` or of HEAD, verified."""
    digest = digest or read_head(root)
    uri = cio.join(root, f"manifests/{digest}.json")
    manifest = decode_manifest(_verified(uri, digest), uri, "gallery index manifest")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{root}: manifest {digest[:12]} has format {manifest.get('format')!r}, expected {FORMAT}")
    return digest, manifest


def load_index(root: str, digest: str | None = None, lean: bool = False) -> GalleryIndex:
    """The index at HEAD (or manifest ``digest``): every shard verified, later shards overriding earlier ones.
    lean: when the approximate structure holds every row exactly (kinds ``STORED_EXACT``), or holds lossy codes
    and comes with a row file (``ivfpq``), and the manifest lists only rows of the version it was built over, the
    shards' embedding column is not loaded (``embeddings`` None) and the structure is made ready to re-rank from
    its own rows or the row file (16 bytes a row, 8 for ivfpq); a search then answers exactly over
    the rows as stored."""
    digest, manifest = read_manifest(root, digest)
    dim, count = int(manifest["dim"]), int(manifest["count"])
    rows_in_structure = lean and _structure_holds_rows(manifest)
    embeddings = None if rows_in_structure else np.zeros((count, dim), dtype=np.float32)
    columns = _RowColumns(count)
    for entry in manifest["shards"]:
        uri = cio.join(root, entry["file"])
        shard = pq.ParquetFile(io.BytesIO(_verified(uri, entry["sha256"])))
        width = shard.schema_arrow.field("embedding").type.list_size
        if width != dim:
            raise IntegrityError(f"{uri}: embedding width {width}, manifest says {dim}", uri=uri,
                                 field="embedding width", expected=dim, actual=width)
        # on the calling thread: Arrow's pool returns what its worker threads allocated only in part
        table = shard.read(columns=[name for name in shard.schema_arrow.names
                                    if not (rows_in_structure and name == "embedding")], use_threads=False)
        positions = table.column("position").to_numpy()
        if positions.size and (positions.min() < 0 or positions.max() >= count):
            raise IntegrityError(f"{uri}: positions outside 0..{count - 1}", uri=uri)
        if embeddings is not None:
            embeddings[positions] = table.column("embedding").combine_chunks().flatten().to_numpy(
                zero_copy_only=False).reshape(-1, dim)
        columns.add(positions, table)
    if not columns.seen.all():
        raise IntegrityError(f"{root}: manifest {digest[:12]} leaves {int((~columns.seen).sum())} of {count} "
                             f"gallery positions without a row (e.g. {int(np.flatnonzero(~columns.seen)[0])})")
    ann, versions = _load_ann(root, search_entry(manifest), dim), columns.versions()
    if rows_in_structure:
        built_for = str(search_entry(manifest)["model_version"])
        if not np.all(versions == built_for):
            raise IntegrityError(f"{root}: manifest {digest[:12]} lists shards of version {built_for} only, their "
                                 f"rows say {sorted(set(versions.tolist()))}", uri=root, field="model_versions")
        if ann.kind not in STORED_EXACT:   # lossy codes: the candidates' rows are read from the row file
            entry = search_entry(manifest)
            ann.attach_rows(_local_row_file(root, entry["row_file"], ann.size, dim))
        ann.prepare_rerank()
    item_ids, payloads = columns.strings("item_id"), columns.strings("payload_uri")
    labels = columns.labels if columns.has_label.all() else None
    del columns
    _return_freed_memory()
    return GalleryIndex(digest, manifest, item_ids, embeddings, versions, payloads, labels, ann,
                        _load_ann(root, manifest.get("search_backfill") or {}, dim))


class _RowColumns:
    """The per-row columns of an index's shards gathered in position order without one Python object a row: the
    last shard listed wins a position. Strings stay Arrow arrays until the end (:class:`StringColumn`), versions
    are held as codes into the distinct names met."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.seen = np.zeros(count, dtype=bool)
        self.labels = np.full(count, -1, dtype=np.int64)
        self.has_label = np.zeros(count, dtype=bool)
        self.version_codes = np.zeros(count, dtype=np.int32)
        self.version_names: list[str] = []
        self.source = np.zeros(count, dtype=np.int64)   # position -> row of the shards laid end to end
        self.chunks: dict[str, list[pa.Array]] = {"item_id": [], "payload_uri": []}
        self.rows = 0

    def add(self, positions: np.ndarray, table: pa.Table) -> None:
        for name, chunks in self.chunks.items():
            chunks.append(table.column(name).combine_chunks())
        self.source[positions] = self.rows + np.arange(positions.size)
        self.rows += positions.size
        encoded = table.column("model_version").combine_chunks().dictionary_encode()
        names = [str(name) for name in encoded.dictionary.to_pylist()]
        for name in names:
            if name not in self.version_names:
                self.version_names.append(name)
        remap = np.asarray([self.version_names.index(name) for name in names], dtype=np.int32)
        self.version_codes[positions] = remap[encoded.indices.to_numpy(zero_copy_only=False)]
        label_column = table.column("label")
        valid = ~np.asarray(label_column.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        self.labels[positions[valid]] = np.asarray(label_column.drop_null().to_numpy(), dtype=np.int64)
        self.has_label[positions] = valid
        self.seen[positions] = True

    def versions(self) -> np.ndarray:
        """(N,) str: the model version of each position."""
        return np.asarray(self.version_names or [""], dtype=str)[self.version_codes]

    def strings(self, name: str) -> StringColumn:
        return StringColumn(gather_strings(self.chunks.pop(name), self.source), self.count)


def _return_freed_memory() -> None:
    """Hand the memory the load freed back to the system: the shards' decoded columns (Arrow's pool) and the
    temporaries between the structure's and the columns' allocations (the C heap keeps freed pages resident until
    trimmed, glibc only)."""
    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: its allocator decides
        pass


def _structure_holds_rows(manifest: dict) -> bool:
    """Whether the manifest's search structure holds every gallery row exactly (or, for lossy codes, comes with a
    file of the rows as stored): a kind of ``STORED_EXACT`` or with a "row_file", over all ``count`` rows, every
    shard of the version it was built over, and no backfill under way."""
    entry = search_entry(manifest)
    built_for = entry.get("model_version")
    return ((entry["kind"] in STORED_EXACT or bool(entry.get("row_file"))) and built_for is not None
            and not manifest.get("search_backfill")
            and int(entry.get("rows", -1)) == int(manifest["count"])
            and all(shard.get("model_versions") == [str(built_for)] for shard in manifest["shards"]))
