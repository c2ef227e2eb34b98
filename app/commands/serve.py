"""``compat serve INDEX --model models:/NAME@champion``: the compatible search service (Ray Serve; logic:
:mod:`cluster.serving.app`).

``POST /search`` with JSON ``{"image": BASE64 JPEG/PNG}`` or ``{"embedding": [...]}`` and ``"k"``: the top-k
gallery items (id, exact cosine score, the model version that embedded each item). ``GET /healthz``,
``GET /metrics`` (Prometheus). The service follows the alias: when ``compat gate`` moves it (or rolls it back),
every replica loads the new version and switches atomically. Binds 127.0.0.1 unless ``--host`` says otherwise.
An index built with ``--shards S`` is served by S deployments (``--replicas`` replicas each) behind a router that
fans every query out and merges the answers exactly (:mod:`cluster.serving.shard_router`).

The command fails at once when the alias names no version, and exits non-zero when the first load of the model
fails. A local Ray instance it starts limits request bodies in Serve's HTTP proxy too
(:mod:`cluster.serving.proxy_limits`): a body over ``--max-body-bytes`` is refused before the proxy or a replica
holds it. SIGTERM or SIGINT stops what it started: the application on a cluster it joined, or the whole local Ray
instance (every process of it) it started itself.
"""
from __future__ import annotations

import signal
import sys
import time

from cluster.model_registry.versions import MlflowModelResolver
from cluster.ray.process_tree import descendants, stop_processes
from cluster.serving.app import APP_NAME, preflight, start, wait_first_load
from cluster.serving.models import resolve_model_ref
from cluster.serving.proxy_limits import CALLBACK_VARIABLE as PROXY_CALLBACK_VARIABLE
from cluster.serving.proxy_limits import install as install_proxy_limit
from cluster.serving.ray_join import connect_ray, resolve_ray_target
from cluster.serving.replica_ports import refuse_exposing_settings
from cluster.serving.shard_router import preflight_sharded, start_sharded
from cluster.serving.shards import is_sharded
from cluster.storage.s3 import configure_object_storage
from pipelines.config.model_uri import parse_model_uri

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(KeyboardInterrupt):
    """SIGTERM or SIGINT arrived: stop the service."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum, _frame) -> None:
    raise StopRequested(signum)


def run(args) -> int:
    import ray

    tracking = args.tracking.uri
    if tracking is None:
        raise ValueError("--tracking-uri none: compat serve follows a model in an MLflow registry; name its "
                         "tracking server")
    parse_model_uri(args.model, "--model")  # a typo fails here, before Ray starts
    if args.replicas < 1:
        raise ValueError(f"--replicas: expected >= 1, got {args.replicas}")
    refuse_exposing_settings("compat serve's environment")
    resolve_model_ref(MlflowModelResolver(tracking).client, args.model)  # an alias naming no version fails here
    settings = {"index": args.index, "model": args.model, "tracking_uri": tracking, "poll_s": args.poll_s,
                "precision": args.precision, "device": "cuda" if args.num_gpus > 0 else "cpu",
                "threads": args.threads, "limits": {"max_k": args.max_k, "max_body_bytes": args.max_body_bytes}}
    if args.index.startswith("s3://"):
        configure_object_storage()
    sharded = is_sharded(args.index)
    settings["shard_retry_s"] = args.shard_retry_s
    # a model the index (every part of a sharded one) cannot take is refused here, before Ray starts
    (preflight_sharded if sharded else preflight)(settings)
    # no cluster named and none joined yet: connect_ray starts a local instance, which this command then owns
    owns_ray = resolve_ray_target(args.ray_address).address is None and not ray.is_initialized()
    if owns_ray and not install_proxy_limit(args.max_body_bytes):
        print(f"compat serve: {PROXY_CALLBACK_VARIABLE} names another callback; Serve's HTTP proxy keeps it, so "
              f"bodies are limited by the replicas only", file=sys.stderr)
    previous = {signum: signal.signal(signum, _raise_stop) for signum in STOP_SIGNALS}
    try:
        connect_ray(args.ray_address, args.ray_token_file)
        for signum in STOP_SIGNALS:  # ray.init installs its own SIGTERM handler, which skips this cleanup
            signal.signal(signum, _raise_stop)
        _serve(args, settings, sharded)
        return 0
    except StopRequested as stop:
        print(f"compat serve: {signal.Signals(stop.signum).name} received, stopping", file=sys.stderr, flush=True)
        return 128 + stop.signum
    finally:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        _stop(owns_ray)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _serve(args, settings: dict, sharded: bool) -> None:
    import ray

    url = (start_sharded if sharded else start)(settings, args.host, args.port, num_replicas=args.replicas,
                                                num_cpus=args.num_cpus, num_gpus=args.num_gpus)
    wait_first_load(url, args.model, args.first_load_timeout_s)
    print(f"serving {args.index} with {args.model} at {url} (POST /search, GET /healthz, GET /metrics; API reference "
          f"{url}/docs); Ray "
          f"cluster {ray.get_runtime_context().gcs_address} (`compat index backfill ... --ray-address` it)",
          flush=True)
    deadline = None if args.for_seconds is None else time.monotonic() + args.for_seconds
    while deadline is None or time.monotonic() < deadline:
        time.sleep(1.0)


def _stop(owns_ray: bool) -> None:
    """Remove the application; when this command started the local Ray instance, stop all of it."""
    import ray
    from ray import serve

    if not owns_ray:
        if ray.is_initialized():
            try:
                serve.delete(APP_NAME)
            except Exception as error:  # noqa: BLE001 - nothing of ours to remove (Serve never started)
                print(f"compat serve: application {APP_NAME} not removed ({type(error).__name__}: {error})",
                      file=sys.stderr)
        return
    started = descendants()
    try:
        if ray.is_initialized():
            serve.shutdown()
    finally:
        ray.shutdown()
        stop_processes(started, grace_s=15.0, what="processes of the local Ray instance compat serve started")
