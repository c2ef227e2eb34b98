"""``compat gate``: a compatibility gate on MLflow registry aliases (logic: :mod:`cluster.model_registry.gate`).

- ``compat gate MODEL --candidate VERSION --config CONFIG [--alias champion] [--adapter KIND] [--non-strict]
  [--dry-run]``: evaluate the candidate against the version behind the alias on the config's evaluation sets
  (override with ``--set evaluation.query_set.split=...``), move the alias only when M(new, old) > M(old, old).
  Exit 0 when promoted (or a dry run passes, or the candidate already holds the alias), 1 when refused, 2 on bad
  input.
- ``compat gate history MODEL [--alias champion]``: every gate decision and rollback of the alias, oldest first.
- ``compat gate rollback MODEL [--alias champion] [--to VERSION] [--reason TEXT] [--force] [--index ROOT ...]``:
  move the alias back to the version it pointed to before its last move (or to ``--to``, a version that held the
  alias before; another one, or one the gate refused, only with ``--force``); the target is loaded and compared
  with the version behind the alias first (feature width and kind) and, for each ``--index`` (a gallery index the
  alias serves, as ``compat serve ROOT``), with what that index's HEAD was built with (model, width, search kind,
  the kind of every version whose rows it holds, the target's installed adapter); recorded like a decision.
- A gate of the version already behind the alias changes nothing (decision ``unchanged``, exit 0).

The tracking server: ``--tracking-uri`` (``http(s)://HOST:PORT`` or ``sqlite:///PATH``), default
``$MLFLOW_TRACKING_URI``, else the machine's store (resolved by app.dispatch, cluster.tracking.store). Numbers are
fractions.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from cluster.model_registry.alias_moves import alias_history
from compat_core.evaluation.metrics import criterion_sign
from pipelines.config.load import load_config

_ACTIONS = ("history", "rollback")
# the gate itself embeds images with the models and a rollback loads its target (torch): imported by name only
# for those, so that `compat gate history` imports no torch
GATE_MODULE = "cluster.model_registry.gate"


def _fail(message: str) -> int:
    print(f"compat gate: error: {message}", file=sys.stderr)
    return 2


def _print_gate(result) -> None:
    print(f"gate {result.model} v{result.candidate_version} -> alias {result.alias!r} "
          f"(behind it: {'v' + result.champion_version if result.champion_version else 'nothing'}); "
          f"criterion M(new, old) {criterion_sign(result.strict)} M(old, old), fractions")
    if result.values:
        columns = [name for name in result.values[result.metric]]
        print(f"  {'metric':<12}" + "".join(f"{name:>18}" for name in columns))
        for metric, parts in result.values.items():
            print(f"  {metric:<12}" + "".join(f"{parts[name]:>18.4f}" for name in columns))
        print(f"  margin M(new, old) - M(old, old) on {result.metric}: {result.verdict['margin']:+.4f}; "
              f"full re-indexing gains {result.verdict['reindex_margin']:+.4f}")
    print(f"decision: {result.decision}: {result.reason}")
    for line in result.advice:
        print(f"  what to do: {line}")
    print(f"recorded: gate run {result.run_id} (experiment compat-gate)")


def run(args: argparse.Namespace) -> int:
    words = list(args.words)
    action = words.pop(0) if words[0] in _ACTIONS else "gate"
    if len(words) != 1:
        return _fail(f"expected exactly one MODEL after {action!r}, got {words}")
    model = words[0]

    tracking_uri = args.tracking.uri
    if tracking_uri is None:
        return _fail("--tracking-uri none: the gate reads and records in an MLflow registry; name one")
    try:
        if action == "history":
            rows = alias_history(tracking_uri, model, args.alias)
            if args.json:
                print(json.dumps(rows, indent=2))
                return 0
            print(f"alias {args.alias!r} of {model}: {len(rows)} recorded decisions (oldest first)")
            for row in rows:
                margin = "" if row["margin"] is None else f" margin {row['margin']:+.4f}"
                print(f"  {row['time']}  {row['action']:<8} v{row['candidate_version']:<4} {row['decision']:<15} "
                      f"alias v{row['previous_version'] or '-'} -> v{row['new_version'] or '-'}"
                      f"{' adapter ' + row['adapter'] if row['adapter'] else ''}{margin}  {row['reason']}")
            return 0
        if action == "rollback":
            gate = importlib.import_module(GATE_MODULE)
            moved = gate.rollback(tracking_uri, model, args.alias, args.to_version, args.reason, force=args.force,
                                  log=lambda line: print(line, file=sys.stderr), indexes=tuple(args.indexes))
            print(json.dumps(moved) if args.json else
                  f"rolled back alias {args.alias!r} of {model}: v{moved['from_version']} -> v{moved['to_version']} "
                  f"{'FORCED over the gate refusal ' if moved['forced'] else ''}(recorded: run {moved['run_id']})")
            return 0
        if not args.candidate or not args.config:
            return _fail("a gate needs --candidate VERSION and --config YAML (the held-out evaluation sets)")

        config = load_config(args.config, args.overrides)
        gate = importlib.import_module(GATE_MODULE)
        result = gate.run_gate(tracking_uri, model, args.candidate, config, args.alias, args.adapter,
                               strict=False if args.non_strict else None, dry_run=args.dry_run,
                               log=lambda line: print(line, file=sys.stderr))
    except (ValueError, FileNotFoundError, KeyError) as error:
        return _fail(str(error.args[0] if error.args else error))
    if args.json:
        from dataclasses import asdict

        print(json.dumps(asdict(result), indent=2))
    else:
        _print_gate(result)
    return 0 if result.decision in ("promoted", "unchanged", "dry-run-pass") else 1
