"""`compat status [SUBMISSION_ID] --address http://HOST:8265`: status of one job, or of every compat job."""
from __future__ import annotations

import sys
import time

from cluster.ray.jobs import job_client, list_pipeline_jobs, status_name


def run(args) -> int:
    try:
        client = job_client(args.address, args.ray_token_file)
        if args.submission_id:
            info = client.get_job_info(args.submission_id)
            message = f" - {info.message}" if getattr(info, "message", None) else ""
            print(f"{args.submission_id}: {status_name(info.status)}{message}")
            return 0
        jobs = list_pipeline_jobs(client)
    except (ValueError, ConnectionError, RuntimeError, PermissionError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if not jobs:
        print("no compat jobs on this cluster")
        return 0
    for job in jobs:
        started = "-" if job["start_time"] is None else time.strftime("%Y-%m-%d %H:%M:%S",
                                                                     time.localtime(job["start_time"]))
        print(f"{job['submission_id']:<60} {job['status']:<10} {started}")
    return 0
