"""`compat plan CONFIG [--set ...]`: print the stage graph, resources, feature storage and matrix cost."""
from __future__ import annotations

import argparse
import sys

HELP = "print a scenario's stage graph, resources per stage, feature storage and matrix cost (no compute)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="scenario YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value (YAML-parsed; repeatable)")


def run(args) -> int:
    from pipelines.config import ConfigError, load_config
    from pipelines.graph import compile_scenario, describe

    try:
        config = load_config(args.config, args.overrides)
    except (ConfigError, ValueError, FileNotFoundError) as error:
        print(f"refused: {error}", file=sys.stderr)
        return 2
    print(describe(compile_scenario(config)))
    return 0
