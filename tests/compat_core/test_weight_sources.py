"""compat_core.models.weight_sources: URI scheme resolvers, the file a source names and its sha256, without torch."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compat_core.models.weight_sources import (
    register_uri_resolver,
    resolve_weights_source,
    sha256_of,
)


def test_a_folder_resolves_to_its_first_weights_file(tmp_path):
    (tmp_path / "b.safetensors").write_bytes(b"b")
    (tmp_path / "model.pt").write_bytes(b"pt")
    assert resolve_weights_source(str(tmp_path)) == str(tmp_path / "model.pt")  # model.pt before other *.safetensors
    (tmp_path / "model.safetensors").write_bytes(b"st")
    assert resolve_weights_source(str(tmp_path)) == str(tmp_path / "model.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no weights file"):
        resolve_weights_source(str(empty))


def test_a_registered_scheme_resolves_and_an_unknown_one_is_named(tmp_path):
    from compat_core.models import weight_sources

    target = tmp_path / "w.safetensors"
    target.write_bytes(b"weights")
    with pytest.MonkeyPatch.context() as patch:  # the resolvers as they are now, restored at the end of the block
        patch.setattr(weight_sources, "_URI_RESOLVERS", dict(weight_sources._URI_RESOLVERS))
        register_uri_resolver("toyreg", lambda uri: str(target))
        assert resolve_weights_source("toyreg:/m/1") == str(target)
        assert sha256_of(str(target)) == hashlib.sha256(b"weights").hexdigest()
    with pytest.raises(ValueError, match="no resolver for URI scheme 'toyreg'"):
        resolve_weights_source("toyreg:/m/1")
    with pytest.raises(ValueError, match="scheme 's3' is handled by compat_core.io"):
        register_uri_resolver("s3", str)
    with pytest.raises(FileNotFoundError, match="weights source not found"):
        resolve_weights_source(str(tmp_path / "absent.pt"))


def test_the_module_imports_no_torch():
    probe = ("import json, sys; import compat_core.models.weight_sources, compat_core.slots; "
             "print(json.dumps('torch' in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout) is False
