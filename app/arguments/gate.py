"""Arguments of ``compat gate`` (the command itself is :mod:`app.commands.gate`): argparse only,
so that ``compat gate --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse

from compat_core.kinds import ADAPTER_KINDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("words", nargs="+", metavar="[history|rollback] MODEL",
                        help="registered model name, optionally preceded by 'history' or 'rollback'")
    parser.add_argument("--candidate", metavar="VERSION", help="model version to gate (required for a gate)")
    parser.add_argument("--config", metavar="YAML", help="scenario config whose evaluation section is the held-out "
                        "query/gallery set (e.g. a run's config.yaml); required for a gate")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value (YAML-parsed; repeatable)")
    parser.add_argument("--alias", default="champion", help="registry alias to guard (default: champion)")
    parser.add_argument("--adapter", choices=ADAPTER_KINDS,
                        help="fit this adapter on paired gallery features and gate with it applied")
    parser.add_argument("--non-strict", action="store_true", help="criterion >= instead of > (default: the "
                        "config's evaluation.strict)")
    parser.add_argument("--dry-run", action="store_true", help="decide and record, never move the alias")
    parser.add_argument("--to", dest="to_version", metavar="VERSION", help="rollback target version")
    parser.add_argument("--reason", default="", help="rollback reason recorded in MLflow")
    parser.add_argument("--force", action="store_true", help="rollback: install a version the gate refused or one "
                                                             "that never held the alias (recorded as forced)")
    parser.add_argument("--index", dest="indexes", action="append", default=[], metavar="ROOT",
                        help="rollback: a gallery index the alias serves (the ROOT of `compat serve ROOT`; "
                             "repeatable), besides those `compat index build` recorded on the model: the target is "
                             "refused unless every one can be served with it")
    parser.add_argument("--tracking-uri", default=None, metavar="URI",
                        help="MLflow tracking server (default: $MLFLOW_TRACKING_URI, else the machine's store where "
                             "compat run registers its models; see compat ui)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
