"""`compat run CONFIG [--set KEY=VALUE ...] [--resume RUN_DIR] [--output DIR]`: run a scenario end to end."""
from __future__ import annotations

import argparse
import json
import os
import sys

from pipelines.redaction import redact_uri

HELP = "run a scenario (train, replace, extract, evaluate); resumable: completed stages are skipped"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="scenario YAML (optional with --resume: the run's config.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set training.epochs=5 (YAML-parsed; repeatable)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR, skipping committed stages")
    parser.add_argument("--output", metavar="DIR", help="run directory (local path or s3:// URI); "
                                                         "default: the config's output.dir")
    parser.add_argument("--executor", choices=("local", "ray"), default="local", help="where stages run")
    parser.add_argument("--address", default=None, help="Ray address for --executor ray (auto | ray://... | http://...)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")
    parser.add_argument("--recompute", action="append", default=[], metavar="KEY",
                        help="with --resume: compute this committed stage again (a unique prefix of its key, as "
                             "printed by an integrity error); repeatable")
    parser.add_argument("--experiment", default=None, metavar="NAME",
                        help="MLflow experiment (default: $MLFLOW_EXPERIMENT_NAME, else the scenario name); put "
                             "runs you compare (e.g. ER and d-Simplex-HOC) in one experiment")
    parser.add_argument("--tracking-uri", default=None, metavar="URI",
                        help="MLflow tracking: sqlite:///PATH or http(s)://HOST:PORT; 'none' disables it; default: "
                             "$MLFLOW_TRACKING_URI, else the machine's one store (~/.local/share/compat/mlflow; "
                             "`compat ui` shows it)")


def resolve_run(args) -> tuple[object, str]:
    """(validated config, run directory) from CONFIG / --resume / --output / --set."""
    from compat_core import io as cio
    from pipelines.config_load import ConfigError, load_config
    from pipelines.local_paths import absolute_location

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


def make_executor(kind: str = "local", address: str | None = None, emit=None, progress: bool = True,
                  num_cpus: int | None = None, setup=None):
    """LocalExecutor, or cluster.ray_executor.RayExecutor for kind "ray" (imported only then: pipelines never needs
    ray at import time). ``emit`` receives every record; num_cpus: CPUs of an embedded Ray instance (Ray only);
    setup: picklable callable run in a Ray worker before each node (e.g. MLflow URI resolvers)."""
    if kind == "ray":
        try:
            from cluster.ray_executor import RayExecutor
        except ImportError as error:
            raise SystemExit(f"--executor ray needs the cluster package and ray installed ({error}); "
                             f"install the project's cluster extras or use --executor local") from None
        kwargs = {"num_cpus": num_cpus} if num_cpus is not None else {}
        return RayExecutor(address=address, emit=emit, progress=progress, setup=setup, **kwargs)
    if address:
        raise SystemExit("--address applies to --executor ray only")
    from pipelines.executor import LocalExecutor

    return LocalExecutor(emit=emit, progress=progress)


def run_tracked(graph, store, tracker, kind: str = "local", address: str | None = None, progress: bool = True,
                sinks: tuple = (), num_cpus: int | None = None, setup=None, label: str = "", on_executor=None):
    """Run ``graph`` on the chosen executor inside the tracker's pipeline scope; every record goes to the progress
    display (bars when ``progress`` and on a terminal, else flushed lines, prefixed with ``label`` when given), the
    tracker and ``sinks``. ``on_executor(executor)`` is called after the run (e.g. to read RayExecutor.last_stats).
    Returns the executor's Invocation."""
    from pipelines.progress import ProgressReporter

    emit = ProgressReporter(enabled=progress, sinks=[tracker, *sinks], label=label)
    executor = make_executor(kind, address, emit, progress, num_cpus, setup)
    with tracker.pipeline(graph, store):
        summary = executor.run(graph, store)
    if on_executor is not None:
        on_executor(executor)
    return summary


def model_sources_setup(config, tracking_uri: str | None):
    """When ``initial_model`` or a replacement source is an MLflow ``models:/`` or ``runs:/`` URI, register the MLflow
    URI resolvers in this process and return the same registration as a setup callable for Ray workers; else None.

    The registry is the one of ``--tracking-uri`` (else ``MLFLOW_TRACKING_URI``); a ConfigError names the source
    when neither is given."""
    import functools

    from pipelines.config_load import ConfigError

    sources = {f"replacements[{i}].source": r.source for i, r in enumerate(config.replacements)}
    sources["initial_model"] = config.initial_model or ""
    mlflow_sources = {key: uri for key, uri in sources.items() if uri.startswith(("models:/", "runs:/"))}
    if not mlflow_sources:
        return None
    uri = tracking_uri if tracking_uri not in (None, "none") else os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        key, source = next(iter(mlflow_sources.items()))
        raise ConfigError(f"{key}: {source!r} is read from an MLflow model registry; give --tracking-uri "
                          f"http(s)://HOST:PORT (or set MLFLOW_TRACKING_URI) naming the server that holds it")
    from cluster.registry import register_mlflow_resolvers

    register_mlflow_resolvers(uri)
    return functools.partial(register_mlflow_resolvers, uri)


