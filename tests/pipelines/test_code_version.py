"""pipelines.graph.code_version: the digest over (relative name, bytes) pairs, and which folders it covers."""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import re

from compat_core import __version__
from pipelines.graph.code_version import (
    COMPUTE_MODULES,
    COMPUTE_PACKAGES,
    OUTSIDE_THE_KEY,
    code_version,
    digest_sources,
    source_files,
)


def test_digest_is_sha256_over_names_and_bytes_in_order(tmp_path):
    (tmp_path / "a.py").write_bytes(b"x = 1\n")
    (tmp_path / "b.py").write_bytes(b"y = 2\n")
    files = [("pkg/a.py", tmp_path / "a.py"), ("pkg/b.py", tmp_path / "b.py")]
    expected = hashlib.sha256(b"pkg/a.py\0x = 1\n\0pkg/b.py\0y = 2\n\0").hexdigest()
    assert digest_sources(files) == expected
    # a renamed file or one changed byte gives another digest
    assert digest_sources([("pkg/c.py", tmp_path / "a.py"), files[1]]) != expected
    (tmp_path / "b.py").write_bytes(b"y = 3\n")
    assert digest_sources(files) != expected


def test_compute_folders_are_hashed_and_presentation_is_not():
    names = [name for name, _ in source_files()]
    assert names == sorted(names)
    for hashed in ("compat_core/slots.py", "pipelines/methods/cards/er.py", "pipelines/methods/er.py",
                   "pipelines/stages/feature_way.py", "pipelines/training/task_data.py",
                   "pipelines/records/stage_records.py"):
        assert hashed in names, hashed
    for prefix in ("pipelines/reports/", "pipelines/engine/", "pipelines/results/", "cluster/", "app/"):
        assert not any(name.startswith(prefix) for name in names), prefix
    for presentation in ("pipelines/graph/compile.py", "pipelines/graph/plan_cost.py", "pipelines/config/load.py",
                         "pipelines/config/preflight.py", "pipelines/store/shared_store.py"):
        assert presentation not in names, presentation


def test_code_version_is_the_package_version_and_16_hex():
    assert re.fullmatch(re.escape(__version__) + r"\+[0-9a-f]{16}", code_version())
    assert code_version().endswith(digest_sources(source_files())[:16])


def _project_imports(path) -> set[str]:
    """Project modules (compat_core, pipelines, cluster, app) a source file imports, anywhere in it."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names
                           if importlib.util.find_spec(node.module) and _is_module(f"{node.module}.{alias.name}"))
    return {name for name in modules if name.split(".")[0] in ("compat_core", "pipelines", "cluster", "app")}


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:
        return False


def _hashed(dotted: str) -> bool:
    return dotted in COMPUTE_MODULES or any(dotted == package or dotted.startswith(package + ".")
                                            for package in COMPUTE_PACKAGES)


def test_every_module_the_hashed_code_imports_is_hashed_or_declared_outside_the_key():
    names = [name for name, _ in source_files()]
    for dotted in COMPUTE_MODULES:
        assert f"{dotted.replace('.', '/')}.py" in names, dotted
    unhashed = set()
    for _, path in source_files():
        unhashed |= {dotted for dotted in _project_imports(path) if not _hashed(dotted)}
    # a new import from outside the hashed code either joins COMPUTE_MODULES or says why it changes no output
    assert unhashed == set(OUTSIDE_THE_KEY)


def test_stage_code_outside_the_packages_changes_the_digest(tmp_path):
    """The modules stages execute beyond the compute packages are hashed: the digest over a copy of the hashed files
    differs once the run store's blob encoding differs by one byte."""
    files = source_files()
    copies = []
    for relative, path in files:
        copy = tmp_path / relative
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(path.read_bytes())
        copies.append((relative, copy))
    assert digest_sources(copies) == digest_sources(files)  # names are package-relative, never where files lie
    store = tmp_path / "pipelines/store/run_store.py"
    store.write_bytes(store.read_bytes() + b"\n")
    assert digest_sources(copies) != digest_sources(files)
