"""Content identity of the weights files a scenario names (``pretrain[*].init``, ``replacements[*].source``,
``initial_model``) and of the data of a task given by its own data (``tasks.sources[*].data``): stage keys hash a
file's sha256, never its path, so overwriting the file at the same path gives new keys, and the same bytes at another
path give the same keys.

A data folder's digest (:func:`data_digest`) is the sha256 of its files' relative names, sizes and sha256s in name
order (hidden files, such as an ingest's temporary parts, left out); for Parquet shards of ``compat ingest`` it is the
split's manifest, which pins every part's sha256 (the reader checks the parts against it).

The digest of each file is computed once per process (cached by resolved location, size and modification time for
local files; by URI for object-store and registry sources, which are immutable once pinned) and travels in the
stage's inputs (``pipelines.stages.inputs.WeightsFile``), so the stage that loads the file refuses other bytes
(``load_external_weights(sha256=...)``).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow.fs as pafs

from compat_core import io as cio
from compat_core.models.weight_sources import resolve_weights_source, sha256_of
from pipelines.config.schema import PRETRAIN_PREFIX, PoolSpec

DIGEST_FIELD = "file_sha256"
SHARDS_DATASET = "shards"
SHARDS_MANIFEST = "manifest.json"
_CACHE: dict[tuple, str] = {}
_DATA_CACHE: dict[tuple, str] = {}
_LOG = logging.getLogger(__name__)
HASH_THREADS = 8  # concurrent file reads while hashing a data folder
PROGRESS_S = 30.0  # seconds between progress lines of a long hash


def _cache_key(resolved: str) -> tuple:
    if cio.is_remote(resolved):
        return (resolved,)
    stat = os.stat(resolved)
    return (os.path.realpath(resolved), stat.st_size, stat.st_mtime_ns)


def file_digest(source: str) -> str | None:
    """Hex sha256 of the weights file ``source`` names (resolved as the loader does: registry URI, folder ->
    its weights file), or None when it cannot be resolved or read here (the preflight reports why)."""
    try:
        resolved = resolve_weights_source(source)
        key = _cache_key(resolved)
        if key not in _CACHE:
            _CACHE[key] = sha256_of(resolved)
        return _CACHE[key]
    except (OSError, ValueError):
        return None


def hashed_source(source: str, expected_sha256: str | None = None) -> dict[str, Any]:
    """What a stage key hashes for a file source: ``{file_sha256: ...}`` (the expected digest when the config pins
    one, else the file's); ``{path, unreadable}`` when neither is known (such a run is refused by the preflight)."""
    digest = (expected_sha256 or "").lower() or file_digest(source)
    if digest:
        return {DIGEST_FIELD: digest}
    return {"path": str(source), "unreadable": True}


def _data_files(pool: PoolSpec) -> tuple[str, list[pafs.FileInfo]]:
    """(base, files) a pool's digest covers: every non-hidden file under its root, or an ingested split's manifest."""
    if pool.dataset == SHARDS_DATASET:
        base = cio.join(str(pool.root), pool.split)
        fs, path = cio.resolve(cio.join(base, SHARDS_MANIFEST))
        info = fs.get_file_info(path)
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(f"no ingested manifest at {cio.join(base, SHARDS_MANIFEST)}")
        return base, [info]
    fs, path = cio.resolve(str(pool.root))
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        raise FileNotFoundError(f"{pool.root} is not a folder")
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    files = [info for info in infos if info.type == pafs.FileType.File
             and not any(part.startswith(".") for part in info.path[len(path):].split("/"))]
    return str(pool.root), files


def data_digest(pool: PoolSpec) -> str | None:
    """Hex sha256 of the data a pool reads from its ``root`` (see the module docstring); computed once per process
    for an unchanged listing (names, sizes, modification times); None when the pool names no root (a generated or
    default-located dataset: its spec is its identity) or the root cannot be listed here (the preflight says why)."""
    if pool.root is None:
        return None
    try:
        base, files = _data_files(pool)
        fs, base_path = cio.resolve(base)
        files.sort(key=lambda info: info.path)
        listing = tuple((info.path[len(base_path):].lstrip("/"), info.size, info.mtime_ns) for info in files)
        key = (base if cio.is_remote(base) else os.path.realpath(base_path), listing)
        if key not in _DATA_CACHE:
            digest = hashlib.sha256()
            contents = _content_digests(fs, files, str(pool.root))
            for (name, size, _), content in zip(listing, contents):
                digest.update(f"{name}\t{size}\t{content}\n".encode())
            _DATA_CACHE[key] = digest.hexdigest()
        return _DATA_CACHE[key]
    except (OSError, ValueError):
        return None


def _file_sha256(fs: pafs.FileSystem, path: str) -> str:
    content = hashlib.sha256()
    with fs.open_input_stream(path, compression=None) as stream:
        while chunk := stream.read(1 << 20):
            content.update(chunk)
    return content.hexdigest()


def _content_digests(fs: pafs.FileSystem, files: list[pafs.FileInfo], where: str) -> list[str]:
    """sha256 of each file, in order, read by HASH_THREADS threads (object stores answer each read after a round
    trip); a log line every PROGRESS_S seconds with files/s, MiB/s and the ETA while it lasts."""
    total_bytes = sum(info.size or 0 for info in files)
    started = last = time.monotonic()
    done_bytes, digests = 0, []
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        for info, digest in zip(files, pool.map(lambda info: _file_sha256(fs, info.path), files)):
            digests.append(digest)
            done_bytes += info.size or 0
            now = time.monotonic()
            if now - last >= PROGRESS_S and len(digests) < len(files):
                last, rate = now, done_bytes / max(now - started, 1e-9)
                _LOG.info("hashing %s for the stage keys: %d/%d files, %.1f files/s, %.1f MiB/s, ETA %.0f s", where,
                          len(digests), len(files), len(digests) / (now - started), rate / 2 ** 20,
                          (total_bytes - done_bytes) / max(rate, 1e-9))
    return digests


__all__ = ["DIGEST_FIELD", "data_digest", "file_digest", "hashed_source"]
