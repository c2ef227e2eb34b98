"""Protocol variants of a finished run (``compat eval``): the run's graph recompiled with another evaluation
protocol, only the new entry and row nodes run from the committed features (nothing is re-extracted), and the
variant's result written to ``eval-<variant>/`` (or to the run directory itself for the run's own protocol).
"""
from __future__ import annotations

from typing import Any, Callable

import yaml

from pipelines.config.load import validate_config
from pipelines.engine.runner import LocalExecutor
from pipelines.graph.compile import add_evaluation, compile_scenario
from pipelines.results.assemble import RunResult, assemble_matrix, write_result
from pipelines.store.run_store import RunStore


def evaluate_variant(run_dir: str, overrides: dict,
                     on_run_complete: Callable[[RunStore], Any] | None = None) -> tuple[dict, dict, str]:
    """(matrix dict, metrics dict, output sub-folder or '') for the run under ``overrides`` of its evaluation.

    The run's graph is recompiled with the other protocol added (:func:`pipelines.graph.compile.add_evaluation`) and the
    engine runs only the new entry and row nodes (the same entry function as ``compat run``, FAN adapters included).
    on_run_complete(store): called when the run's whole graph is committed after that (the engine then wrote the
    run's own result files; the command writes its reports).
    """
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
    rows = add_evaluation(graph, varied)
    invocation = LocalExecutor(progress=False).run(graph, store, until=rows)
    if invocation.result is not None and on_run_complete is not None:
        on_run_complete(store)
    result = RunResult.of(assemble_matrix(graph, store, rows, varied), varied.strict)
    same = rows == graph.evaluate_stages and varied.strict == config.evaluation.strict
    folder = "" if same else f"eval-{varied.metric}-{varied.gallery}-{varied.label_level}" + \
        ("" if varied.strict else "-nonstrict")
    write_result(store, result, folder)
    return result.matrix.to_dict(), result.metrics, folder
