"""Arguments of ``compat report`` (the command itself is :mod:`app.commands.report`): argparse only,
so that ``compat report --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Positional RUN_DIR."""
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="run directory holding config.yaml, matrix.json and metrics.json (local or s3://; "
                             "S3 settings from the standard AWS environment / profile)")
