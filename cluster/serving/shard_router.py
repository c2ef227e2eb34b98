"""The search service over a sharded index (``compat serve ROOT`` where ROOT holds ``SHARDS.json``).

Each part of the shard set is served by its own Serve deployment (``compat-search-shard-NNNN``, a replica group of
:class:`cluster.serving.app.SearchService` over that part's index, following the alias and the part's HEAD as the
unsharded service does). The ingress deployment, :class:`ShardRouter`, takes the HTTP routes:

- ``POST /search``: the body goes unchanged to every shard (each validates, embeds and searches its own rows);
  bodies that reach the router together go to a shard as one call (``CallBatcher``: sent at once while fewer than
  two calls to that shard are outstanding, else with the others that wait, at most ``shard_batch`` bodies a call;
  ``shard_batch`` 1 sends every body alone at once), answered per body; the shards' top-k answers are merged exactly (``compat_core.retrieval.shard_merge``: global row = offset + local row,
  score descending, lowest global row on ties), so the answer is the unsharded exact search's. A shard call that
  fails (its replica lost, restarting, or still loading: 503) is retried, only that shard, with backoff up to
  ``shard_retry_s`` seconds; answers made by different model versions (an alias swap reaching the shards at
  different moments) are discarded and asked again, so no answer mixes versions. Past the deadline: 503 naming the
  shard and its error.
- ``GET /healthz``: 200 once every shard answers 200 (status "ok", or "degraded" when one is), with the shards'
  versions, manifests, replica actors and processes; 503 ("loading") while one is not loaded.
- ``GET /metrics``: the router's requests by path and code, its shard retries and shard calls (Prometheus text;
  each shard replica keeps its own metrics).
- ``GET /openapi.json``, ``GET /docs``: the API reference of the unsharded service (:mod:`cluster.serving.api_doc`),
  as the first shard's replica makes it for its state, with a note that answers carry a shard number and global
  positions.

Every replica's ports stay on 127.0.0.1 (``keep_replica_ports_on_loopback`` in both constructors).
"""
from __future__ import annotations

import asyncio
import threading
import time

from ray import serve

from cluster.serving.api_doc import docs_html
from cluster.serving.app import (
    APP_NAME,
    DEFAULT_SETTINGS,
    _json,
    answer_route,
    deployment,
    preflight,
    read_limited_body,
    request_path,
)
from cluster.serving.call_batcher import CallBatcher
from cluster.serving.index_store import read_manifest
from cluster.serving.replica_ports import keep_replica_ports_on_loopback
from cluster.serving.shards import check_shard_set, part_root, read_shard_set
from cluster.serving.state import check_servable
from compat_core.retrieval.search_request import RequestError, SearchLimits
from compat_core.retrieval.shard_merge import merge_shard_topk

DEFAULT_RETRY_S = 30.0
DEFAULT_SHARD_BATCH = 32      # /search bodies per shard call at most
_SHARD_CALLS_IN_FLIGHT = 2    # calls outstanding per shard before bodies wait and go together
_HEALTH_TIMEOUT_S = 10.0
_ROUTES = {"/search": "POST", "/healthz": "GET", "/metrics": "GET", "/openapi.json": "GET", "/docs": "GET"}

__all__ = ["ShardRouter", "preflight_sharded", "start_sharded", "shard_deployment_name", "DEFAULT_RETRY_S",
           "DEFAULT_SHARD_BATCH"]


def shard_deployment_name(number: int) -> str:
    return f"compat-search-shard-{number:04d}"


class _RetryableShard(Exception):
    """A shard answer to ask again: the call failed, the shard is loading, or the versions disagree."""


