"""The embedded Ray start's error path (ray.init stood in for, as for any unit test of an error path): a raylet that
misses Ray's fixed 30 s registration window on a loaded machine is started again, up to 3 attempts, each retry said;
any other error, and the third timeout, end the start at once."""
from __future__ import annotations

import pytest
import ray

from cluster.ray.embedded import EMBEDDED_START_ATTEMPTS, start_embedded

TIMEOUT = "The current node timed out during startup. This could happen because some of the raylet failed to startup"


def _failing(errors: list[Exception], calls: list[dict]):
    def init(**options):
        calls.append(options)
        if errors:
            raise errors.pop(0)
    return init


def test_a_start_that_times_out_is_tried_again_and_said(monkeypatch, capsys):
    calls: list[dict] = []
    monkeypatch.setattr(ray, "init", _failing([Exception(TIMEOUT), Exception(TIMEOUT)], calls))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    start_embedded(object_store_memory=123)
    assert len(calls) == 3 and all(call["address"] == "local" and call["_node_ip_address"] == "127.0.0.1"
                                   and call["object_store_memory"] == 123 for call in calls)
    err = capsys.readouterr().err
    assert err.count("timed out during startup (attempt") == 2 and "(attempt 2 of 3)" in err


def test_the_third_timeout_and_other_errors_end_the_start(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(ray, "init", _failing([Exception(TIMEOUT)] * EMBEDDED_START_ATTEMPTS, calls))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(Exception, match="timed out during startup"):
        start_embedded()
    assert len(calls) == EMBEDDED_START_ATTEMPTS
    calls.clear()
    monkeypatch.setattr(ray, "init", _failing([ValueError("object_store_memory: too small")], calls))
    with pytest.raises(ValueError, match="too small"):
        start_embedded()
    assert len(calls) == 1
