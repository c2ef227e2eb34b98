"""Arguments of ``compat index`` (the command itself is :mod:`app.commands.index`): argparse only,
so that ``compat index --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse

from app.arguments.cluster_access import add_cluster_access


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("build", "backfill", "show"))
    parser.add_argument("root", help="index folder or s3://bucket/prefix")
    parser.add_argument("--config", metavar="YAML", help="scenario config (its evaluation sets are the pools)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value (YAML-parsed; repeatable)")
    parser.add_argument("--model", metavar="URI", help="models:/NAME@ALIAS or models:/NAME/VERSION")
    parser.add_argument("--pool", default="gallery", choices=("gallery", "query"), help="pool to index (build)")
    parser.add_argument("--shard-rows", type=int, default=4096, help="rows per Parquet shard (build)")
    parser.add_argument("--shards", type=int, default=1, help="split the gallery by row range into this many "
                        "indexes of their own, each with its own structure, served by its own deployment (build)")
    parser.add_argument("--payload-prefix", default=None, help="item i gets payload URI PREFIX/i (build)")
    parser.add_argument("--kind", default="flat", choices=("flat", "ivf", "hnsw", "ivfpq"),
                        help="search structure (build): flat = the exact kernel alone; ivf / hnsw / ivfpq = faiss "
                             "candidates re-ranked exactly")
    parser.add_argument("--recall", type=float, default=0.99,
                        help="Recall@1 of exact the structure's search effort must reach on held-out queries (build)")
    parser.add_argument("--sample", type=int, default=1000,
                        help="held-out queries (rows of the other evaluation pool) that measure that recall (build)")
    parser.add_argument("--chunk-rows", type=int, default=256, help="items re-embedded per chunk (backfill)")
    parser.add_argument("--order", default="random", choices=("random",),
                        help="backfill order (seeded random, compat_core.upgrades.backfill_order.backfill_order)")
    parser.add_argument("--probe", default="query", choices=("query", "none"),
                        help="probe Recall@1 per chunk on the config's evaluation query set (backfill)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the backfill order, or of the build's held-out query sample")
    add_cluster_access(parser, "Ray cluster (backfill)")
