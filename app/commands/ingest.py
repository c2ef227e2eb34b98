"""`compat ingest DATASET --split S --out DIR`: convert a registered dataset split into verified Parquet shards."""
from __future__ import annotations

import argparse
import sys

import yaml

from cluster.ingest import ingest
from cluster.ray_executor import connect
from cluster.storage import configure_object_storage
from compat_core.data.formats.shards import ShardIntegrityError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", help="registered dataset name (see compat_core.data.dataset_names())")
    parser.add_argument("--root", default=None, help="local folder or s3:// URI of the published files")
    parser.add_argument("--split", action="append", required=True, help="split to ingest (repeatable)")
    parser.add_argument("--out", required=True, help="output folder or s3:// prefix; each split goes to OUT/SPLIT")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="dataset reader option (YAML-parsed value; repeatable)")
    parser.add_argument("--rows-per-part", type=int, default=None, help="rows per Parquet part (default: ~256 MB)")
    parser.add_argument("--row-group-mb", type=float, default=32.0, help="target Parquet row-group size in MB")
    parser.add_argument("--workers", type=int, default=2,
                        help="parts written at once as Ray tasks (0: in this process, no Ray)")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local one)")


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
    except (KeyError, ValueError, FileNotFoundError, ShardIntegrityError) as error:
        print(f"refused: {error}", file=sys.stderr)
        return 2
    return 0
