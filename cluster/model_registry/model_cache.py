"""What a registered model version's files must be, and the private folder they are downloaded into.

Content tags of a version (set when it is registered): ``files_sha256``, a JSON object ``{file name: sha256}`` of
every file the version's loaders read (``config.json`` and ``model.safetensors``; the adapter file of an adapter
version), and ``content_sha256``, the sha256 of the sorted ``[name, sha256]`` pairs (one number to compare). Older
versions carry only ``sha256`` (of the weights): their weights are verified and their ``config.json`` is read with a
warning that it is not covered. A file that differs from its tag raises ``IntegrityError`` naming the file.

The download cache is one folder per user: ``$COMPAT_MODEL_CACHE``, else ``$XDG_CACHE_HOME/compat/mlflow-models``
(``~/.cache/compat/mlflow-models``), created mode 0700 and refused when another user owns it or others may write
to it (a shared, predictable folder would let another account plant the files a model is built from). Cached files
are verified against the version's tags before every reuse and downloaded again when they differ.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from pathlib import Path
from typing import Mapping

from compat_core.integrity import IntegrityError

log = logging.getLogger(__name__)

FILES_TAG = "files_sha256"
CONTENT_TAG = "content_sha256"
WEIGHTS_ONLY_TAG = "sha256"  # older versions: model.safetensors only
CACHE_ENV = "COMPAT_MODEL_CACHE"


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 hex of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def content_digest(files: Mapping[str, str]) -> str:
    """sha256 of the sorted (file name, sha256) pairs: one digest over every file of a version."""
    pairs = sorted([str(name), str(sha)] for name, sha in files.items())
    return hashlib.sha256(json.dumps(pairs, separators=(",", ":")).encode("utf-8")).hexdigest()


def content_tags(files: Mapping[str, str]) -> dict[str, str]:
    """The version tags of ``files`` ({name: sha256}): ``files_sha256`` and ``content_sha256``."""
    return {FILES_TAG: json.dumps(dict(sorted(files.items())), separators=(",", ":")),
            CONTENT_TAG: content_digest(files)}


def expected_files(tags: Mapping[str, str], what: str) -> dict[str, str] | None:
    """{file name: sha256} a version's tags promise (``what`` names the version in errors); None when they promise
    nothing. IntegrityError when ``files_sha256`` does not hash to ``content_sha256`` (a tag was edited)."""
    text = tags.get(FILES_TAG)
    if text:
        try:
            files = {str(name): str(sha) for name, sha in json.loads(text).items()}
        except (json.JSONDecodeError, AttributeError):
            raise IntegrityError(f"{what}: tag {FILES_TAG} is not a JSON object of file name -> sha256: "
                                 f"{text[:200]!r}", field=FILES_TAG) from None
        actual = content_digest(files)
        if tags.get(CONTENT_TAG) != actual:
            raise IntegrityError(f"{what}: tag {CONTENT_TAG} expected {tags.get(CONTENT_TAG)}, actual {actual} "
                                 f"(the digest of tag {FILES_TAG}); the version's tags were changed after it was "
                                 f"registered", field=CONTENT_TAG, expected=tags.get(CONTENT_TAG), actual=actual)
        return files
    if tags.get(WEIGHTS_ONLY_TAG):
        return {"model.safetensors": str(tags[WEIGHTS_ONLY_TAG])}
    return None


def first_mismatch(folder: str | os.PathLike, expected: Mapping[str, str]) -> tuple[str, str, str] | None:
    """(file name, expected sha256, actual sha256 or 'missing') of the first file of ``folder`` that differs from
    ``expected``, in name order; None when all match."""
    for name in sorted(expected):
        path = Path(folder, name)
        actual = file_sha256(path) if path.is_file() else "missing"
        if actual != expected[name]:
            return name, expected[name], actual
    return None


def mismatch_error(what: str, folder: str | os.PathLike, mismatch: tuple[str, str, str]) -> IntegrityError:
    """The IntegrityError of a registered file that differs from its version's tag, naming the file."""
    name, expected, actual = mismatch
    return IntegrityError.mismatch(
        f"{what}: registered file {name}", Path(folder, name), "sha256", expected, actual,
        detail="the registry's copy differs from the digest recorded when the version was registered; "
               "do not use this version (register the model again from its run folder)")


def default_cache_dir() -> Path:
    """``$COMPAT_MODEL_CACHE``, else ``$XDG_CACHE_HOME/compat/mlflow-models`` (``~/.cache/...``)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "compat" / "mlflow-models"


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` as a folder only this user can write: created mode 0700 when missing; PermissionError naming it
    when it is a link, owned by another user, or writable by group or others."""
    folder = Path(path)
    if not folder.exists():
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)  # mkdir's mode is reduced by the umask, never widened; say it exactly
    info = folder.lstat()
    problem = None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "is not a plain folder (a link or a file)"
    elif info.st_uid != os.getuid():
        problem = f"is owned by uid {info.st_uid}, not this user (uid {os.getuid()})"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by {'group and others' if info.st_mode & stat.S_IWOTH else 'its group'} " \
                  f"(mode {stat.S_IMODE(info.st_mode):04o})"
    if problem:
        raise PermissionError(f"model cache {folder} {problem}: another account could plant the files a model is "
                              f"built from; use a folder of your own (remove it, or chmod 700 it if it is yours, or "
                              f"set {CACHE_ENV})")
    return folder


__all__ = ["CACHE_ENV", "CONTENT_TAG", "FILES_TAG", "WEIGHTS_ONLY_TAG", "content_digest", "content_tags",
           "default_cache_dir", "expected_files", "file_sha256", "first_mismatch", "mismatch_error", "private_dir"]
