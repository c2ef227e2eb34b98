"""Content identity of the weights files a scenario names (``pretrain[*].init``, ``replacements[*].source``,
``initial_model``): stage keys hash a file's sha256, never its path, so overwriting the file at the same path gives
new keys, and the same bytes at another path give the same keys.

The digest of each file is computed once per process (cached by resolved location, size and modification time for
local files; by URI for object-store and registry sources, which are immutable once pinned) and travels in the
stage's inputs (``pipelines.stages.inputs.WeightsFile``), so the stage that loads the file refuses other bytes
(``load_external_weights(sha256=...)``).
"""
from __future__ import annotations

import os
from typing import Any

from compat_core import io as cio
from compat_core.models.weight_sources import resolve_weights_source, sha256_of
from pipelines.config.schema import PRETRAIN_PREFIX

DIGEST_FIELD = "file_sha256"
_CACHE: dict[tuple, str] = {}


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


__all__ = ["DIGEST_FIELD", "file_digest", "hashed_source"]
