"""`compat tune --resume` unpickles Ray Tune's experiment state, so it refuses any folder that `compat tune` did
not create (no marker) or whose search.json was changed since (sha256 in the marker), before Ray starts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.tune import runner as tune_module
from cluster.tune import spec as tune_spec
from cluster.tune.grid import spread_points


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
    import hashlib

    assert marker["search_sha256"] == hashlib.sha256((tmp_path / "s" / "search.json").read_bytes()).hexdigest()
    (tmp_path / "s" / "search.json").write_text(spec.to_json().replace('"samples": 8', '"samples": 9'))
    with pytest.raises(PermissionError, match="does not match compat-tune.json"):
        tune_module.resume_search(str(tmp_path / "s"))


def test_resume_never_imports_plugins_named_by_the_folder(tmp_path, capsys):
    """A folder whose search.json (and a re-forged marker) names a plugin: --resume without that --plugin is refused
    and the plugin's code never runs; the plugins of the command line are the ones trials import."""
    import hashlib

    from app.cli import main

    ran = tmp_path / "plugin-ran"
    plugin = tmp_path / "evil.py"
    plugin.write_text(f"open({str(ran)!r}, 'w').write('imported')\n")
    spec = tune_spec.SearchSpec(name="s", base_config={}, space={}, storage=str(tmp_path), plugins=[str(plugin)])
    tune_spec.write_spec(spec)
    folder = tmp_path / "s"
    marker = json.loads((folder / tune_spec.MARKER_FILE).read_text())  # anyone can re-compute the digest
    marker["search_sha256"] = hashlib.sha256((folder / "search.json").read_bytes()).hexdigest()
    (folder / tune_spec.MARKER_FILE).write_text(json.dumps(marker))
    assert main(["tune", "--resume", str(folder)]) == 2
    assert f"the search was started with --plugin {plugin}" in capsys.readouterr().err
    assert not ran.exists()
    folder.chmod(0o777)  # a folder another user can write is not resumed at all
    with pytest.raises(PermissionError, match="writable by another user"):
        tune_module.resume_search(str(folder), plugins=[str(plugin)])
    assert not ran.exists()


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