def pin_model_aliases(config, tracking_uri: str | None):
    """``models:/NAME@ALIAS`` sources rewritten as ``models:/NAME/VERSION`` (the version the alias names now), so
    the stage keys hash immutable content: moving the alias later never reuses stages trained from the old
    version, and config.yaml records which version was used. Other configs are returned unchanged."""
    import re

    pattern = re.compile(r"^models:/(?P<name>[^/@]+)@(?P<alias>[A-Za-z0-9_-]+)/?$")
    if not any(pattern.match(r.source) for r in config.replacements) and not pattern.match(config.initial_model or ""):
        return config
    from mlflow import MlflowClient

    from cluster.registry import version_by_alias

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    def pinned(key: str, source: str) -> str:
        match = pattern.match(source or "")
        if match is None:
            return source
        found = version_by_alias(client, match["name"], match["alias"])
        if found is None:
            raise FileNotFoundError(f"{key}: registered model {match['name']!r} has no alias {match['alias']!r} "
                                    f"on {redact_uri(tracking_uri)}")
        return f"models:/{match['name']}/{found.version}"

    replacements = [r.model_copy(update={"source": pinned(f"replacements[{i}].source", r.source)})
                    for i, r in enumerate(config.replacements)]
    return config.model_copy(update={"replacements": replacements,
                                     "initial_model": pinned("initial_model", config.initial_model)})


def make_tracker(args, run_dir: str):
    """The MLflow tracker for this run (cluster.tracking; 'none' gives a no-op tracker). A run directory on S3 has
    no place for the default SQLite file, so it tracks only with an explicit --tracking-uri or MLFLOW_TRACKING_URI."""
    from compat_core import io as cio
    from cluster.tracking import create_tracker

    uri = getattr(args, "tracking_uri", None)
    address = getattr(args, "address", None) or ""
    if getattr(args, "executor", "local") == "ray" and address.startswith(("http://", "https://")):
        return create_tracker("none")  # the submitted job runs `compat run` itself and tracks there
    if uri is None and cio.is_remote(run_dir) and not os.environ.get("MLFLOW_TRACKING_URI"):
        print(f"note: run directory {run_dir} is remote; MLflow tracking is off (give --tracking-uri to track)",
              file=sys.stderr)
        uri = "none"
    experiment = getattr(args, "experiment", None) or os.environ.get("MLFLOW_EXPERIMENT_NAME") or None
    return create_tracker(uri, run_dir=run_dir, experiment=experiment)


def preflight_data(config, run_dir: str | None = None, executor: str = "local") -> None:
    """Before any stage: every pool opens, every weights source loads strictly, the device exists and the run
    bucket exists (pipelines.preflight), so a run never trains for hours and then stops. On Ray the device is
    judged by the cluster (the backend checks every stage's resources before the first starts)."""
    from pipelines.preflight import preflight

    preflight(config, run_dir, check_device=executor == "local")


def uses_object_storage(config, run_dir: str) -> bool:
    """True when the run directory or any data root is an s3:// URI."""
    return str(run_dir).startswith("s3://") or "s3://" in json.dumps(config.model_dump(mode="json"), default=str)


def run(args) -> int:
    from pipelines.config_load import ConfigError
    from pipelines.graph import compile_scenario
    from pipelines.store import RunStore

    if any(str(value or "").startswith("s3://") for value in (args.resume, args.config, args.output)):
        # configure before the first read (--resume reads the run's config.yaml from the bucket)
        from cluster.storage import configure_object_storage

        configure_object_storage()
    try:
        config, run_dir = resolve_run(args)
        setup = model_sources_setup(config, args.tracking_uri)
        if setup is not None:
            config = pin_model_aliases(config, setup.args[0])
    except (ConfigError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if uses_object_storage(config, run_dir):
        from cluster.storage import configure_object_storage, installed_access

        if installed_access() is None:  # not yet configured for an s3:// --resume / CONFIG / --output
            configure_object_storage()  # S3 settings and credentials from the standard AWS chain, never the YAML
    if not (args.address or "").startswith(("http://", "https://")):  # a submitted job checks on the cluster
        try:
            preflight_data(config, run_dir, args.executor)
        except (FileNotFoundError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    from pipelines.lease import run_lease

    with run_lease(run_dir):  # one writer per run folder, taken before tracking or any stage
        store = RunStore(run_dir)
        for prefix in args.recompute:
            key = store.resolve_key(prefix)
            store.forget(key)
            print(f"recompute: stage {key} uncommitted; it runs again", file=sys.stderr)
        try:
            tracker = make_tracker(args, run_dir)
        except ValueError as error:
            print(f"error: --tracking-uri: {error}", file=sys.stderr)
            return 2
        summary = run_tracked(compile_scenario(config), store, tracker, args.executor, args.address,
                              progress=not args.no_progress, setup=setup)
    print(f"run directory: {run_dir} ({len(summary.executed)} stages run, {len(summary.skipped)} already done)")
    if getattr(tracker, "tracking_uri", None):
        print(f"MLflow: {redact_uri(tracker.tracking_uri)} (experiment {tracker.experiment_name or config.name}, "
              f"registered model {tracker.model_name or '-'})")
    if summary.matrix is not None:
        print_results(summary.matrix, summary.metrics)
    return 0


def print_results(matrix: dict, metrics: dict, stream=None) -> None:
    """Print the matrix (fractions, '-' above the diagonal) and the scalar metrics."""
    stream = stream or sys.stdout
    values = matrix["values"]
    print(f"compatibility matrix ({matrix['metric']}, fractions; rows = query model, columns = gallery model):",
          file=stream)
    print("        " + " ".join(f"{j + 1:>6}" for j in range(len(values))), file=stream)
    for i, row in enumerate(values):
        cells = " ".join("     -" if v is None else f"{v:6.3f}" for v in row)
        print(f"  {i + 1:>4}  {cells}", file=stream)
    scalars = {k: metrics.get(k) for k in ("AC", "AA", "ACA", "BC", "FC")}
    print("metrics (fractions): " + json.dumps(scalars), file=stream)
