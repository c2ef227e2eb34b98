"""Arguments of ``compat serve`` (the command itself is :mod:`app.commands.serve`): argparse only,
so that ``compat serve --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse

from app.arguments.cluster_access import add_cluster_access


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("index", help="gallery index folder or s3://bucket/prefix (`compat index build`)")
    parser.add_argument("--model", required=True, metavar="URI", help="models:/NAME@champion (followed) or "
                        "models:/NAME/VERSION (pinned)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--replicas", type=int, default=1, help="replicas (per shard, for a sharded index)")
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica (of each shard, and of the "
                        "shard router, for a sharded index)")
    parser.add_argument("--shard-retry-s", type=float, default=30.0, help="sharded index: seconds the router keeps "
                        "asking a lost or loading shard again before it answers 503 (default 30)")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica (queries embedded there)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--poll-s", type=float, default=2.0, help="seconds between alias / index checks")
    parser.add_argument("--precision", default="auto", help="retrieval kernel precision (the ranking is exact "
                        "for every choice)")
    parser.add_argument("--max-k", type=int, default=100)
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20)
    add_cluster_access(parser, "Ray cluster")
    parser.add_argument("--first-load-timeout-s", type=float, default=300.0, help="seconds the command waits for "
                        "the first replica to load the model before it gives up (default 300)")
    parser.add_argument("--for-seconds", type=float, default=None, help="stop after this long (default: until "
                        "interrupted)")
