"""`compat tune --resume` unpickles Ray Tune's experiment state, so it refuses any folder that `compat tune` did
not create (no marker) or whose search.json was changed since (sha256 in the marker), before Ray starts."""
from __future__ import annotations

import json

import pytest

from cluster import tune as tune_module


def test_resume_refuses_foreign_and_modified_folders(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "search.json").write_text("{}")
    with pytest.raises(PermissionError, match="only a folder created by `compat tune` can be resumed"):
        tune_module.resume_search(str(foreign))

    spec = tune_module.SearchSpec(name="s", base_config={}, space={}, storage=str(tmp_path))
    tune_module.write_spec(spec)
    tune_module.check_marker(spec.experiment_path)  # written by compat tune: accepted
    marker = json.loads((tmp_path / "s" / tune_module.MARKER_FILE).read_text())
    import hashlib

    assert marker["search_sha256"] == hashlib.sha256((tmp_path / "s" / "search.json").read_bytes()).hexdigest()
    (tmp_path / "s" / "search.json").write_text(spec.to_json().replace('"samples": 8', '"samples": 9'))
    with pytest.raises(PermissionError, match="does not match compat-tune.json"):
        tune_module.resume_search(str(tmp_path / "s"))
