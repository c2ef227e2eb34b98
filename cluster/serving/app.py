"""The search service as a Ray Serve application (``compat serve``).

HTTP is Serve's own proxy and its Starlette request objects (``__call__(request)``): no other web stack. Routes:
``POST /search`` (see ``compat_core.retrieval.search_request``; the body is read as it arrives and refused past
``max_body_bytes``), ``GET /healthz`` (200 with the served versions, ``"status": "ok"``, or ``"degraded"`` with the
alias's target version and the error while that version cannot be loaded; 503 while no model is loaded),
``GET /metrics`` (Prometheus text of the replica that answered), ``GET /openapi.json`` and ``GET /docs`` (the API
reference for what the replica serves, ``cluster.serving.api_doc``). Every replica keeps its own ports on 127.0.0.1
(``cluster.serving.replica_ports``).

Each replica polls the registry alias (``models:/NAME@ALIAS``) and the index HEAD every ``poll_s`` seconds on a
background thread, which also makes the first load (until it succeeds the replica answers, 503 "loading"); on a
change it loads the new model version (and the adapter the gate installed with it), builds
a complete ``ServingState`` and swaps its reference in one assignment (``cluster.serving.state``). A failed load
keeps the current state (counted in ``compat_model_swap_errors_total``, reported by /healthz) and is retried at the
next poll.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
from ray import serve

from cluster.model_registry.versions import MlflowModelResolver
from cluster.serving.api_doc import docs_html, openapi_document
from cluster.serving.index_store import load_index, read_head, read_manifest
from cluster.serving.models import (
    DEFAULT_ALIAS,
    embed_images,
    installed_adapter,
    load_served_model,
    resolve_model_ref,
)
from cluster.serving.replica_ports import keep_replica_ports_on_loopback
from cluster.serving.state import (
    ReplicaMetrics,
    ServingState,
    as_query_tensor,
    build_state,
    check_model_version,
    check_servable,
    state_summary,
)
from cluster.storage.s3 import configure_object_storage
from compat_core.retrieval.ann import set_faiss_threads
from compat_core.retrieval.mixed_gallery import search_groups
from compat_core.retrieval.search_request import RequestError, SearchLimits, parse_search_request
from compat_core.upgrades.adapters import GALLERY_ADAPTERS
from pipelines.config.model_uri import ModelUri, parse_model_uri

LOG = logging.getLogger("compat.serve")
APP_NAME = "compat-search"
ROUTES = {"/search": "POST", "/healthz": "GET", "/metrics": "GET", "/openapi.json": "GET", "/docs": "GET"}
DEFAULT_SETTINGS = {"poll_s": 2.0, "precision": "auto", "device": "cpu", "threads": 1, "cache_dir": None,
                    "limits": {}, "first_load_wait_s": 20.0}


def _json(document: Any, status: int = 200):
    from starlette.responses import Response

    return Response(json.dumps(document, allow_nan=False), status_code=status, media_type="application/json")


async def read_limited_body(request, limit: int) -> bytes:
    """The request body, read message by message as it arrives; RequestError 413 naming ``body`` once more than
    ``limit`` bytes came in (at once when a declared Content-Length is over it), chunked bodies included: a replica
    holds at most ``limit`` bytes plus one message of a body it refuses."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise RequestError(413, "body", f"{length} bytes is over the limit of {limit} bytes")
    chunks, received = [], 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise RequestError(413, "body", f"over the limit of {limit} bytes (stopped reading after {received} "
                                            f"bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def request_path(request) -> str:
    """The request's path within the application (its route prefix removed, no trailing slash)."""
    path = request.url.path
    prefix = request.scope.get("root_path", "").rstrip("/")   # the application's route prefix, if any
    if prefix and path.startswith(prefix):
        path = path[len(prefix):]
    return path.rstrip("/") or "/"


async def answer_route(route, request, path: str):
    """``await route(request, path)``; a RequestError as its JSON error, anything else as a 500 that says what
    broke (never a traceback to the client)."""
    try:
        return await route(request, path)
    except RequestError as error:
        return _json(error.to_json(), error.status)
    except Exception as error:  # noqa: BLE001 - the 500 below
        LOG.exception("request failed")
        return _json({"error": {"status": 500, "field": None,
                                "message": f"{type(error).__name__}: {error}"[:500]}}, 500)


class SearchService:
    """One replica. settings: index (root URI), model (models:/ URI), tracking_uri, poll_s, precision, device,
    threads (torch intra-op threads), cache_dir, limits (SearchLimits fields), first_load_wait_s (how long a search
    that reaches a replica still making its first load waits for it, seconds). Plain JSON values only."""

    def __init__(self, settings: dict) -> None:
        keep_replica_ports_on_loopback()   # Serve opens the replica's gRPC port right after this constructor
        self.settings = {**DEFAULT_SETTINGS, **settings}
        # model None: an embedding-only service of the index's own model version (no registry, no images)
        for key in ("index",) + (("model", "tracking_uri") if self.settings.get("model") else ()):
            if not self.settings.get(key):
                raise ValueError(f"serve settings: {key!r} is required")
        self.limits = SearchLimits(**self.settings["limits"])
        self.alias = (parse_model_uri(self.settings["model"], "serve settings: 'model'").alias
                      if self.settings.get("model") else None) or DEFAULT_ALIAS
        import torch

        torch.set_num_threads(int(self.settings["threads"]))
        self._state: ServingState | None = None
        self.metrics = ReplicaMetrics(f"{os.getpid()}")
        self.last_error: str | None = None
        self.alias_target: ModelUri | None = None   # the version the alias named at the last check
        self._stop = threading.Event()
        self._resolver = None
        self._prepare_storage()
        # the first load runs on the watcher thread too: the replica answers at once (/healthz "loading", 503)
        # instead of waiting out a slow or unreachable registry's retries in its constructor
        self._watcher = threading.Thread(target=self._watch, name="compat-serve-watch", daemon=True)
        self._watcher.start()

    # ---- model and index ---------------------------------------------------------------------------------------
    def _prepare_storage(self) -> None:
        if str(self.settings["index"]).startswith("s3://"):
            configure_object_storage()

    def _client_and_resolver(self):
        if self._resolver is None:
            self._resolver = MlflowModelResolver(self.settings["tracking_uri"],
                                                 cache_dir=self.settings.get("cache_dir"))
        return self._resolver.client, self._resolver

    def refresh(self) -> bool:
        """Load and swap in a new state when the alias or the index HEAD moved; True when it swapped."""
        if not self.settings.get("model"):
            head = read_head(self.settings["index"])
            if self._state is not None and self._state.index.manifest_sha == head:
                return False
            index = load_index(self.settings["index"], head, lean=True)
            ref = ModelUri(str(index.manifest["model"]["name"]), str(index.manifest["model"]["version"]))
            check_servable(index.manifest, self.settings["index"], ref.uri, None)
            self._use_threads(index)
            self._state = build_state(ref, None, index, None, self.settings["precision"])
            self.metrics.swaps += 1
            return True
        client, resolver = self._client_and_resolver()
        ref = resolve_model_ref(client, self.settings["model"])
        self.alias_target = ref
        head = read_head(self.settings["index"])
        current = self._state
        if current is not None and current.key == (ref.name, ref.version, head):
            return False
        model = current.model if current is not None and current.ref == ref else \
            load_served_model(resolver, ref, self.settings["device"])
        adapter = installed_adapter(client, ref, self.alias)
        # a gallery adapter maps the stored rows: those need the rows loaded besides the search structure
        lean = adapter is None or adapter[0] not in GALLERY_ADAPTERS
        index = current.index if current is not None and current.index.manifest_sha == head and \
            (lean or not current.index.rows_in_structure) else load_index(self.settings["index"], head, lean=lean)
        check_servable(index.manifest, self.settings["index"], ref.uri, getattr(model, "feature_dim", None))
        self._use_threads(index)
        state = build_state(ref, model, index, adapter, self.settings["precision"])
        self._state = state          # the one atomic switch
        self.metrics.swaps += 1
        self.last_error = None
        LOG.info("serving %s version %s, index %s (%s)", ref.name, ref.version, head[:12],
                 state_summary(state)["items_by_version"])
        return True

    def _use_threads(self, index) -> None:
        """The replica's thread count for faiss too, once an index with an approximate structure is loaded."""
        if index.ann is not None:
            set_faiss_threads(int(self.settings["threads"]))

    def _note_error(self, error: BaseException) -> None:
        self.metrics.swap_errors += 1
        self.last_error = f"{type(error).__name__}: {error}"
        LOG.warning("load failed: %s", self.last_error)

    def _watch(self) -> None:
        while True:
            try:
                self.refresh()
                self.last_error = None   # loaded, or nothing to load: the served state is the alias's target
            except Exception as error:  # noqa: BLE001 - keep serving the current state (503 until a first load)
                self._note_error(error)
            if self._stop.wait(float(self.settings["poll_s"])):
                return

    def __del__(self) -> None:
        self._stop.set()

    # ---- HTTP ----------------------------------------------------------------------------------------------------
    async def __call__(self, request):
        started = time.perf_counter()
        path = request_path(request)
        response = await answer_route(self._route, request, path)
        self.metrics.observe(path if path in ROUTES else "other",
                             response.status_code, time.perf_counter() - started)
        return response

    async def _route(self, request, path: str):
        from starlette.responses import HTMLResponse, PlainTextResponse

        method = request.method.upper()
        if path not in ROUTES:
            raise RequestError(404, "path", f"{path!r} is not served; routes: {sorted(ROUTES)} (reference: /docs)")
        if method != ROUTES[path]:
            raise RequestError(405, "method", f"{path} takes {ROUTES[path]}, got {method}")
        state = self._state
        if path in ("/openapi.json", "/docs"):
            document = openapi_document(state, self.limits)
            return _json(document) if path == "/openapi.json" else HTMLResponse(docs_html(document))
        if path == "/metrics":
            return PlainTextResponse(self.metrics.render(state), media_type="text/plain; version=0.0.4")
        if path == "/healthz":
            if state is None:
                return _json({"status": "loading", "error": self.last_error}, 503)
            return _json(self._health(state))
        body = await read_limited_body(request, self.limits.max_body_bytes)
        return _json(await self._search(body, request.headers.get("content-type")))

    async def search_body(self, body: bytes, content_type: str | None) -> tuple[int, dict]:
        """(HTTP status, JSON document) of a /search body, as the route answers it: the call a shard router makes
        through a deployment handle."""
        try:
            return 200, await self._search(body, content_type)
        except RequestError as error:
            return error.status, error.to_json()

    async def search_bodies(self, items: list[tuple[bytes, str | None]]) -> list[tuple[int, dict]]:
        """:meth:`search_body` of each (body, content type) in ``items``, answered together (one call of a shard
        router carrying the queries that reached it at once; the replica's kernel batches them). A failure other
        than a refused request is that item's 503, which the router asks again."""
        answers = await asyncio.gather(*(self.search_body(body, kind) for body, kind in items),
                                       return_exceptions=True)
        return [answer if not isinstance(answer, BaseException) else
                (503, {"error": {"status": 503, "field": None,
                                 "message": f"{type(answer).__name__}: {str(answer).splitlines()[0][:300]}"
                                 if str(answer) else type(answer).__name__}})
                for answer in answers]

    async def api_document(self) -> dict:
        """The OpenAPI document this replica serves at /openapi.json (the call a shard router makes)."""
        return openapi_document(self._state, self.limits)

    async def health_document(self) -> tuple[int, dict]:
        """(HTTP status, JSON document) of /healthz, plus the replica's Ray actor name and process id."""
        import ray

        state = self._state
        where = {"actor": ray.get_runtime_context().get_actor_name(), "pid": os.getpid()}
        if state is None:
            return 503, {"status": "loading", "error": self.last_error, **where}
        return 200, {**self._health(state), **where}

    async def _search(self, body: bytes, content_type: str | None) -> dict:
        state = self._state
        if state is None:
            state = await self._first_state()
        if state is None:
            raise RequestError(503, None, f"no model loaded yet ({self.last_error or 'loading'}); retry")
        parsed = parse_search_request(body, content_type, dim=state.index.dim,
                                      image_shape=state.image_shape, gallery_size=state.index.size,
                                      limits=self.limits)
        check_model_version(state.ref.version, state.index, parsed.model_version)
        if parsed.image is not None and state.model is None:
            raise RequestError(400, "image", "no model to embed images; send 'embedding'")
        return await self._batched((state, parsed))

    def _health(self, state: ServingState) -> dict:
        """/healthz of a loaded replica: "ok", or "degraded" (still 200: it answers with the version it loaded) while
        the alias's target could not be checked or loaded, naming that target and the error."""
        document = {"status": "ok", "replica": self.metrics.replica, **state_summary(state)}
        if self.last_error is not None:
            target = self.alias_target
            document["status"] = "degraded"
            document["alias"] = {"uri": self.settings.get("model"), "error": self.last_error,
                                 "target_version": target.version if target is not None else None}
        return document

    async def _first_state(self) -> ServingState | None:
        """The state once the first load succeeds, waiting up to ``first_load_wait_s`` while it is in progress (a
        replica Serve starts, e.g. replacing a lost one, gets requests before its model is loaded); None when that
        load failed (retried at the next poll) or takes longer."""
        deadline = time.monotonic() + float(self.settings["first_load_wait_s"])
        while self._state is None and self.last_error is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._state

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.0)
    async def _batched(self, items: list[tuple[ServingState, Any]]) -> list[dict]:
        # requests queued while a batch is computed form the next one: no added wait at low load (a 3 ms wait
        # did not form larger batches on the shared 2-core machine; see compat_search_batched_requests_total)
        self.metrics.observe_batch(len(items))
        return await asyncio.to_thread(_search_batch, items)


