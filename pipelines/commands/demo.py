"""`compat demo`: the README's main job: ER vs d-Simplex-HOC with replacements on the offline glyph set."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

HELP = "run the glyph demo (ER and d-Simplex-HOC, 7 tasks, replacements at tasks 3 and 5) and print the results"

DEMOS = (("er", "demo-er.yaml"), ("dsimplex-hoc", "demo-dsimplex-hoc.yaml"))


def configs_dir() -> Path:
    """configs/ of the checkout (next to the pipelines package)."""
    return Path(__file__).resolve().parents[2] / "configs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="runs/demo", help="parent folder of the two runs (default runs/demo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a value in both demo configs (YAML-parsed; repeatable)")
    parser.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    from pipelines.commands.run import print_results
    from pipelines.config import load_config
    from pipelines.executor import LocalExecutor
    from pipelines.graph import compile_scenario
    from pipelines.store import RunStore

    results = []
    for name, file_name in DEMOS:
        config = load_config(configs_dir() / file_name, args.overrides)
        run_dir = f"{args.output.rstrip('/')}/{name}"
        started = time.perf_counter()
        summary = LocalExecutor(progress=not args.no_progress).run(compile_scenario(config), RunStore(run_dir))
        results.append((name, run_dir, summary, time.perf_counter() - started))
    for name, run_dir, summary, seconds in results:
        print(f"\n== {name}: {run_dir} ({seconds:.0f} s) ==")
        print_results(summary.matrix, summary.metrics)
    return 0
