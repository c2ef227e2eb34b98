"""The code identity of a stage: a digest of every source file that can change what a stage produces.

What computes is a set of packages, hashed whole (by folder, never by a hand-kept list of files): ``compat_core``
(losses, d-Simplex, retrieval, data readers, models), and the parts of ``pipelines`` that stages run
(``stages``, ``training``, ``methods``, ``records``). Presentation, scheduling and tracking code (``reports``,
``results``, ``engine``, ``graph``, ``config``, ``cluster``, ``app``) is outside these folders, so editing a report
never changes a stage key, and anything added inside them always does.

Each package is located through the import system, not relative to this file, so a local run from a checkout, a Ray
Job (whose packages travel as separate ``py_modules``), a Tune trial and an installed wheel of the same sources hash
the same files under the same relative names, and get the same code version.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

from compat_core import __version__

# packages whose sources decide what a stage computes (dotted names; each hashed with all of its sub-packages)
COMPUTE_PACKAGES = ("compat_core", "pipelines.stages", "pipelines.training", "pipelines.methods", "pipelines.records")


def package_folder(dotted: str) -> Path:
    """The folder the import system loads ``dotted`` from (ModuleNotFoundError naming it when absent)."""
    spec = importlib.util.find_spec(dotted)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"code version: package {dotted!r} is not importable here; the stage key needs "
                                  f"its sources")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def source_files() -> list[tuple[str, Path]]:
    """(relative name ``pkg/sub/module.py``, path) of every hashed source file, in hashing order."""
    files = []
    for dotted in COMPUTE_PACKAGES:
        folder = package_folder(dotted)
        prefix = dotted.replace(".", "/")
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            files.append((f"{prefix}/{path.relative_to(folder).as_posix()}", path))
    return sorted(files)


def digest_sources(files: list[tuple[str, Path]]) -> str:
    """sha256 (hex) over each file's relative name and bytes, in the given order."""
    digest = hashlib.sha256()
    for relative, path in files:
        digest.update(relative.encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """``<package version>+<16 hex>``: the version in ``compat_core.__version__`` and the digest of the compute
    sources; the same for every executor that imports the same sources."""
    return f"{__version__}+{digest_sources(source_files())[:16]}"
