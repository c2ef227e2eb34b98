"""Which Ray cluster `compat serve` / `compat index backfill` join for the addresses a user is shown."""
import json
from dataclasses import asdict

import pytest

from cluster.ray.local_head import HeadState
from cluster.serving.ray_join import resolve_ray_target


@pytest.fixture
def state_dir(tmp_path):
    head = HeadState(name="local", pid=1, temp_dir="/tmp/compat-ray-x", address="http://127.0.0.1:8265",
                     gcs_address="127.0.0.1:6390", auth="token", log="/tmp/compat-ray-x/compat-head.log")
    (tmp_path / "local.json").write_text(json.dumps(asdict(head)))
    (tmp_path / "notes.json").write_text("[1, 2]")  # not a head state file: skipped
    return tmp_path


def test_job_server_address_resolves_to_the_recorded_heads_gcs(state_dir, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for given in ("http://127.0.0.1:8265", "http://localhost:8265/", "127.0.0.1:6390", "localhost:6390"):
        target = resolve_ray_target(given, state_dir)
        assert (target.address, target.dashboard, target.source) == ("127.0.0.1:6390", "http://127.0.0.1:8265",
                                                                     "--ray-address")
    assert resolve_ray_target("10.0.0.5:6379", state_dir).address == "10.0.0.5:6379"  # not recorded: as given
    assert resolve_ray_target("10.0.0.5:6379", state_dir).dashboard is None
    assert resolve_ray_target(None, state_dir).address is None  # an embedded instance
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    target = resolve_ray_target(None, state_dir)
    assert (target.address, target.source) == ("127.0.0.1:6390", "RAY_ADDRESS")


def test_unknown_job_server_address_says_what_to_give(state_dir, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match=r"--ray-address http://127.0.0.1:9999: a job server address.*GCS address "
                                         r"HOST:PORT"):
        resolve_ray_target("http://127.0.0.1:9999", state_dir)
    monkeypatch.setenv("RAY_ADDRESS", "https://10.0.0.5:8265")
    with pytest.raises(ValueError, match=r"^RAY_ADDRESS https://10.0.0.5:8265: a job server address"):
        resolve_ray_target(None, state_dir)
