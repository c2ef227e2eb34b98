"""Arguments of ``compat ui`` (the command itself is :mod:`app.commands.ui`): argparse only,
so that ``compat ui --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=5000, help="port on 127.0.0.1 (default 5000; 0: a free one)")
    parser.add_argument("--tracking-uri", default=None, metavar="URI",
                        help="store to show (default: $MLFLOW_TRACKING_URI, else the machine's compat store)")
    parser.add_argument("--experiment", default=None, metavar="NAME",
                        help="print the URL of this experiment's runs (e.g. compat-demo); default: the experiments "
                             "list")
