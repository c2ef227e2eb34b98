"""Shared by the search-service tests: randomly initialised models registered on the real MLflow server, the tiny
scenario's config, and an HTTP client for the service on loopback."""
from __future__ import annotations

import base64
import io
import json
import select
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402


def register_random_model(client, name: str, seed: int, folder: Path, rotation_seed: int | None = None,
                          num_slots: int = 10) -> str:
    """A randomly initialised cnn4 (width 4, num_slots - 1 = 9-d features) registered as a new version of ``name``;
    its version.
    rotation_seed: the junction is left-multiplied by a random orthogonal matrix, so the features are exactly those
    of ``seed``'s model rotated (an old-model-compatible space only through that rotation)."""
    import torch

    from cluster.model_registry.versions import ensure_registered_model, register_version, write_model_folder
    from cluster.tracking.client import ensure_experiment
    from compat_core.models.compat_model import create_model, model_to_bytes
    from pipelines.store.run_store import sha256_bytes

    torch.manual_seed(seed)
    model = create_model("cnn4", num_slots=num_slots, backbone_config={"in_chans": 1, "width": 4}).eval()
    if rotation_seed is not None:
        rng = np.random.default_rng(rotation_seed)
        rotation = torch.from_numpy(np.linalg.qr(rng.standard_normal((9, 9)))[0]).float()
        with torch.no_grad():
            model.junction.weight.copy_(rotation @ model.junction.weight)
    blobs = model_to_bytes(model)
    target = write_model_folder(folder / f"model-{seed}-{rotation_seed}-{num_slots}", blobs["config.json"], blobs["model.safetensors"])
    run = client.create_run(ensure_experiment(client, "serve-test-models"))
    client.log_artifacts(run.info.run_id, str(target), "model")
    client.set_terminated(run.info.run_id)
    ensure_registered_model(client, name)
    version = register_version(client, name, run.info.run_id, f"random-seed-{seed}-{rotation_seed}",
                               {"sha256": sha256_bytes(blobs["model.safetensors"])}, [])
    return str(version.version)


def write_config(folder: Path) -> Path:
    """The tiny scenario (16x16 grey synthetic images; 30 query and 30 gallery images of 3 classes), fp32."""
    tiny.register()
    document = tiny.scenario("er")
    document["evaluation"]["feature_dtype"] = "float32"
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def png_base64(image: np.ndarray) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def call(url: str, path: str, body=None, method: str | None = None, raw: bytes | None = None,
         content_type: str = "application/json", timeout: float = 30.0) -> tuple[int, object]:
    """(status, JSON document or text) of one request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"))
    if data is not None and content_type:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def brute_rows(query, gallery, k: int) -> list[int]:
    """The fp64 brute-force top-k gallery rows of one query by cosine similarity, ties to the lowest row."""
    g = np.asarray(gallery, dtype=np.float32).astype(np.float64)
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    q = np.asarray(query, dtype=np.float32).astype(np.float64)
    scores = g @ (q / np.linalg.norm(q))
    return np.lexsort((np.arange(g.shape[0]), -scores))[:k].tolist()


def send_chunked(url: str, path: str, chunk: bytes, chunks: int) -> tuple[int, int, dict]:
    """POST ``chunks`` x ``chunk`` with Transfer-Encoding: chunked, stopping as soon as the server answers (or stops
    reading for 10 s, or closes); (bytes of body sent, status, JSON answer)."""
    host, port = url.split("://")[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Transfer-Encoding: chunked\r\n\r\n".encode())
    sent, framed = 0, f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sock.settimeout(10)
    try:
        for _ in range(chunks):
            if select.select([sock], [], [], 0)[0]:
                break   # the answer came: stop sending
            sock.sendall(framed)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError, socket.timeout):
        pass
    sock.settimeout(60)
    status, answer = read_json_answer(sock)
    sock.close()
    return sent, status, answer


def read_json_answer(sock: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of the HTTP answer read from ``sock`` (its Content-Length bytes)."""
    reader = sock.makefile("rb")
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline().strip()):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, json.loads(reader.read(int(headers["content-length"])))


def refused_before_the_body(url: str, declared: int) -> tuple[int, dict]:
    """Headers of a POST declaring ``declared`` body bytes, and no body: the answer (status, JSON)."""
    port = int(url.rpartition(":")[2])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {declared}\r\n\r\n".encode())
        return read_json_answer(sock)


class Load:
    """Clients sending image queries in a loop from threads; every answer kept with its query and send time."""

    def __init__(self, url: str, images: np.ndarray, clients: int = 3, retries: int = 0) -> None:
        self.url, self.images, self.retries = url, images, retries
        self.answers: list[tuple[float, int, int, object, float]] = []   # (sent, query row, status, doc, seconds)
        self.stop = threading.Event()
        self.encoded = [png_base64(image) for image in images]
        self.threads = [threading.Thread(target=self._loop, args=(seed,), daemon=True) for seed in range(clients)]

    def _loop(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not self.stop.is_set():
            row = int(rng.integers(len(self.images)))
            sent = time.monotonic()
            for attempt in range(self.retries + 1):
                try:
                    status, doc = call(self.url, "/search", {"image": self.encoded[row], "k": 3}, timeout=30)
                except OSError as error:   # connection reset by a killed replica: a clean failure
                    status, doc = 599, str(error)
                if status == 200 or attempt == self.retries:
                    break
            self.answers.append((sent, row, status, doc, time.monotonic() - sent))

    def __enter__(self) -> "Load":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
