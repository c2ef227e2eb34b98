"""Arguments of ``compat submit`` (the command itself is :mod:`app.commands.submit`): argparse and the executor
registry's cards only, so that ``compat submit --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse

from app.arguments.cluster_access import add_executor_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="scenario YAML")
    parser.add_argument("--address", default=None,
                        help="the cluster's job server, http(s)://HOST:8265 (default: $RAY_ADDRESS); token auth via "
                             "RAY_AUTH_MODE=token + RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH (see docs/cluster.md)")
    parser.add_argument("--ray-token-file", default=None, metavar="FILE",
                        help="file holding the cluster's auth token (default: Ray's standard places, $RAY_AUTH_TOKEN, "
                             "$RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; the token is never printed)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value (YAML-parsed; repeatable)")
    parser.add_argument("--output", metavar="DIR", help="run directory: s3://BUCKET/PREFIX for a remote cluster; a "
                                                         "local path (made absolute here) only for a head on this "
                                                         "machine or with --shared-filesystem; default: the config's "
                                                         "output.dir")
    parser.add_argument("--shared-filesystem", action="store_true",
                        help="every node mounts this machine's local paths (run directory, data roots) at the same "
                             "place: submit them to a remote head as they are")
    add_executor_argument(parser, default="ray", help="executor inside the job, default ray: stages spread over the "
                          "cluster")
    parser.add_argument("--python", default=None, metavar="PATH",
                        help="interpreter that runs the job on the cluster (default: this command's own interpreter "
                             "when the node has that file, e.g. a head started from the same .venv; else python "
                             "from the node's PATH)")
    parser.add_argument("--wait", action="store_true", help="wait until the job ends, printing its logs as they "
                                                             "come; exit 0 only if it SUCCEEDED")
    parser.add_argument("--follow", action=argparse.BooleanOptionalAction, default=True,
                        help="with --wait: print the job's logs (progress lines) as they come (default; --no-follow: "
                             "only the final status)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="with --wait: give up after S s")
