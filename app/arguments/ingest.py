"""Arguments of ``compat ingest`` (the command itself is :mod:`app.commands.ingest`): argparse only,
so that ``compat ingest --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse


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
