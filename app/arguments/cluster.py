"""Arguments of ``compat cluster`` (the command itself is :mod:`app.commands.cluster`): argparse only,
so that ``compat cluster --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("up", "down", "status"), help="start, stop or describe the head")
    parser.add_argument("--name", default="local", help="which head (several may run side by side; default local)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs the head offers (default: all)")
    parser.add_argument("--object-store-memory", type=int, default=500_000_000, metavar="BYTES",
                        help="object store size in bytes (default 500 MB)")
    parser.add_argument("--dashboard-port", type=int, default=None, help="job server port (default: a free one)")
    parser.add_argument("--auth", choices=("token", "disabled"), default="token",
                        help="Ray token authentication (default token: the token is ~/.ray/auth_token, generated "
                             "when missing, and compat submit finds it there)")
    parser.add_argument("--state-dir", default=None, help="where the head's state file lives "
                                                          "(default ~/.cache/compat/cluster)")
