"""`compat ingest DATASET --split S --out DIR`: convert a registered dataset split into verified Parquet shards."""
from __future__ import annotations

import sys

import yaml

from cluster.ray.task_backend import connect
from cluster.storage.ingest import ingest
from cluster.storage.s3 import configure_object_storage
from compat_core.integrity import IntegrityError


def _options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--option {pair!r}: expected KEY=VALUE")
        options[key] = yaml.safe_load(value)
    return options


def run(args) -> int:
    try:
        options = _options(args.option)
        setup = None
        if any(str(location or "").startswith("s3://") for location in (args.root, args.out)):
            import functools

            # S3 settings and credentials from the standard AWS chain (profiles too); Ray tasks get the settings
            # (never the secrets) and resolve credentials from their own node's chain
            setup = functools.partial(configure_object_storage, configure_object_storage())
        if args.workers > 0 and args.address:
            connect(args.address)
        for split in args.split:
            manifest = ingest(args.dataset, args.root, split, args.out, options=options,
                              rows_per_part=args.rows_per_part, row_group_bytes=int(args.row_group_mb * 2**20),
                              workers=args.workers, setup=setup)
            print(f"{args.dataset}/{split}: {manifest.rows} rows in {len(manifest.parts)} parts; use it with "
                  f"pool {{dataset: shards, root: {args.out}, split: {split}}}")
    except (KeyError, ValueError, FileNotFoundError, IntegrityError) as error:
        print(f"refused: {error}", file=sys.stderr)
        return 2
    return 0
