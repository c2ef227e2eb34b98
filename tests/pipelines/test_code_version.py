"""pipelines.graph.code_version: the digest over (relative name, bytes) pairs, and which folders it covers."""
from __future__ import annotations

import hashlib
import re

from compat_core import __version__
from pipelines.graph.code_version import code_version, digest_sources, source_files


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
    for prefix in ("pipelines/reports/", "pipelines/engine/", "pipelines/graph/", "pipelines/config/", "cluster/",
                   "app/"):
        assert not any(name.startswith(prefix) for name in names), prefix


def test_code_version_is_the_package_version_and_16_hex():
    assert re.fullmatch(re.escape(__version__) + r"\+[0-9a-f]{16}", code_version())
    assert code_version().endswith(digest_sources(source_files())[:16])