def _search_batch(items: list[tuple[ServingState, Any]]) -> list[dict]:
    """Answers to validated requests, each computed from its own state: requests that share a state are embedded
    and searched as one batch (top max-k; a request's top-k is the exact prefix of that ranking, whose order is
    total: score descending, gallery position ascending)."""
    import torch

    answers: list[dict | None] = [None] * len(items)
    by_state: dict[int, list[int]] = {}
    for number, (state, _) in enumerate(items):
        by_state.setdefault(id(state), []).append(number)
    for numbers in by_state.values():
        state = items[numbers[0]][0]
        rows = [None] * len(numbers)
        images = [i for i, n in enumerate(numbers) if items[n][1].image is not None]
        if images:
            embedded = embed_images(state.model, np.stack([items[numbers[i]][1].image for i in images]), state.mean,
                                    state.std)
            for row, i in enumerate(images):
                rows[i] = embedded[row]
        for i, n in enumerate(numbers):
            if rows[i] is None:
                rows[i] = as_query_tensor(items[n][1].embedding)
        k = max(items[n][1].k for n in numbers)
        positions, scores, groups = search_groups(torch.stack(rows), state.groups, k)
        for i, n in enumerate(numbers):
            answers[n] = _answer(state, items[n][1], positions[i], scores[i], groups[i])
    return answers


