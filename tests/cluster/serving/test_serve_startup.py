"""A replica answers at once while its first load waits on the registry (real Serve over HTTP on 127.0.0.1, a real
MLflow server behind a relay that holds every connection until the test releases it): /healthz says "loading", a
search waits for the load and is then answered by the loaded version."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import serving_helpers as helpers
from local_services import free_port

from app.cli import main

pytestmark = pytest.mark.integration
NAME = "serve-startup-test"


class HeldRelay:
    """A TCP relay on 127.0.0.1 to ``target`` that accepts connections but forwards nothing until ``release()``:
    a registry that is reachable yet does not answer (as a slow or overloaded server)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.released = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.held = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            self.held += 0 if self.released.is_set() else 1
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        self.released.wait()
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.release()
        self.server.close()


def test_first_load_runs_in_the_background_and_a_search_waits_for_it(mlflow_server, ray_local, tmp_path):
    from mlflow import MlflowClient
    from ray import serve

    from cluster.serving.app import start
    from cluster.serving.index_store import load_index

    client = MlflowClient(mlflow_server.tracking_uri)
    version = helpers.register_random_model(client, NAME, 3, tmp_path)
    client.set_registered_model_alias(NAME, "champion", version)
    config = helpers.write_config(tmp_path)
    root = str(tmp_path / "index")
    assert main(["index", "build", root, "--config", str(config), "--model", f"models:/{NAME}@champion",
                 "--tracking-uri", mlflow_server.tracking_uri]) == 0
    relay = HeldRelay(mlflow_server.port)
    settings = {"index": root, "model": f"models:/{NAME}@champion", "tracking_uri": relay.uri, "poll_s": 0.3,
                "cache_dir": str(tmp_path / "cache"), "first_load_wait_s": 120.0}
    try:
        url = start(settings, "127.0.0.1", free_port(), app_name="startup", num_replicas=1, num_cpus=0)
        # start() returned: the replica is up although its registry has not answered a single request
        status, health = helpers.call(url, "/healthz")
        assert (status, health) == (503, {"status": "loading", "error": None})
        deadline = time.monotonic() + 60  # the watcher thread may not have reached the registry yet: it will
        while relay.held < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert relay.held >= 1 and not relay.released.is_set()
        status, health = helpers.call(url, "/healthz")  # still loading while the registry holds its answer
        assert (status, health) == (503, {"status": "loading", "error": None})
        answers = []
        index = load_index(root)
        query = index.embeddings[4].tolist()
        searching = threading.Thread(
            target=lambda: answers.append(helpers.call(url, "/search", {"embedding": query, "k": 1}, timeout=120)))
        searching.start()
        time.sleep(1.0)
        assert not answers, "the search must wait for the first load, not fail"
        relay.release()
        searching.join(120)
        status, answer = answers[0]
        assert status == 200, answer
        assert answer["model_version"] == version and answer["results"][0]["position"] == 4
        status, health = helpers.call(url, "/healthz")
        assert status == 200 and health["model_version"] == version and health["items"] == index.size
    finally:
        relay.close()
        serve.shutdown()
