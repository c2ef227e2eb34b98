"""`compat eval RUN_DIR [--gallery ...] [--metric ...] [--label-level ...]`: protocol variants from stored features.

Nothing is re-extracted: entries are computed from the features committed by the run (and committed themselves,
so asking for the same variant twice computes nothing). Writes ``eval-<variant>/matrix.json`` and ``metrics.json``
in the run directory unless the variant equals the run's own protocol.
"""
from __future__ import annotations

import sys

from app.printing import print_results
from cluster.storage.s3 import configure_object_storage
from pipelines.reports.run_report import write_store_reports
from pipelines.results.variants import evaluate_variant
from pipelines.store.lease import RunFolderBusyError, run_lease


def run(args) -> int:
    overrides = {"gallery": args.gallery, "metric": args.metric, "label_level": args.label_level,
                 "strict": None if args.strict is None else args.strict == "true"}

    try:
        if str(args.run_dir).startswith("s3://"):
            configure_object_storage()  # S3 settings and credentials from the standard AWS chain (profiles too)
        with run_lease(str(args.run_dir)):  # it writes into the run folder: never beside a running driver
            matrix, metrics, folder = evaluate_variant(args.run_dir, overrides, on_run_complete=write_store_reports)
    except (FileNotFoundError, ValueError, RunFolderBusyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"written to {args.run_dir}/{folder + '/' if folder else ''}matrix.json and metrics.json")
    print_results(matrix, metrics)
    return 0
