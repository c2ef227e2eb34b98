"""``compat models prune``: per-run registry aliases of run folders that no longer exist (logic:
:mod:`cluster.model_registry.prune`)."""
from __future__ import annotations

import sys

from cluster.model_registry.prune import prune_run_aliases
from cluster.tracking.client import open_client


def run(args) -> int:
    if args.tracking.uri is None:
        print("error: --tracking-uri none: the aliases live in an MLflow registry; name its store", file=sys.stderr)
        return 2
    client = open_client(args.tracking.uri)
    stale = prune_run_aliases(client, args.models or None, apply=args.apply)
    verb = "removed" if args.apply else "would remove"
    for alias in stale:
        print(f"{verb} {alias.model}@{alias.alias} (version {alias.version}; run folder {alias.run_folder} is gone)")
    if not stale:
        print("no per-run alias names a run folder that is gone")
    elif not args.apply:
        print(f"dry run: {len(stale)} alias(es) listed, none removed; run folders are checked from this machine "
              f"(one on another machine's disk looks gone); remove them with: compat models prune --apply")
    return 0
