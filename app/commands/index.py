"""``compat index``: gallery indexes for ``compat serve`` (logic: :mod:`cluster.serving`).

- ``compat index build ROOT --config CONFIG --model models:/NAME@champion [--pool gallery|query]
  [--shard-rows N] [--payload-prefix URI] [--kind flat|ivf|hnsw|ivfpq --recall R --sample N --seed S]
  [--shards S]``: embed the config's evaluation gallery (or query) pool with that model version and write
  content-addressed Parquet shards and a manifest at ROOT (a folder or ``s3://bucket/prefix``); with ``--kind``
  other than flat, a faiss structure beside them whose search effort reaches Recall@1 of exact >= R on N held-out
  rows of the other pool. ``--shards S``: S indexes of their own by row range (ROOT/part-NNNN, listed by
  ROOT/SHARDS.json), each with its own structure, for ``compat serve`` to serve by S deployments.
- ``compat index backfill ROOT --config CONFIG --model models:/NAME@champion [--chunk-rows N] [--order
  random] [--probe query|none]``: re-embed the items of other versions with that model version in chunks as
  Ray tasks, flipping each chunk in one manifest swap while ``compat serve`` answers; progress and a probe Recall@1
  per chunk logged to MLflow (experiment ``compat-backfill``).
- ``compat index show ROOT``: the manifest at HEAD (items per model version, shards).
"""
from __future__ import annotations

import json

from cluster.serving.backfill_job import run_backfill
from cluster.serving.index_build import AnnSettings, build_index
from cluster.serving.index_store import load_index, search_entry
from cluster.serving.ray_join import resolve_ray_target
from cluster.serving.shards import is_sharded, read_shard_set
from cluster.storage.s3 import configure_object_storage
from pipelines.config.load import load_config
from pipelines.config.model_uri import parse_model_uri


def _config(args):
    if not args.config:
        raise ValueError(f"compat index {args.action}: --config YAML is required")
    return load_config(args.config, args.overrides)


def _tracking(args) -> str:
    if args.tracking.uri is None:
        raise ValueError(f"--tracking-uri none: compat index {args.action} reads the model from an MLflow registry; "
                         f"name its tracking server")
    return args.tracking.uri


def run(args) -> int:
    if args.root.startswith("s3://"):
        configure_object_storage()
    if args.action == "show" and is_sharded(args.root):
        digest, document = read_shard_set(args.root)
        print(json.dumps({"shard_set": digest, **document}, indent=2))
        return 0
    if args.action == "show":
        index = load_index(args.root)
        versions = {str(v): int((index.versions == v).sum()) for v in sorted(set(index.versions.tolist()))}
        print(json.dumps({"manifest": index.manifest_sha, "items": index.size, "dim": index.dim,
                          "items_by_version": versions, "model": index.manifest.get("model"),
                          "shards": len(index.manifest["shards"]), "backfill": index.manifest.get("backfill"),
                          "search": {k: v for k, v in search_entry(index.manifest).items() if k != "curve"},
                          **({"search_backfill": {k: v for k, v in index.manifest["search_backfill"].items()
                                                  if k != "curve"}} if index.manifest.get("search_backfill") else {})},
                         indent=2))
        return 0
    if not args.model:
        raise ValueError(f"compat index {args.action}: --model models:/NAME@ALIAS is required")
    parse_model_uri(args.model, "--model")  # a typo fails here, before Ray or the registry is reached
    ann = AnnSettings(args.kind, args.recall, args.sample, args.seed) if args.action == "build" else None
    if args.action == "backfill" and is_sharded(args.root):
        raise ValueError(f"compat index backfill {args.root}: a sharded index; backfill each part "
                         f"({args.root}/part-NNNN, listed in SHARDS.json) as an index of its own")
    if args.action == "backfill":
        resolve_ray_target(args.ray_address)  # an address it cannot join fails now, not after the config is read
    config = _config(args)
    if args.action == "build":
        build_index(args.root, config, args.model, _tracking(args), args.pool, args.shard_rows, args.payload_prefix,
                    ann=ann, shards=args.shards)
        return 0

    summary = run_backfill(args.root, config, args.model, _tracking(args), chunk_rows=args.chunk_rows,
                           order=args.order, seed=args.seed, probe=args.probe != "none",
                           ray_address=args.ray_address, ray_token_file=args.ray_token_file)
    print(json.dumps(summary, indent=2))
    return 0 if summary.get("done") else 1


