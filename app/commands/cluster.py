"""`compat cluster up|down|status [--name NAME]`: a local Ray head on 127.0.0.1 that `compat submit` works with,
stopped without touching any other Ray instance on the machine (never `ray stop`)."""
from __future__ import annotations

import sys

from cluster.ray.local_head import read_state, start_head, stop_head


def run(args) -> int:
    if args.action == "up":
        try:
            state = start_head(args.name, args.state_dir, num_cpus=args.num_cpus,
                               object_store_memory=args.object_store_memory, dashboard_port=args.dashboard_port,
                               auth=args.auth)
        except (FileExistsError, PermissionError, RuntimeError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        _describe(state, started=True)
        return 0
    if args.action == "down":
        state = stop_head(args.name, args.state_dir)
        if state is None:
            print(f"no head named {args.name!r} was started by compat cluster up")
            return 0
        print(f"stopped head {state.name} ({state.address}, pid {state.pid}); other Ray instances untouched")
        return 0
    state = read_state(args.name, args.state_dir)
    if state is None:
        print(f"no head named {args.name!r} (start one with: compat cluster up)")
        return 1
    _describe(state, started=False)
    return 0


def _describe(state, started: bool) -> None:
    print(f"{'started' if started else 'running'} Ray head {state.name!r} on 127.0.0.1 (pid {state.pid}, "
          f"auth {state.auth}, temp dir {state.temp_dir})")
    print(f"  job server: {state.address}")
    print(f"  submit:     compat submit CONFIG --address {state.address}")
    print(f"  run:        compat run CONFIG --executor ray --address {state.gcs_address}")
    print(f"  or:         export RAY_ADDRESS={state.address}")
    print(f"  stop:       compat cluster down{'' if state.name == 'local' else ' --name ' + state.name}")