def _answer(state: ServingState, parsed, positions, scores, groups) -> dict:
    results = []
    for position, score, group in zip(positions[:parsed.k], scores[:parsed.k], groups[:parsed.k]):
        item = {"id": str(state.index.item_ids[position]), "position": int(position), "score": float(score),
                "item_version": state.groups[group].version,
                "adapter": state.adapter[0] if state.adapter and state.adapter[1] == state.groups[group].version
                else None}
        if parsed.include_payload:
            item["payload_uri"] = state.index.payload_uris[position]
        results.append(item)
    return {"model": state.ref.name, "model_version": state.ref.version, "index_manifest": state.index.manifest_sha,
            "k": parsed.k, "results": results}


def preflight(settings: dict) -> None:
    """Refuse, before any replica starts, a model whose features the index cannot take (``check_servable``): the
    index manifest at HEAD and the model version behind the alias now, loaded once here."""
    settings = {**DEFAULT_SETTINGS, **settings}
    if str(settings["index"]).startswith("s3://"):
        configure_object_storage()
    _, manifest = read_manifest(settings["index"])
    if not settings.get("model"):
        check_servable(manifest, settings["index"], f"models:/{manifest['model']['name']}/"
                       f"{manifest['model']['version']}", None)
        return
    resolver = MlflowModelResolver(settings["tracking_uri"], cache_dir=settings.get("cache_dir"))
    ref = resolve_model_ref(resolver.client, settings["model"])
    model = load_served_model(resolver, ref, "cpu")
    check_servable(manifest, settings["index"], ref.uri, getattr(model, "feature_dim", None))


