"""pipelines.graph.source_digests: what a stage key hashes for a weights file (its sha256, recomputed when the file
changes), and how stage params carry it."""
from __future__ import annotations

import hashlib
import os

from pipelines.graph.source_digests import DIGEST_FIELD, file_digest, hashed_source


def test_file_digest_is_the_sha256_and_follows_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"first")
    assert file_digest(str(path)) == hashlib.sha256(b"first").hexdigest()
    path.write_bytes(b"second, longer")  # another size: the cached digest is not reused
    os.utime(path, ns=(1, 1))
    assert file_digest(str(path)) == hashlib.sha256(b"second, longer").hexdigest()


def test_a_folder_resolves_to_its_weights_file_and_a_missing_file_has_no_digest(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    assert file_digest(str(folder)) == hashlib.sha256(b"weights").hexdigest()
    assert file_digest(str(tmp_path / "absent.pt")) is None


def test_hashed_source_prefers_the_pinned_digest(tmp_path):
    path = tmp_path / "w.pt"
    path.write_bytes(b"abc")
    assert hashed_source(str(path)) == {DIGEST_FIELD: hashlib.sha256(b"abc").hexdigest()}
    assert hashed_source(str(path), "AB" * 32) == {DIGEST_FIELD: "ab" * 32}  # lower case, not the file's
    assert hashed_source(str(tmp_path / "gone.pt")) == {"path": str(tmp_path / "gone.pt"), "unreadable": True}
