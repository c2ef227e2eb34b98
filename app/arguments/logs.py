"""Arguments of ``compat logs`` (the command itself is :mod:`app.commands.logs`): argparse only,
so that ``compat logs --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("submission_id", help="job id printed by `compat submit`")
    parser.add_argument("--address", default=None, help="the cluster's job server, http(s)://HOST:8265 "
                                                         "(default: $RAY_ADDRESS)")
    parser.add_argument("--ray-token-file", default=None, metavar="FILE",
                        help="file holding the cluster's auth token (default: Ray's standard places, $RAY_AUTH_TOKEN, "
                             "$RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; the token is never printed)")
    parser.add_argument("--follow", action="store_true", help="keep printing new lines until the job ends")
