"""`compat logs SUBMISSION_ID --address http://HOST:8265 [--follow]`: print a job's driver logs."""
from __future__ import annotations

import sys

from cluster.ray.jobs import job_client, wait_for


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
