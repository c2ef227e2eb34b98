"""`compat run CONFIG [--set KEY=VALUE ...] [--resume RUN_DIR] [--output DIR]`: run a scenario end to end."""
from __future__ import annotations

import os
import shlex
import sys

from app.printing import print_results
from cluster.executors import EXECUTORS
from cluster.run_driver import model_sources_setup, pin_model_aliases, run_tracked, submits_job
from cluster.storage.s3 import configure_object_storage, installed_access, uses_object_storage
from cluster.tracking.run_identity import AS_WRITTEN, check_run_name, run_intent, scoped_alias
from cluster.tracking.tracker import create_tracker
from compat_core import io as cio
from pipelines.config.load import ConfigError, load_config
from pipelines.config.local_paths import absolute_location
from pipelines.config.preflight import preflight
from pipelines.config.redaction import redact_uri
from pipelines.config.run_origin import RunOrigin
from pipelines.engine.runner import prepare_run
from pipelines.graph.compile import compile_scenario
from pipelines.stages.run_precision import resolve_run_precision
from pipelines.store.lease import run_lease
from pipelines.store.run_store import RunStore
from pipelines.training.settings import precision_name


def resolve_run(args) -> tuple[object, str]:
    """(validated config, run directory) from CONFIG / --resume / --output / --set."""
    if args.resume:
        config_path = args.config or cio.join(args.resume, "config.yaml")
        if not cio.exists(config_path):
            raise ConfigError(f"--resume {args.resume}: no config.yaml there; give the scenario CONFIG as well")
        output = args.resume
    else:
        if not args.config:
            raise ConfigError("CONFIG is required (or --resume RUN_DIR)")
        config_path, output = args.config, None
    config = load_config(config_path, args.overrides)
    if args.output:
        output = args.output
    return config, absolute_location(output or config.output_dir())


def run_origin(args) -> RunOrigin:
    """The command line and overrides config.yaml records: those of ``compat submit`` for a submitted job (its
    hidden ``--origin-command`` / ``--origin-set``), else this command's own."""
    if getattr(args, "origin_command", None):
        return RunOrigin(tuple(shlex.split(args.origin_command)), tuple(args.origin_set))
    return RunOrigin.of_command(getattr(args, "argv", None) or [], args.overrides)


def make_tracker(args, run_dir: str, config=None):
    """The MLflow tracker for this run on ``args.tracking`` (resolved by app.dispatch; off: a no-op tracker). A run
    directory on S3 tracks only into a store named with --tracking-uri or MLFLOW_TRACKING_URI, never into this
    machine's store by default. ``config`` (the validated config): judged against the file it came from, it says
    whether ``--set`` changed what the file computes (then the run moves only its own registry aliases)."""
    uri = args.tracking.uri
    address = getattr(args, "address", None) or ""
    if getattr(args, "executor", "local") == "ray" and address.startswith(("http://", "https://")):
        return create_tracker(None)  # the submitted job runs `compat run` itself and tracks there
    if uri is not None and not args.tracking.explicit and cio.is_remote(run_dir):
        print(f"note: run directory {run_dir} is remote; MLflow tracking is off (give --tracking-uri to track)",
              file=sys.stderr)
        uri = None
    experiment = getattr(args, "experiment", None) or os.environ.get("MLFLOW_EXPERIMENT_NAME") or None
    intent = run_intent(args.config or cio.join(args.resume, "config.yaml"), args.overrides, config) \
        if config is not None else AS_WRITTEN
    return create_tracker(uri, experiment=experiment, intent=intent, run_name=getattr(args, "run_name", None))


def preflight_data(config, run_dir: str | None = None, executor: str = "local") -> None:
    """Before any stage: every pool opens, every weights source loads strictly, the device exists and the run
    bucket exists (pipelines.config.preflight), so a run never trains for hours and then stops. On a cluster
    executor (Ray) the device is judged by the cluster (the backend checks every stage's resources before the first
    starts)."""
    preflight(config, run_dir, check_device=not EXECUTORS.get(executor).on_cluster)


def run(args) -> int:
    if any(str(value or "").startswith("s3://") for value in (args.resume, args.config, args.output)):
        # configure before the first read (--resume reads the run's config.yaml from the bucket)

        configure_object_storage()
    try:
        if getattr(args, "run_name", None) is not None:
            check_run_name(args.run_name)
        config, run_dir = resolve_run(args)
        setup = model_sources_setup(config, args.tracking.uri)
        if setup is not None:
            config = pin_model_aliases(config, setup.args[0])
    except (ConfigError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if uses_object_storage(config, run_dir):
        if installed_access() is None:  # not yet configured for an s3:// --resume / CONFIG / --output
            configure_object_storage()  # S3 settings and credentials from the standard AWS chain, never the YAML
    if not (args.address or "").startswith(("http://", "https://")):  # a submitted job checks on the cluster
        try:
            preflight_data(config, run_dir, args.executor)
            config = resolve_run_precision(config)  # once, here, before any stage (a submitted job resolves there)
        except (FileNotFoundError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2

    with run_lease(run_dir):  # one writer per run folder, taken before tracking or any stage
        store = RunStore(run_dir)
        for prefix in args.recompute:
            key = store.resolve_key(prefix)
            store.forget(key)
            print(f"recompute: stage {key} uncommitted; it runs again", file=sys.stderr)
        graph = compile_scenario(config)
        graph.origin = run_origin(args)
        if not submits_job(args.executor, args.address):  # a submitted job judges it on the cluster
            try:
                prepare_run(graph, store)  # a grown config recorded, any other change refused: before tracking
            except ValueError as error:
                print(f"error: {error}", file=sys.stderr)
                return 2
        tracker = make_tracker(args, run_dir, config)
        summary = run_tracked(graph, store, tracker, args.executor, args.address,
                              progress=not args.no_progress, setup=setup)
    print(f"run directory: {run_dir} ({len(summary.executed)} stages run, {len(summary.skipped)} already done; "
          f"precision {precision_name(config.training.autocast)}, code {graph.code_version})")
    if getattr(tracker, "tracking_uri", None):
        print(f"MLflow: {redact_uri(tracker.tracking_uri)} (experiment {tracker.experiment_name or config.name}, "
              f"registered model {tracker.model_name or '-'})")
        if tracker.model_name:
            bare = " and the scenario's bare aliases" if tracker.scenario_aliases else \
                " (--set changed the config: the scenario's bare aliases stay where they are)"
            print(f"aliases of this run: models:/{tracker.model_name}@{scoped_alias(tracker.run_name, 'task-N')}, "
                  f"@{scoped_alias(tracker.run_name, 'latest-task')}{bare}")
    if summary.matrix is not None:
        print_results(summary.matrix, summary.metrics)
    return 0
