"""Run storage: stage artifacts committed atomically (blobs first, the JSON manifest last) over ``pyarrow.fs``.

Layout under the run root (a local folder or an ``s3://bucket/prefix`` URI)::

    artifacts/<stage_key>/<blob name>     blobs of one stage (model weights, feature shards, ...)
    manifests/<stage_key>.json            {"stage_key", "record", "blobs": {name: {"sha256", "size"}}, "code_version",
                                           "precision" (training and extract stages),
                                           "compile", "channels_last" (training stages: on | off)}

A stage is done exactly when its manifest exists: a crash after some blobs and before the manifest leaves the stage
not done, and running it again overwrites the orphaned blobs. Locally every file is written under a temporary name
and renamed (rename is atomic on one filesystem); on S3 a PUT is atomic per object, so blobs are written directly.
Readers verify each blob's sha256 against the manifest.
"""
from __future__ import annotations

import hashlib
import io as _stdio
import os
import uuid
from typing import Any, Mapping

import numpy as np
import pyarrow.fs as pafs

from compat_core import io as cio
from compat_core.codec import decode_manifest, encode_manifest
from compat_core.integrity import IntegrityError
from compat_core.safetensors_index import PREFIX_BYTES, header_length, parse_header, tensor_index
from pipelines.records.payloads import FeatureLayout
from pipelines.store.lease import check_fence


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_array(array: np.ndarray) -> bytes:
    """numpy array -> .npy bytes (no pickle)."""
    buffer = _stdio.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def decode_array(data: bytes) -> np.ndarray:
    return np.load(_stdio.BytesIO(data), allow_pickle=False)


