"""`compat eval RUN_DIR [--gallery ...] [--metric ...] [--label-level ...]`: protocol variants from stored features.

Nothing is re-extracted: entries are computed from the features committed by the run (and committed themselves,
so asking for the same variant twice computes nothing). Writes ``eval-<variant>/matrix.json`` and ``metrics.json``
in the run directory unless the variant equals the run's own protocol.
"""
from __future__ import annotations

import argparse
import json
import sys

from app.printing import print_results
from cluster.storage import configure_object_storage
from pipelines.config_load import validate_config
from pipelines.executor import LocalExecutor, assemble_matrix, compute_metrics
from pipelines.graph import add_evaluation, compile_scenario, protocol_params
from pipelines.lease import RunFolderBusyError, run_lease
from pipelines.store import RunStore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory written by `compat run`")
    parser.add_argument("--gallery", choices=("instances", "class_means"), help="gallery of instances or class means")
    parser.add_argument("--metric", choices=("recall_at_1", "map", "verification", "tar_at_far"))
    parser.add_argument("--label-level", choices=("fine", "coarse"))
    parser.add_argument("--strict", choices=("true", "false"), help="compatibility criterion > (true) or >= (false)")


def evaluate_variant(run_dir: str, overrides: dict) -> tuple[dict, dict, str]:
    """(matrix dict, metrics dict, output sub-folder or '') for the run under ``overrides`` of its evaluation.

    The run's graph is recompiled with the other protocol added (:func:`pipelines.graph.add_evaluation`) and the
    engine runs only the new entry and row nodes (the same entry function as ``compat run``, FAN adapters included).
    """
    import yaml

    store = RunStore(run_dir)
    document = yaml.safe_load(store.read_text("config.yaml"))
    config = validate_config(document, f"{run_dir}/config.yaml")
    graph = compile_scenario(config)
    missing = [key for key in graph.extract_stages.values() if not store.has(key)]
    if missing:
        raise FileNotFoundError(f"{run_dir}: {len(missing)} feature extractions are not committed (e.g. {missing[0]}); "
                                f"finish the run first with `compat run --resume {run_dir}`")
    evaluation = config.evaluation.model_dump(mode="json")
    evaluation.update({k: v for k, v in overrides.items() if v is not None})
    varied = validate_config({**document, "evaluation": evaluation}, "evaluation variant").evaluation
    rows = add_evaluation(graph, evaluation)
    LocalExecutor(progress=False).run(graph, store, until=rows)
    matrix = assemble_matrix(graph, store, rows, varied)
    metrics = compute_metrics(matrix, varied.strict)
    protocol = protocol_params(evaluation)
    same = rows == graph.evaluate_stages and varied.strict == config.evaluation.strict
    folder = "" if same else "eval-" + "-".join(f"{protocol[k]}" for k in ("metric", "gallery", "label_level")) + \
        ("" if varied.strict else "-nonstrict")
    prefix = f"{folder}/" if folder else ""
    store.write_text(f"{prefix}matrix.json", matrix.to_json())
    store.write_text(f"{prefix}metrics.json", json.dumps(metrics, indent=2, allow_nan=False))
    return matrix.to_dict(), metrics, folder


def run(args) -> int:
    overrides = {"gallery": args.gallery, "metric": args.metric, "label_level": args.label_level,
                 "strict": None if args.strict is None else args.strict == "true"}

    try:
        if str(args.run_dir).startswith("s3://"):
            configure_object_storage()  # S3 settings and credentials from the standard AWS chain (profiles too)
        with run_lease(str(args.run_dir)):  # it writes into the run folder: never beside a running driver
            matrix, metrics, folder = evaluate_variant(args.run_dir, overrides)
    except (FileNotFoundError, ValueError, RunFolderBusyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"written to {args.run_dir}/{folder + '/' if folder else ''}matrix.json and metrics.json")
    print_results(matrix, metrics)
    return 0
