"""`compat status [SUBMISSION_ID] --address http://HOST:8265`: status of one job, or of every compat job."""
from __future__ import annotations

import sys
import time

from cluster.ray.jobs import job_client, list_pipeline_jobs, status_name


HEADER = ("SUBMISSION ID", "STATUS", "STARTED", "MESSAGE")


def run(args) -> int:
    where = args.address or "the address in RAY_API_SERVER_ADDRESS / RAY_ADDRESS"
    print(f"asking the Ray job server at {where}...", file=sys.stderr, flush=True)
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
    rows = [(job["submission_id"], job["status"],
             "-" if job["start_time"] is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["start_time"])),
             job["message"].splitlines()[0][:80] if job["message"] else "") for job in jobs]
    width = max(len(row[0]) for row in rows + [HEADER])
    for row in [HEADER] + rows:
        print(f"{row[0]:<{width}}  {row[1]:<10}  {row[2]:<19}  {row[3]}".rstrip())
    return 0
