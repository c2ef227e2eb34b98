"""`compat tune --resume` unpickles Ray Tune's experiment state, so it refuses any folder that `compat tune` did
not create (no marker) or whose search.json was changed since (sha256 in the marker), before Ray starts."""
from __future__ import annotations

import hashlib
import hmac
import json
import pickle
from pathlib import Path

import pytest

from cluster.tune import runner as tune_module
from cluster.tune import marker as marker_module
from cluster.tune import spec as tune_spec
from cluster.tune.grid import spread_points
from compat_core import io as cio


def test_resume_refuses_foreign_and_modified_folders(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "search.json").write_text("{}")
    with pytest.raises(PermissionError, match="only a folder created by `compat tune` can be resumed"):
        tune_module.resume_search(str(foreign))

    spec = tune_spec.SearchSpec(name="s", base_config={}, space={}, storage=str(tmp_path))
    tune_spec.write_spec(spec)
    tune_spec.check_marker(spec.experiment_path)  # written by compat tune: accepted
    marker = json.loads((tmp_path / "s" / tune_spec.MARKER_FILE).read_text())
    key = (tmp_path / "compat-home" / "tune-resume.key").read_bytes()
    assert len(key) == 32 and (tmp_path / "compat-home" / "tune-resume.key").stat().st_mode & 0o777 == 0o600
    search = (tmp_path / "s" / "search.json").read_bytes()
    assert marker["search"] == hmac.new(key, search, hashlib.sha256).hexdigest()
    (tmp_path / "s" / "search.json").write_text(spec.to_json().replace('"samples": 8', '"samples": 9'))
    with pytest.raises(PermissionError, match="search.json does not match its hmac-sha256 in compat-tune.json"):
        tune_module.resume_search(str(tmp_path / "s"))


def test_resume_never_imports_plugins_named_by_the_folder(tmp_path, capsys):
    """A folder whose search.json (and a re-forged marker) names a plugin: --resume without that --plugin is refused
    and the plugin's code never runs; the plugins of the command line are the ones trials import."""
    from app.cli import main

    ran = tmp_path / "plugin-ran"
    plugin = tmp_path / "evil.py"
    plugin.write_text(f"open({str(ran)!r}, 'w').write('imported')\n")
    spec = tune_spec.SearchSpec(name="s", base_config={}, space={}, storage=str(tmp_path), plugins=[str(plugin)])
    tune_spec.write_spec(spec)
    folder = tmp_path / "s"
    marker = json.loads((folder / tune_spec.MARKER_FILE).read_text())  # re-forged by this user, who has the key
    marker["search"] = marker_module.file_digest((folder / "search.json").read_bytes())
    (folder / tune_spec.MARKER_FILE).write_text(json.dumps(marker))
    assert main(["tune", "--resume", str(folder)]) == 2
    assert f"the search was started with --plugin {plugin}" in capsys.readouterr().err
    assert not ran.exists()
    folder.chmod(0o777)  # a folder another user can write is not resumed at all
    with pytest.raises(PermissionError, match="writable by another user"):
        tune_module.resume_search(str(folder), plugins=[str(plugin)])
    assert not ran.exists()


class _Planted:
    """Unpickling it writes a file: the proof that a planted pickle ran."""

    def __init__(self, proof: str) -> None:
        self.proof = proof

    def __reduce__(self):
        return (Path(self.proof).write_text, ("unpickled",))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_tuner_pkl_planted_or_changed_after_the_marker_is_refused_before_any_unpickle(where, tmp_path, request):
    """tuner.pkl is pinned (keyed digest) once Tune wrote it; one planted in a folder whose marker pins none, or one
    changed after it was pinned, is refused before Ray starts, in a local folder and in a bucket of the real S3
    server, where no ownership check applies."""
    proof = tmp_path / "planted-pickle-ran"
    if where == "s3":
        request.getfixturevalue("fresh_object_storage")
        bucket = request.getfixturevalue("s3_bucket")
        from cluster.storage.s3 import configure_object_storage

        configure_object_storage()
        storage = f"s3://{bucket}/searches"
    else:
        storage = str(tmp_path / "searches")
    spec = tune_spec.SearchSpec(name="s", base_config={}, space={}, storage=storage)
    tune_spec.write_spec(spec)
    tuner = cio.join(spec.experiment_path, "tuner.pkl")
    cio.write_bytes(tuner, pickle.dumps(_Planted(str(proof))))   # planted: the marker pins no tuner.pkl
    with pytest.raises(PermissionError, match=r"tuner.pkl does not match its hmac-sha256 in compat-tune.json .* "
                                              r"nothing in the folder is unpickled"):
        tune_module.resume_search(spec.experiment_path)
    cio.write_bytes(tuner, pickle.dumps({"state": "as Tune wrote it"}))
    tune_spec.seal_tuner_state(spec.experiment_path)
    tune_spec.check_marker(spec.experiment_path)  # pinned: accepted
    cio.write_bytes(tuner, pickle.dumps(_Planted(str(proof))))   # changed after the marker
    with pytest.raises(PermissionError, match="tuner.pkl does not match"):
        tune_module.resume_search(spec.experiment_path)
    assert not proof.exists()


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_shipped_demo_space_task_count_and_sampler_never_repeat():
    """With configs/spaces/demo.yaml the trials have the 3 tasks of its fixed tasks.spec (not the base config's),
    so finished trials count as FINISHED; its all-categorical grid is enumerated without repeats."""
    import yaml
    from ray.tune.search.optuna import OptunaSearch

    from cluster.tune.search_space import parse_space
    from pipelines.config.load import config_to_dict, load_config

    base = config_to_dict(load_config(CONFIGS / "demo-dsimplex-hoc.yaml"))
    space_document = yaml.safe_load((CONFIGS / "spaces" / "demo.yaml").read_text())
    spec = tune_spec.SearchSpec(name="demo", base_config=base, space=space_document, storage="/tmp/unused")
    assert base["tasks"]["spec"] != "10+2x15" and spec.num_tasks == 3
    space = parse_space(space_document)
    searcher = OptunaSearch(space=space, metric="objective", mode="max", sampler=tune_module.make_sampler(space, 0))
    drawn = []
    for index in range(8):
        config = searcher.suggest(f"trial-{index}")
        drawn.append((config["method.params.lam"], config["method.params.rho"]))
        searcher.on_trial_complete(f"trial-{index}", {"objective": float(index)})
    assert len(set(drawn)) == 8

    # a budget of 4 of the 36 points: the searcher draws the spread-out design, four different lambdas and rhos
    searcher = tune_module.optuna_searcher(space, 4, 0)
    drawn = []
    for index in range(4):
        config = searcher.suggest(f"small-{index}")
        drawn.append({key: config[key] for key in ("method.params.lam", "method.params.rho")})
        searcher.on_trial_complete(f"small-{index}", {tune_spec.OBJECTIVE_KEY: float(index)})
    assert drawn == spread_points(space, 4, 0)
    assert len({point["method.params.lam"] for point in drawn}) == 4


def test_unreachable_addresses_fail_fast_with_a_clear_message():
    import socket

    from cluster.ray.jobs import job_client

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ConnectionError, match=f"cannot reach the Ray job server at 127.0.0.1:{port}"):
        job_client(f"http://127.0.0.1:{port}")
    # connect() in a fresh interpreter: this one may already hold the session's local Ray
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", f"from cluster.ray.task_backend import connect; connect('127.0.0.1:{port}')"],
                          env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"ConnectionError: cannot reach the Ray cluster at 127.0.0.1:{port}" in done.stderr
    assert "check --address" in done.stderr
