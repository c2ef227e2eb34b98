"""The code identity of a stage: a digest of every source file that can change what a stage produces.

What computes is a set of packages, hashed whole (by folder, never by a hand-kept list of files): ``compat_core``
(losses, d-Simplex, retrieval, data readers, models), and the parts of ``pipelines`` that stages run
(``stages``, ``training``, ``methods``, ``records``), plus the few modules of other folders whose code stages
execute (:data:`COMPUTE_MODULES`: the config schema and rules a stage calls, the blob encoding of the run store, the
resolution of stage inputs). Presentation, scheduling and tracking code (``reports``, ``results``, ``engine``, the
rest of ``graph`` and ``config``, ``cluster``, ``app``) is outside, so editing a report never changes a stage key,
and anything added inside the packages always does. Every project module the hashed code imports is either hashed
or listed in :data:`OUTSIDE_THE_KEY` with the reason it cannot change an output (a test checks this).

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
# single modules outside those packages whose code runs inside a stage or decides what a stage reads
COMPUTE_MODULES = (
    "pipelines.config.schema",         # the spec classes stages call (resolved_head, train_config, pools)
    "pipelines.config.validate",       # bridge_obstacle: decides what an extract stage stores
    "pipelines.config.method_params",  # the base of every method's parameters
    "pipelines.graph.build_inputs",    # resolves every input value; stage_threads sets a stage's torch threads
    "pipelines.store.run_store",       # encode_array / feature_blobs: the bytes stages write and read back
)
# project modules the hashed code imports that cannot change what a stage produces, and why
OUTSIDE_THE_KEY = {
    "pipelines.config.load": "stable_hash is the key function itself; HOW_NOT_WHAT names fields left out of inputs",
    "pipelines.config.model_uri": "parses models:/ URIs; the weights they name are hashed by content",
    "pipelines.engine.events": "progress and stage event records",
    "pipelines.engine.process_memory": "returns freed memory to the system",
    "pipelines.graph.compile": "the Stage record and the key derivation (the key holds inputs and parents)",
    "pipelines.graph.stage_kind": "kind names, hashed into every key as values",
    "pipelines.graph.source_digests": "sha256 of weights files and task data, hashed into inputs as values",
    "pipelines.store.lease": "the run folder's single-writer lease",
}


def package_folder(dotted: str) -> Path:
    """The folder the import system loads ``dotted`` from (ModuleNotFoundError naming it when absent)."""
    spec = importlib.util.find_spec(dotted)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"code version: package {dotted!r} is not importable here; the stage key needs "
                                  f"its sources")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def module_file(dotted: str) -> Path:
    """The source file the import system loads module ``dotted`` from (ModuleNotFoundError naming it when absent)."""
    spec = importlib.util.find_spec(dotted)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ModuleNotFoundError(f"code version: module {dotted!r} has no source file here; the stage key needs it")
    return Path(spec.origin).resolve()


def source_files() -> list[tuple[str, Path]]:
    """(package-relative name ``pkg/sub/module.py``, path) of every hashed source file, in hashing order: the names
    never hold where the sources are, so any location of the same sources gives the same digest."""
    files = [(f"{dotted.replace('.', '/')}.py", module_file(dotted)) for dotted in COMPUTE_MODULES]
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
