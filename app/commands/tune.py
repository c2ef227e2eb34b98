"""``compat tune CONFIG --space SPACE.yaml``: hyper-parameter search over whole pipelines (Ray Tune + Optuna).

Each trial runs the scenario with sampled values applied as config overrides and reports the compatibility metrics
after every task; ASHA (default) stops bad trials early, Optuna (seeded TPE) proposes values, at most
``--concurrent`` trials run at once. Every trial is an MLflow run nested under the search's run. An interrupted
search continues with ``compat tune --resume SEARCH_DIR`` and ends with the requested number of trials.
``compat compare SEARCH_DIR`` prints its top trials. Exit codes: 0 done, 1 interrupted, 2 invalid input.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from cluster.tune.grid import coverage_text, spread_points
from cluster.tune.runner import default_resources, ensure_ray, resume_search, run_search
from cluster.tune.search_space import load_space
from cluster.tune.spec import (
    SearchSpec,
    absolute_fixed_values,
    absolute_local_paths,
    absolute_plugin,
    load_plugins,
    objective_metric,
)
from compat_core import io as cio
from pipelines.config.load import config_to_dict, load_config


def build_spec(args):
    """SearchSpec from the command line (validates config, space and objective)."""

    if not args.config or not args.space:
        raise ValueError("CONFIG and --space SPACE.yaml are required (or --resume SEARCH_DIR)")
    plugins = [absolute_plugin(p) for p in args.plugins]
    load_plugins(plugins)
    config = load_config(args.config, args.overrides)
    space = load_space(args.space).to_dict()
    # trials run in their own working folders: relative paths (data roots, the shared store) are the driver's
    cwd = Path.cwd()
    if space.get("fixed"):
        space["fixed"] = absolute_fixed_values(space["fixed"], cwd)
    storage = args.storage if cio.is_remote(args.storage) else str(Path(args.storage).resolve())
    resources = default_resources(config, args.concurrent)
    if args.cpus_per_trial is not None:
        resources["cpu"] = args.cpus_per_trial
    if args.gpus_per_trial is not None:
        resources["gpu"] = args.gpus_per_trial
    return SearchSpec(
        name=args.name or f"tune-{config.name}-{time.strftime('%Y%m%d-%H%M%S')}",
        base_config=absolute_local_paths(config_to_dict(config), cwd), space=space,
        objective=objective_metric(args.objective),
        samples=args.samples, concurrent=args.concurrent, scheduler=args.scheduler, seed=args.seed, storage=storage,
        resources=resources, plugins=plugins, tracking_uri=args.tracking.uri,
        mlflow_experiment=args.mlflow_experiment)


def check_before_ray(args) -> str:
    """Read the config and the space (missing or invalid files fail here, before Ray starts, in seconds) and say
    how much of the space ``--samples`` trials cover; returns that line."""
    if not args.config or not args.space:
        raise ValueError("CONFIG and --space SPACE.yaml are required (or --resume SEARCH_DIR)")
    space = load_space(args.space)
    load_plugins([absolute_plugin(p) for p in args.plugins])  # a plugin may register the config's dataset
    load_config(args.config, args.overrides)
    if args.samples < 1:
        raise ValueError(f"--samples {args.samples}: expected at least 1 trial")
    return coverage_text(space, args.samples, spread_points(space, args.samples, args.seed))


def run(args) -> int:
    try:
        if args.resume:
            outcome = resume_search(args.resume, address=args.address, plugins=args.plugins)
        else:
            print(check_before_ray(args), file=sys.stderr)
            ensure_ray(args.address)  # default resources depend on the cluster (GPUs, CPUs)
            outcome = run_search(build_spec(args), address=args.address)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError, ModuleNotFoundError,
            PermissionError) as error:
        print(f"compat tune: error: {error.args[0] if error.args else error}", file=sys.stderr)
        return 2
    print_outcome(outcome)
    failed = [trial.trial_id for trial in outcome.trials if trial.status == "ERROR"]
    if failed:  # as Tune's own run does by default: a search with a failed trial is not a success
        print(f"compat tune: {len(failed)} of {len(outcome.trials)} trials failed ({', '.join(failed[:5])}"
              f"{', ...' if len(failed) > 5 else ''}); their errors are above and in their trial folders",
              file=sys.stderr)
        return 1
    return 0 if outcome.complete else 1


def print_outcome(outcome, stream=None, top: int = 10) -> None:
    """Top trials (objective as a fraction), the best trial and where the search lives."""
    stream = stream or sys.stdout
    spec = outcome.spec
    print(f"search {spec.name}: {len(outcome.trials)} of {spec.samples} trials, objective {spec.objective} "
          f"(fraction, maximised){'' if outcome.complete else ' - INTERRUPTED'}", file=stream)
    for trial in outcome.trials[:top]:
        value = "n/a" if trial.objective is None else f"{trial.objective:.4f}"
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in
                           sorted(trial.params.items()))
        print(f"  {trial.trial_id}  {spec.objective}={value}  tasks={trial.tasks_completed}  {trial.status:<8} "
              f"{params}", file=stream)
    if outcome.best is not None:
        print(f"best trial: {outcome.best.trial_id} ({spec.objective} = {outcome.best.objective:.4f}); run "
              f"directory {outcome.best.run_dir}", file=stream)
    print(f"search directory: {spec.experiment_path}  (compat compare {spec.experiment_path}; resume with "
          f"compat tune --resume {spec.experiment_path})", file=stream)
