"""`compat submit CONFIG --address http://HOST:8265 [--set K=V] [--output DIR] [--wait [--no-follow]]`: run a
scenario as a Ray Job on a cluster (``--wait`` prints the job's logs as they come). Resubmitting the same scenario is
a no-op while its job is pending, running or done; after a failure it submits a new attempt (``-r2``, ...) that
resumes from the committed stages."""
from __future__ import annotations

import sys

from cluster.ray.jobs import submit_pipeline
from cluster.tracking.run_identity import run_intent
from pipelines.config.load import ConfigError, load_config
from pipelines.config.run_origin import RunOrigin


def run(args) -> int:
    try:
        config = load_config(args.config, args.overrides)
        outcome = submit_pipeline(config, args.address, output=args.output, wait=args.wait,
                                  follow=args.wait and args.follow,
                                  timeout_s=args.timeout, executor=args.executor, python=args.python,
                                  shared_filesystem=args.shared_filesystem, token_file=args.ray_token_file,
                                  origin=RunOrigin.of_command(getattr(args, "argv", None) or [], args.overrides),
                                  scenario_aliases=run_intent(args.config, args.overrides, config).scenario_aliases)
    except (ConfigError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (ConnectionError, TimeoutError, RuntimeError, PermissionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"submission id: {outcome.submission_id} ({outcome.status})")
    print(f"run directory: {outcome.output}")
    if args.wait:
        return 0 if outcome.status == "SUCCEEDED" else 1
    return 0