class ShardRouter:
    """The ingress of a sharded service. settings: the service's settings (``limits``, ``shard_retry_s``,
    ``shard_batch``);
    shard_set: (sha256, document) of ``SHARDS.json``; shards: one deployment handle per part, in order."""

    def __init__(self, settings: dict, shard_set: tuple[str, dict], shards: list) -> None:
        keep_replica_ports_on_loopback()
        self.settings = {**DEFAULT_SETTINGS, **settings}
        self.limits = SearchLimits(**self.settings["limits"])
        self.retry_s = float(self.settings.get("shard_retry_s", DEFAULT_RETRY_S))
        self.set_sha, self.document = shard_set
        self.offsets = [int(part["offset"]) for part in self.document["parts"]]
        if len(shards) != len(self.offsets):
            raise ValueError(f"shard router: {len(shards)} shard deployments for {len(self.offsets)} parts")
        self.shards = shards
        batch = int(self.settings.get("shard_batch", DEFAULT_SHARD_BATCH))
        # shard_batch 1: every body its own call, as many in flight as requests (no waiting at the router)
        in_flight = _SHARD_CALLS_IN_FLIGHT if batch > 1 else 1 << 30
        self.batchers = [CallBatcher(shard.search_bodies.remote, batch, in_flight) for shard in shards]
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, int], int] = {}
        self.retries = 0

    async def __call__(self, request):
        path = request_path(request)
        response = await answer_route(self._route, request, path)
        with self._lock:
            key = (path if path in _ROUTES else "other", response.status_code)
            self.counts[key] = self.counts.get(key, 0) + 1
        return response

    async def _route(self, request, path: str):
        if path not in _ROUTES:
            raise RequestError(404, "path", f"{path!r} is not served; routes: {sorted(_ROUTES)}")
        if request.method.upper() != _ROUTES[path]:
            raise RequestError(405, "method", f"{path} takes {_ROUTES[path]}, got {request.method.upper()}")
        if path == "/metrics":
            from starlette.responses import PlainTextResponse

            return PlainTextResponse(self._metrics(), media_type="text/plain; version=0.0.4")
        if path in ("/openapi.json", "/docs"):
            document = await self._api_document()
            if path == "/docs":
                from starlette.responses import HTMLResponse

                return HTMLResponse(docs_html(document))
            return _json(document)
        if path == "/healthz":
            status, document = await self._health()
        else:
            body = await read_limited_body(request, self.limits.max_body_bytes)
            status, document = await self.search(body, request.headers.get("content-type"))
        return _json(document, status)

    async def _ask(self, number: int, body: bytes, content_type: str | None) -> tuple[int, dict]:
        try:
            status, document = await self.batchers[number].ask((body, content_type))
        except Exception as error:  # noqa: BLE001 - a lost or restarting replica: ask again
            raise _RetryableShard(f"shard {number}: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
        if status == 503:
            raise _RetryableShard(f"shard {number}: {document.get('error', {}).get('message')}")
        return status, document

    async def search(self, body: bytes, content_type: str | None) -> tuple[int, dict]:
        """(status, document) of a /search body over every shard, retried per shard until ``retry_s`` passed."""
        deadline = time.monotonic() + self.retry_s
        answers: list[tuple[int, dict] | None] = [None] * len(self.shards)
        pause, last = 0.05, None
        while True:
            missing = [n for n, answer in enumerate(answers) if answer is None]
            results = await asyncio.gather(*(self._ask(n, body, content_type) for n in missing),
                                           return_exceptions=True)
            for number, result in zip(missing, results):
                if isinstance(result, _RetryableShard):
                    last = str(result)
                elif isinstance(result, BaseException):
                    raise result
                else:
                    answers[number] = result
            refused = next((a for a in answers if a is not None and a[0] != 200), None)
            if refused is not None:   # every shard validates a body alike: its refusal is the answer
                return refused
            if all(answer is not None for answer in answers):
                versions = {answer[1]["model_version"] for answer in answers}
                if len(versions) == 1:
                    return 200, self._merge([answer[1] for answer in answers])
                last = f"shards answered with model versions {sorted(versions)} (an alias swap in progress)"
                answers = [None] * len(self.shards)
            if time.monotonic() >= deadline:
                return 503, {"error": {"status": 503, "field": None,
                                       "message": f"no complete answer within {self.retry_s:.0f} s: {last}"}}
            with self._lock:
                self.retries += 1
            await asyncio.sleep(pause)
            pause = min(1.0, pause * 2)

    def _merge(self, documents: list[dict]) -> dict:
        k = int(documents[0]["k"])
        answers = [(offset, [r["position"] for r in doc["results"]], [r["score"] for r in doc["results"]])
                   for offset, doc in zip(self.offsets, documents)]
        rows, _, shards, local = merge_shard_topk(answers, k)
        by_local = [{int(r["position"]): r for r in doc["results"]} for doc in documents]
        results = [{**by_local[shard][int(position)], "position": int(row), "shard": int(shard)}
                   for row, shard, position in zip(rows, shards, local)]
        first = documents[0]
        return {"model": first["model"], "model_version": first["model_version"], "index_manifest": self.set_sha,
                "shard_manifests": [doc["index_manifest"] for doc in documents], "k": k, "results": results}

    async def _api_document(self) -> dict:
        """The unsharded service's OpenAPI document as the first shard makes it, noting the shard fields."""
        try:
            document = await asyncio.wait_for(self.shards[0].api_document.remote(), _HEALTH_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - a restarting shard: say so
            raise RequestError(503, None, f"shard 0 did not give the API document ({type(error).__name__}); "
                                          "retry") from None
        info = document["info"]
        info["description"] += (f" Sharded: {len(self.shards)} shards of {int(self.document['count'])} items in "
                                f"all; each result also names its \"shard\" (number), positions are rows of the "
                                f"whole gallery, and the answer lists \"shard_manifests\"; /healthz lists the "
                                f"shards.")
        return document

    async def _shard_health(self, number: int) -> tuple[int | None, dict]:
        try:
            return await asyncio.wait_for(self.shards[number].health_document.remote(), _HEALTH_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - reported, the shard restarting
            return None, {"status": "unreachable", "error": None, "reason": f"{type(error).__name__}"}

    async def _health(self) -> tuple[int, dict]:
        shards = await asyncio.gather(*(self._shard_health(n) for n in range(len(self.shards))))
        summary = [{"shard": n, "offset": self.offsets[n], "status": doc.get("status"),
                    **{key: doc.get(key) for key in ("model_version", "index_manifest", "items", "actor", "pid",
                                                     "search", "alias", "adapter")}}
                   for n, (_, doc) in enumerate(shards)]
        document = {"shard_set": self.set_sha, "items": int(self.document["count"]), "dim": int(self.document["dim"]),
                    "shards": summary}
        if any(status != 200 for status, _ in shards):
            errors = [f"shard {n}: {doc['error']}" for n, (_, doc) in enumerate(shards) if doc.get("error")]
            return 503, {"status": "loading", "error": "; ".join(errors) or None, **document}
        versions = sorted({doc["model_version"] for _, doc in shards})
        status = "degraded" if any(doc["status"] != "ok" for _, doc in shards) or len(versions) > 1 else "ok"
        return 200, {"status": status, "model": shards[0][1]["model"],
                     "model_version": versions[0] if len(versions) == 1 else versions, **document}

    def _metrics(self) -> str:
        lines = ["# HELP compat_router_requests_total HTTP requests the shard router answered, by path and code.",
                 "# TYPE compat_router_requests_total counter"]
        with self._lock:
            lines += [f'compat_router_requests_total{{path="{path}",code="{code}"}} {count}'
                      for (path, code), count in sorted(self.counts.items())]
            lines += ["# HELP compat_router_shard_retries_total Rounds of shard calls asked again (a shard lost, "
                      "loading, or answering with another model version).",
                      "# TYPE compat_router_shard_retries_total counter",
                      f"compat_router_shard_retries_total {self.retries}",
                      "# HELP compat_router_shard_calls_total Calls made to shards (each carries one or more "
                      "/search bodies).", "# TYPE compat_router_shard_calls_total counter",
                      f"compat_router_shard_calls_total {sum(b.calls for b in self.batchers)}",
                      "# HELP compat_router_shard_call_bodies_total /search bodies those calls carried.",
                      "# TYPE compat_router_shard_call_bodies_total counter",
                      f"compat_router_shard_call_bodies_total {sum(b.items for b in self.batchers)}"]
        lines += ["# HELP compat_router_shards Shards the router fans a query out to.",
                  "# TYPE compat_router_shards gauge", f"compat_router_shards {len(self.shards)}"]
        return "\n".join(lines) + "\n"


def start_sharded(settings: dict, host: str = "127.0.0.1", port: int = 8000, app_name: str = APP_NAME,
                  num_replicas: int = 1, num_cpus: float = 1.0, num_gpus: float = 0.0, router_cpus: float | None = None,
                  max_ongoing_requests: int = 8) -> str:
    """Start Serve's HTTP proxy on host:port and deploy the shard set at ``settings["index"]``: one deployment of
    ``num_replicas`` replicas per part and the router; returns the base URL. Ray must be initialised."""
    root = settings["index"]
    digest, document = read_shard_set(root)
    parts = [deployment(num_replicas, num_cpus, num_gpus, max_ongoing_requests)
             .options(name=shard_deployment_name(number)).bind({**settings, "index": part_root(root, part)})
             for number, part in enumerate(document["parts"])]
    router = serve.deployment(ShardRouter, name="compat-search-router").options(
        num_replicas=1, max_ongoing_requests=max(64, max_ongoing_requests * len(parts)),
        ray_actor_options={"num_cpus": num_cpus if router_cpus is None else router_cpus})
    serve.start(http_options={"host": host, "port": int(port)})
    serve.run(router.bind(settings, (digest, document), parts), name=app_name, route_prefix="/")
    return f"http://{host}:{port}"



def preflight_sharded(settings: dict) -> None:
    """The unsharded service's preflight (:func:`cluster.serving.app.preflight`) for every part of the shard set,
    after checking each part's manifest against the set (width, rows, offset); the model is loaded once."""
    root = settings["index"]
    _, document = read_shard_set(root)
    check_shard_set(root, document)
    preflight({**settings, "index": part_root(root, document["parts"][0])})
    for part in document["parts"][1:]:
        _, manifest = read_manifest(part_root(root, part))
        check_servable(manifest, part_root(root, part), str(settings.get("model") or document["model"]), None)
