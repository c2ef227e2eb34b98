"""`compat run CONFIG [--set KEY=VALUE ...] [--resume RUN_DIR] [--output DIR]`: run a scenario end to end."""
from __future__ import annotations

import argparse
import json
import sys

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


def resolve_run(args) -> tuple[object, str]:
    """(validated config, run directory) from CONFIG / --resume / --output / --set."""
    from compat_core import io as cio
    from pipelines.config import ConfigError, load_config

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
    return config, output or config.output_dir()


def make_executor(args):
    if getattr(args, "executor", "local") == "ray":
        try:
            from cluster.executor import RayExecutor  # provided by the cluster package
        except ImportError as error:
            raise SystemExit(f"--executor ray needs the cluster package's RayExecutor: {error}") from None
        return RayExecutor(address=args.address)
    from pipelines.executor import LocalExecutor

    return LocalExecutor(progress=not args.no_progress)


def run(args) -> int:
    from pipelines.config import ConfigError
    from pipelines.graph import compile_scenario
    from pipelines.store import RunStore

    try:
        config, run_dir = resolve_run(args)
    except (ConfigError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    graph = compile_scenario(config)
    store = RunStore(run_dir)
    summary = make_executor(args).run(graph, store)
    print(f"run directory: {run_dir} ({len(summary.executed)} stages run, {len(summary.skipped)} already done)")
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