class RunStore:
    """Artifacts of one run directory. ``root`` is a local path or an ``s3://`` URI (resolved by compat_core.io)."""

    MANIFESTS = "manifests"
    ARTIFACTS = "artifacts"

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.fspath(root)
        self.fs, self.base = cio.resolve(self.root)
        self.is_local = isinstance(self.fs, pafs.LocalFileSystem)

    # ---- paths -------------------------------------------------------------------------------------------------
    def uri(self, *parts: str) -> str:
        """URI (or absolute local path) of a file under the run root."""
        return cio.join(self.root if not self.is_local else self.base, *parts)

    def manifest_path(self, stage_key: str) -> str:
        _check_key(stage_key)
        return f"{self.base}/{self.MANIFESTS}/{stage_key}.json"

    def blob_path(self, stage_key: str, name: str) -> str:
        _check_key(stage_key)
        _check_blob_name(name)
        return f"{self.base}/{self.ARTIFACTS}/{stage_key}/{name}"

    def blob_uri(self, stage_key: str, name: str) -> str:
        """The URI of a blob (s3://... or an absolute local path); ranged reads of a blob go through it."""
        return self.uri(self.ARTIFACTS, stage_key, name)

    # ---- low-level writes --------------------------------------------------------------------------------------
    def _write(self, path: str, data: bytes) -> None:
        check_fence(self.root)  # a driver that lost its run-folder lease writes nothing
        parent = path.rsplit("/", 1)[0]
        if self.is_local:
            self.fs.create_dir(parent, recursive=True)
            temporary = f"{parent}/.tmp-{uuid.uuid4().hex}-{path.rsplit('/', 1)[1]}"
            with self.fs.open_output_stream(temporary, compression=None) as handle:
                handle.write(data)
            # fsync so that a crash right after the rename cannot leave a renamed but empty file
            with open(temporary, "rb+") as handle:
                os.fsync(handle.fileno())
            self.fs.move(temporary, path)
        else:
            with self.fs.open_output_stream(path, compression=None) as handle:
                handle.write(data)

    def write_text(self, relative: str, text: str) -> str:
        """Write a top-level file of the run directory (config.yaml, matrix.json, ...) atomically; returns its URI."""
        self._write(f"{self.base}/{relative}", text.encode("utf-8"))
        return self.uri(relative)

    def read_text(self, relative: str) -> str:
        path = f"{self.base}/{relative}"
        if self.fs.get_file_info(path).type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"no such file in run {self.root}: {relative}")
        with self.fs.open_input_stream(path, compression=None) as handle:
            return handle.read().decode("utf-8")

    # ---- other files of the run (epoch checkpoints, ...) --------------------------------------------------------
    def write_bytes(self, relative: str, data: bytes) -> str:
        """Write a file under the run root atomically (rename locally, one PUT on S3); returns its URI."""
        self._write(f"{self.base}/{relative}", bytes(data))
        return self.uri(relative)

    def read_bytes(self, relative: str) -> bytes:
        path = f"{self.base}/{relative}"
        if self.fs.get_file_info(path).type != pafs.FileType.File:
            raise FileNotFoundError(f"no such file in run {self.root}: {relative}")
        with self.fs.open_input_stream(path, compression=None) as handle:
            return handle.read()

    def _entries(self, relative: str, kind: pafs.FileType) -> list[pafs.FileInfo]:
        directory = f"{self.base}/{relative}"
        if self.fs.get_file_info(directory).type != pafs.FileType.Directory:
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(directory, recursive=False))
        return [info for info in infos if info.type == kind and not info.base_name.startswith(".tmp-")]

    def list_files(self, relative: str) -> list[str]:
        """Names of the files directly under a folder of the run (empty when it does not exist), sorted."""
        return sorted(info.base_name for info in self._entries(relative, pafs.FileType.File))

    def list_dirs(self, relative: str) -> list[str]:
        """Names of the folders directly under a folder of the run (empty when it does not exist), sorted."""
        return sorted(info.base_name for info in self._entries(relative, pafs.FileType.Directory))

    def delete_file(self, relative: str) -> int:
        """Delete one file of the run if it exists; returns its size in bytes (0 when there was none)."""
        check_fence(self.root)
        path = f"{self.base}/{relative}"
        info = self.fs.get_file_info(path)
        if info.type != pafs.FileType.File:
            return 0
        self.fs.delete_file(path)
        return int(info.size or 0)

    def delete_tree(self, relative: str) -> int:
        """Delete a folder of the run and everything under it; returns the bytes freed (0 when there was none)."""
        check_fence(self.root)
        directory = f"{self.base}/{relative}"
        if self.fs.get_file_info(directory).type != pafs.FileType.Directory:
            return 0
        infos = self.fs.get_file_info(pafs.FileSelector(directory, recursive=True))
        freed = sum(int(info.size or 0) for info in infos if info.type == pafs.FileType.File)
        self.fs.delete_dir(directory)
        return freed

    # ---- stages ------------------------------------------------------------------------------------------------
    def has(self, stage_key: str) -> bool:
        """True when the stage's manifest is committed (the stage is done)."""
        return self.fs.get_file_info(self.manifest_path(stage_key)).type == pafs.FileType.File

    def commit(self, stage_key: str, record: Mapping[str, Any], blobs: Mapping[str, bytes] | None = None,
               code_version: str | None = None, precision: str | None = None, compiled: str | None = None,
               channels_last: str | None = None) -> dict:
        """Write ``blobs`` (name -> bytes) then the manifest holding ``record`` (JSON data), the code version and,
        for a stage whose output depends on it, the precision it computed in (fp32 | bf16 | fp16) and (training
        stages) whether its step ran compiled and in the channels_last layout (on | off). Returns the manifest."""
        infos: dict[str, dict] = {}
        for name, data in (blobs or {}).items():
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"blob {name!r} of stage {stage_key}: expected bytes, got {type(data).__name__}")
            data = bytes(data)
            self._write(self.blob_path(stage_key, name), data)
            infos[name] = {"sha256": sha256_bytes(data), "size": len(data)}
            if name.endswith(".safetensors"):
                # per-tensor digests: a reader that needs one tensor fetches and verifies only its byte range
                try:
                    infos[name]["index"] = tensor_index(data, self._display(self.blob_path(stage_key, name)))
                except (ValueError, KeyError, TypeError):
                    pass  # not a parsable safetensors file: readers read it whole, verified by its sha256
        manifest = {
            "stage_key": stage_key,
            "record": dict(record),
            "blobs": infos,
            "code_version": code_version,
        }
        if precision is not None:
            manifest["precision"] = precision
        if compiled is not None:
            manifest["compile"] = compiled
        if channels_last is not None:
            manifest["channels_last"] = channels_last
        data = encode_manifest(manifest)
        self._write(self.manifest_path(stage_key), data)
        return decode_manifest(data, self._display(self.manifest_path(stage_key)), "stage manifest", stage_key)

    def load_manifest(self, stage_key: str) -> dict:
        path = self.manifest_path(stage_key)
        if self.fs.get_file_info(path).type != pafs.FileType.File:
            raise FileNotFoundError(f"stage {stage_key} has no committed manifest at {self._display(path)}")
        with self.fs.open_input_stream(path, compression=None) as handle:
            return decode_manifest(handle.read(), self._display(path), "stage manifest", stage_key)

    def load_record(self, stage_key: str) -> dict:
        """The record committed with the stage (raises FileNotFoundError when the stage is not done)."""
        return self.load_manifest(stage_key)["record"]

    def read_blob(self, stage_key: str, name: str, manifest: dict | None = None) -> bytes:
        """Blob bytes, verified against the manifest's sha256 and size."""
        manifest = manifest or self.load_manifest(stage_key)
        if name not in manifest["blobs"]:
            raise KeyError(f"stage {stage_key} has no blob {name!r}; blobs: {sorted(manifest['blobs'])}")
        expected = manifest["blobs"][name]
        path = self.blob_path(stage_key, name)
        if self.fs.get_file_info(path).type != pafs.FileType.File:
            raise IntegrityError(f"{self._display(path)}: blob listed in the manifest is missing",
                                 uri=self._display(path), field="sha256", expected=expected["sha256"],
                                 actual="file missing", stage_key=stage_key)
        with self.fs.open_input_stream(path, compression=None) as handle:
            data = handle.read()
        actual = sha256_bytes(data)
        if actual != expected["sha256"] or len(data) != expected["size"]:
            raise IntegrityError(
                f"{self._display(path)}: sha256 expected {expected['sha256']} ({expected['size']} bytes), "
                f"actual {actual} ({len(data)} bytes)", uri=self._display(path), field="sha256",
                expected=expected["sha256"], actual=actual, stage_key=stage_key)
        return data

    def read_tensors(self, stage_key: str, name: str, tensors: list[str], manifest: dict | None = None) -> dict:
        """Raw bytes of some tensors of a safetensors blob: name -> (bytes, safetensors dtype, shape).

        With the per-tensor index the manifest holds (written by :meth:`commit`), only the header and the tensors'
        byte ranges are read (ranged GETs on S3), each checked against its recorded sha256 before use; a blob
        committed without an index is read whole and verified by its sha256. KeyError names a missing tensor."""
        manifest = manifest or self.load_manifest(stage_key)
        if name not in manifest["blobs"]:
            raise KeyError(f"stage {stage_key} has no blob {name!r}; blobs: {sorted(manifest['blobs'])}")
        index = manifest["blobs"][name].get("index")
        where = self._display(self.blob_path(stage_key, name))
        if index is None:
            data = self.read_blob(stage_key, name, manifest)
            layout = parse_header(data[PREFIX_BYTES: PREFIX_BYTES + header_length(data, where)], where)
            chunks = {t: data[layout[t]["offset"]: layout[t]["offset"] + layout[t]["length"]]
                      for t in tensors if t in layout}
        else:
            uri = self.blob_uri(stage_key, name)
            header = self._verified_range(uri, 0, int(index["header_bytes"]), index["header_sha256"], where,
                                          stage_key, "header")
            layout = parse_header(header[PREFIX_BYTES:], where)
            chunks = {}
            for tensor in tensors:
                if tensor in layout:
                    entry, recorded = layout[tensor], index["tensors"].get(tensor, {})
                    chunks[tensor] = self._verified_range(uri, entry["offset"], entry["length"],
                                                          recorded.get("sha256", ""), where, stage_key, tensor)
        missing = [t for t in tensors if t not in layout]
        if missing:
            raise KeyError(f"{where}: no tensor(s) {missing}; it holds {len(layout)} tensors")
        return {t: (chunks[t], layout[t]["dtype"], layout[t]["shape"]) for t in tensors}

    def _verified_range(self, uri: str, offset: int, length: int, sha256: str, where: str, stage_key: str,
                        what: str) -> bytes:
        data = cio.read_range(uri, offset, length)
        actual = sha256_bytes(data)
        if actual != sha256 or len(data) != length:
            raise IntegrityError(f"{where}: {what} (bytes {offset}..{offset + length}) sha256 expected "
                                 f"{sha256 or '(not recorded)'}, actual {actual} ({len(data)} bytes)", uri=where,
                                 field=f"{what} sha256", expected=sha256, actual=actual, stage_key=stage_key)
        return data

    def forget(self, stage_key: str) -> bool:
        """Uncommit a stage (delete its manifest) so the next run computes it again; its blobs are overwritten then.
        Returns whether it was committed."""
        _check_key(stage_key)
        path = self.manifest_path(stage_key)
        if self.fs.get_file_info(path).type != pafs.FileType.File:
            return False
        check_fence(self.root)
        self.fs.delete_file(path)
        return True

    def resolve_key(self, prefix: str) -> str:
        """The committed stage key that starts with ``prefix`` (keys are long; a unique prefix is enough)."""
        matches = [key for key in self.stage_keys() if key.startswith(prefix)]
        if len(matches) != 1:
            shown = ", ".join(matches[:5]) or "none"
            raise KeyError(f"--recompute {prefix}: {len(matches)} committed stage(s) of {self.root} start with it "
                           f"({shown}); give a longer prefix of the stage key from the error message")
        return matches[0]

    def stage_keys(self) -> list[str]:
        """Keys of every committed stage, sorted."""
        directory = f"{self.base}/{self.MANIFESTS}"
        if self.fs.get_file_info(directory).type != pafs.FileType.Directory:
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(directory, recursive=False))
        return sorted(i.base_name[:-5] for i in infos if i.base_name.endswith(".json"))

    # ---- arrays and features -----------------------------------------------------------------------------------
    def read_array(self, stage_key: str, name: str, manifest: dict | None = None) -> np.ndarray:
        return decode_array(self.read_blob(stage_key, name, manifest))

    def _display(self, path: str) -> str:
        return path if self.is_local else str(cio.S3Uri.from_path(path))


