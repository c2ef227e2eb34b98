"""`compat eval RUN_DIR [--gallery ...] [--metric ...] [--label-level ...]`: protocol variants from stored features.

Nothing is re-extracted: entries are computed from the features committed by the run (and committed themselves,
so asking for the same variant twice computes nothing). Writes ``eval-<variant>/matrix.json`` and ``metrics.json``
in the run directory unless the variant equals the run's own protocol.
"""
from __future__ import annotations

import argparse
import json
import sys

HELP = "recompute the matrix and metrics of a finished run under another protocol, from its stored features"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory written by `compat run`")
    parser.add_argument("--gallery", choices=("instances", "class_means"), help="gallery of instances or class means")
    parser.add_argument("--metric", choices=("recall_at_1", "map", "verification", "tar_at_far"))
    parser.add_argument("--label-level", choices=("fine", "coarse"))
    parser.add_argument("--strict", choices=("true", "false"), help="compatibility criterion > (true) or >= (false)")


def evaluate_variant(run_dir: str, overrides: dict) -> tuple[dict, dict, str]:
    """(matrix dict, metrics dict, output sub-folder or '') for the run under ``overrides`` of its evaluation."""
    from compat_core.metrics import CompatibilityMatrix
    from pipelines.config import validate_config
    from pipelines.executor import compute_metrics
    from pipelines.graph import compile_scenario, entry_key, protocol_params
    from pipelines.stages import compute_entry
    from pipelines.store import RunStore, read_features

    import numpy as np
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
    varied = validate_config({**document, "evaluation": evaluation}, "evaluation variant")
    protocol = protocol_params(evaluation)
    T = config.num_tasks
    values = np.full((T, T), np.nan)
    counts = {}
    for row in range(T):
        query_key = graph.extract_stages[(row, "query")]
        query = None
        for column in range(row + 1):
            gallery_key = graph.extract_stages[(column, "gallery")]
            key = entry_key(query_key, gallery_key, protocol, row, column)
            if store.has(key):
                values[row, column] = store.load_record(key)["value"]
                continue
            query = query if query is not None else read_features(store, query_key)
            value = compute_entry(query, read_features(store, gallery_key), protocol, varied,
                                  store.load_record(query_key).get("num_classes_model", 0),
                                  store.load_record(gallery_key).get("num_classes_model", 0))
            store.commit(key, {"type": "entry", "row": row, "column": column, "value": value, "query": query_key,
                               "gallery": gallery_key, "protocol": protocol})
            values[row, column] = value
            counts["computed"] = counts.get("computed", 0) + 1
    protocol_named = {**protocol, "strict": varied.evaluation.strict}
    matrix = CompatibilityMatrix(values, [f"task-{t + 1}" for t in range(T)], protocol["metric"], protocol_named)
    metrics = compute_metrics(matrix, varied.evaluation.strict)
    same = protocol == protocol_params(config.evaluation.model_dump(mode="json")) and \
        varied.evaluation.strict == config.evaluation.strict
    folder = "" if same else "eval-" + "-".join(f"{protocol[k]}" for k in ("metric", "gallery", "label_level")) + \
        ("" if varied.evaluation.strict else "-nonstrict")
    prefix = f"{folder}/" if folder else ""
    store.write_text(f"{prefix}matrix.json", matrix.to_json())
    store.write_text(f"{prefix}metrics.json", json.dumps(metrics, indent=2, allow_nan=False))
    return matrix.to_dict(), metrics, folder


def run(args) -> int:
    from pipelines.commands.run import print_results

    overrides = {"gallery": args.gallery, "metric": args.metric, "label_level": args.label_level,
                 "strict": None if args.strict is None else args.strict == "true"}
    try:
        matrix, metrics, folder = evaluate_variant(args.run_dir, overrides)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"written to {args.run_dir}/{folder + '/' if folder else ''}matrix.json and metrics.json")
    print_results(matrix, metrics)
    return 0