def deployment(num_replicas: int = 1, num_cpus: float = 1.0, num_gpus: float = 0.0, max_ongoing_requests: int = 8):
    """The Serve deployment of :class:`SearchService` with these resources."""
    return serve.deployment(SearchService, name="compat-search").options(
        num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus})


def start(settings: dict, host: str = "127.0.0.1", port: int = 8000, app_name: str = APP_NAME,
          **resources) -> str:
    """Start Serve's HTTP proxy on host:port (127.0.0.1 unless configured) and deploy the service; returns its
    base URL. Ray must be initialised."""
    serve.start(http_options={"host": host, "port": int(port)})
    serve.run(deployment(**resources).bind(settings), name=app_name, route_prefix="/")
    return f"http://{host}:{port}"


def _healthz(url: str) -> tuple[int | None, dict | None]:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            return error.code, json.loads(error.read())
        except ValueError:
            return error.code, None
    except (OSError, ValueError):   # the proxy not listening yet, or an answer that is not JSON
        return None, None


def wait_first_load(url: str, model: str, timeout_s: float = 300.0, progress_s: float = 10.0) -> dict:
    """The /healthz document of the service at ``url`` once a replica loaded its first model, polled every 0.5 s
    and reported on stderr every ``progress_s`` seconds. RuntimeError with the replica's one-line error when that
    first load failed, TimeoutError when no replica loaded within ``timeout_s`` seconds."""
    host, _, port = url.split("://", 1)[-1].rpartition(":")
    probe = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '[::]', '') else host}:{port}"
    started = time.monotonic()
    noted = started
    while True:
        status, health = _healthz(probe)
        if status == 200 and health is not None:
            return health
        if health is not None and health.get("error"):
            error = " ".join(str(health["error"]).split())[:800]
            raise RuntimeError(f"--model {model}: the first load failed: {error}")
        elapsed = time.monotonic() - started
        if elapsed >= timeout_s:
            raise TimeoutError(f"--model {model}: no replica of {probe} loaded it within {timeout_s:.0f} s (last "
                               f"/healthz: {status} {health}); raise --first-load-timeout-s for a large model")
        if time.monotonic() - noted >= progress_s:
            noted = time.monotonic()
            print(f"waiting for the first load of {model} at {probe}/healthz ({elapsed:.0f} s of {timeout_s:.0f} s)",
                  file=sys.stderr, flush=True)
        time.sleep(0.5)


__all__ = ["APP_NAME", "SearchService", "deployment", "preflight", "start", "wait_first_load", "DEFAULT_SETTINGS"]
