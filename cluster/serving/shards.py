"""A gallery index split by row range into shards (``compat index build --shards N``), each a complete index.

Layout::

    ROOT/SHARDS.json          {"format": "compat-shard-set/1", "dim", "count", "model", "search": kind,
                               "parts": [{"root": "part-0000", "offset", "rows", "manifest": "<sha256>"}, ...]}
    ROOT/part-0000/...        an ordinary gallery index (HEAD, manifests, Parquet shards, its own faiss structure)
                              of rows offset .. offset + rows - 1; its positions are local (0-based within the
                              part), its item ids and payload URIs global; its manifest's "shard" entry repeats
                              {"index", "of", "offset", "rows", "count"}

``manifest`` is the digest of the part's manifest as built; a part's HEAD may move later (a backfill of that part),
its row count and offset may not (:func:`check_shard_set`). ``compat serve ROOT`` serves each part by its own
deployment and merges their answers exactly (:mod:`cluster.serving.shard_router`).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from cluster.serving.index_store import (
    HEAD,
    commit_manifest,
    new_manifest,
    read_manifest,
    shard_table,
    write_shard,
)
from compat_core import io as cio
from compat_core.codec import decode_manifest, encode_manifest
from compat_core.integrity import IntegrityError
from compat_core.retrieval.shard_merge import shard_ranges
from pipelines.store.run_store import sha256_bytes

SHARD_SET = "SHARDS.json"
SET_FORMAT = "compat-shard-set/1"

__all__ = ["SHARD_SET", "SET_FORMAT", "is_sharded", "read_shard_set", "check_shard_set", "part_root",
           "write_sharded_index"]


def is_sharded(root: str) -> bool:
    """Whether ``root`` holds a sharded index (its ``SHARDS.json``)."""
    return cio.exists(cio.join(root, SHARD_SET))


def part_root(root: str, part: dict) -> str:
    """The index root of one part of the shard set at ``root``."""
    return cio.join(root, str(part["root"]))


def read_shard_set(root: str) -> tuple[str, dict]:
    """(sha256 of its bytes, document) of the shard set at ``root``; IntegrityError naming the file when its row
    ranges do not tile 0..count - 1 in order."""
    uri = cio.join(root, SHARD_SET)
    data = cio.read_bytes(uri)
    document = decode_manifest(data, uri, "shard set")
    if document.get("format") != SET_FORMAT:
        raise ValueError(f"{uri}: format {document.get('format')!r}, expected {SET_FORMAT}")
    parts, expected = document.get("parts") or [], 0
    for number, part in enumerate(parts):
        if int(part["offset"]) != expected or int(part["rows"]) < 1:
            raise IntegrityError(f"{uri}: part {number} covers rows {part['offset']}+{part['rows']}, expected to "
                                 f"start at row {expected} with at least one row", uri=uri, field="parts")
        expected += int(part["rows"])
    if not parts or expected != int(document["count"]):
        raise IntegrityError(f"{uri}: parts cover {expected} rows, the set says {document.get('count')}", uri=uri,
                             field="count", expected=document.get("count"), actual=expected)
    return sha256_bytes(data), document


def check_shard_set(root: str, document: dict) -> list[dict]:
    """The manifest at HEAD of every part, checked against the set (width, row count and offset); IntegrityError
    naming the part's root otherwise."""
    manifests = []
    for part in document["parts"]:
        where = part_root(root, part)
        _, manifest = read_manifest(where)
        shard = manifest.get("shard") or {}
        found = (int(manifest["dim"]), int(manifest["count"]), shard.get("offset"))
        wanted = (int(document["dim"]), int(part["rows"]), int(part["offset"]))
        if found != wanted:
            raise IntegrityError(f"{where}: (width, rows, offset) {found}, the shard set at {root} says {wanted}",
                                 uri=where, field="shard", expected=list(wanted), actual=list(found))
        manifests.append(manifest)
    return manifests


def _write_part(where: str, features: np.ndarray, offset: int, shard_rows: int, version: str,
                payload_prefix: str | None, labels: np.ndarray | None) -> list[dict]:
    files = []
    for start in range(0, features.shape[0], shard_rows):
        stop = min(features.shape[0], start + shard_rows)
        global_rows = np.arange(offset + start, offset + stop)
        payloads = [f"{payload_prefix.rstrip('/')}/{i}" for i in global_rows] if payload_prefix else None
        files.append(write_shard(where, shard_table(np.arange(start, stop), [str(i) for i in global_rows],
                                                    features[start:stop], version, payloads,
                                                    None if labels is None else labels[start:stop])))
    return files


def write_sharded_index(root: str, features: np.ndarray, shards: int, model: dict, *, search: Callable | None = None,
                        labels: np.ndarray | None = None, shard_rows: int = 4096, payload_prefix: str | None = None,
                        log: Callable[[str], None] = print, **manifest_fields) -> tuple[str, dict]:
    """Split ``features`` (N, D) by row range into ``shards`` parts under ``root``, each an index of its own
    (Parquet shards, manifest, HEAD; ``search(part_root, part_features)`` returns its manifest "search" entry,
    None: exact only), and write the shard set; returns (its sha256, the document). model: {"name", "version"}.
    Refuses a root that already holds an index."""
    if cio.exists(cio.join(root, HEAD)) or is_sharded(root):
        raise ValueError(f"{root}: already holds a gallery index; build a sharded one in an empty folder or prefix")
    if shard_rows < 1:
        raise ValueError(f"--shard-rows: expected a positive number of rows, got {shard_rows}")
    count, dim = features.shape
    parts = []
    for number, (start, stop) in enumerate(shard_ranges(count, shards)):
        name = f"part-{number:04d}"
        where = cio.join(root, name)
        files = _write_part(where, features[start:stop], start, shard_rows, str(model["version"]), payload_prefix,
                            None if labels is None else labels[start:stop])
        entry = search(where, features[start:stop]) if search is not None else {"kind": "flat"}
        manifest = new_manifest(dim, stop - start, model, files, search=entry,
                                shard={"index": number, "of": shards, "offset": start, "rows": stop - start,
                                       "count": count}, **manifest_fields)
        digest = commit_manifest(where, manifest)
        parts.append({"root": name, "offset": start, "rows": stop - start, "manifest": digest})
        log(f"index: shard {number + 1}/{shards} rows {start}..{stop - 1} ({entry['kind']}), manifest "
            f"{digest[:12]} at {where}")
    document = {"format": SET_FORMAT, "dim": int(dim), "count": int(count), "model": model,
                "search": parts and entry["kind"], "parts": parts}
    data = encode_manifest(document)
    cio.write_bytes(cio.join(root, SHARD_SET), data)
    return sha256_bytes(data), document
