"""`compat logs SUBMISSION_ID --address http://HOST:8265 [--follow]`: print a job's driver logs."""
from __future__ import annotations

import argparse
import sys

from cluster.jobs import job_client, wait_for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("submission_id", help="job id printed by `compat submit`")
    parser.add_argument("--address", default=None, help="the cluster's job server, http(s)://HOST:8265 "
                                                         "(default: $RAY_ADDRESS)")
    parser.add_argument("--ray-token-file", default=None, metavar="FILE",
                        help="file holding the cluster's auth token (default: Ray's standard places, $RAY_AUTH_TOKEN, "
                             "$RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; the token is never printed)")
    parser.add_argument("--follow", action="store_true", help="keep printing new lines until the job ends")


def run(args) -> int:
    try:
        client = job_client(args.address, args.ray_token_file)
        if args.follow:
            status = wait_for(client, args.submission_id, follow=True)
            print(f"[job {args.submission_id} ended {status}]", file=sys.stderr)
            return 0 if status == "SUCCEEDED" else 1
        sys.stdout.write(client.get_job_logs(args.submission_id))
    except (ValueError, ConnectionError, RuntimeError, PermissionError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
