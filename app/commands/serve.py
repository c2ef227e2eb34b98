"""``compat serve INDEX --model models:/NAME@champion``: the compatible search service (Ray Serve; logic:
:mod:`cluster.serving.app`).

``POST /search`` with JSON ``{"image": BASE64 JPEG/PNG}`` or ``{"embedding": [...]}`` and ``"k"``: the top-k
gallery items (id, exact cosine score, the model version that embedded each item). ``GET /healthz``,
``GET /metrics`` (Prometheus). The service follows the alias: when ``compat gate`` moves it (or rolls it back),
every replica loads the new version and switches atomically. Binds 127.0.0.1 unless ``--host`` says otherwise.
"""
from __future__ import annotations

import time

from cluster.serving.app import preflight, start
from cluster.serving.ray_join import connect_ray
from pipelines.config.model_uri import parse_model_uri


def run(args) -> int:
    import ray
    from ray import serve

    tracking = args.tracking.uri
    if tracking is None:
        raise ValueError("--tracking-uri none: compat serve follows a model in an MLflow registry; name its "
                         "tracking server")
    parse_model_uri(args.model, "--model")  # a typo fails here, before Ray starts
    if args.replicas < 1:
        raise ValueError(f"--replicas: expected >= 1, got {args.replicas}")
    settings = {"index": args.index, "model": args.model, "tracking_uri": tracking, "poll_s": args.poll_s,
                "precision": args.precision, "device": "cuda" if args.num_gpus > 0 else "cpu",
                "threads": args.threads, "limits": {"max_k": args.max_k, "max_body_bytes": args.max_body_bytes}}
    preflight(settings)  # a model the index cannot take is refused here, before Ray starts
    connect_ray(args.ray_address, args.ray_token_file)
    url = start(settings, args.host, args.port, num_replicas=args.replicas, num_cpus=args.num_cpus,
                num_gpus=args.num_gpus)
    print(f"serving {args.index} with {args.model} at {url} (POST /search, GET /healthz, GET /metrics); Ray "
          f"cluster {ray.get_runtime_context().gcs_address} (`compat index backfill ... --ray-address` it)",
          flush=True)
    try:
        deadline = None if args.for_seconds is None else time.monotonic() + args.for_seconds
        while deadline is None or time.monotonic() < deadline:
            time.sleep(1.0)
    finally:
        serve.shutdown()
    return 0