def feature_blobs(features: np.ndarray, labels: np.ndarray, coarse_labels: np.ndarray | None = None,
                  dtype: str = "float16", shard_rows: int = 65536,
                  prefix: str = "features") -> tuple[dict[str, bytes], FeatureLayout]:
    """Encode features ``(N, D)`` as .npy shards ``<prefix>-NNNNN.npy`` of ``dtype`` plus labels; returns (blobs,
    layout for the record)."""
    features = np.asarray(features)
    if features.ndim != 2:
        raise ValueError(f"features must be (N, D), got shape {features.shape}")
    if labels.shape != (features.shape[0],):
        raise ValueError(f"labels must be ({features.shape[0]},), got {labels.shape}")
    blobs: dict[str, bytes] = {}
    shards = []
    for index, start in enumerate(range(0, max(features.shape[0], 1), shard_rows)):
        name = f"{prefix}-{index:05d}.npy"
        blobs[name] = encode_array(features[start:start + shard_rows].astype(dtype))
        shards.append(name)
    blobs["labels.npy"] = encode_array(np.asarray(labels, dtype=np.int64))
    if coarse_labels is not None:
        blobs["coarse_labels.npy"] = encode_array(np.asarray(coarse_labels, dtype=np.int64))
    layout = FeatureLayout(shards, int(features.shape[0]), int(features.shape[1]), dtype,
                           has_coarse=coarse_labels is not None)
    return blobs, layout


def _check_key(stage_key: str) -> None:
    if not stage_key or "/" in stage_key or stage_key.startswith("."):
        raise ValueError(f"stage key {stage_key!r}: expected a non-empty name without '/'")


def _check_blob_name(name: str) -> None:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"blob name {name!r}: expected a file name without '/' that does not start with '.'")
