"""A run's results: the one record of them (:class:`RunResult`), the compatibility matrix assembled from committed
row records, its metrics, and the result files ``matrix.json`` / ``metrics.json`` of a run directory (or of a
``compat eval`` variant folder in it).

One record and one path for all of them: the engine (:func:`pipelines.engine.runner.finalize_run`, which hands the
:class:`RunResult` to the tracker and returns it in the invocation), ``compat eval``
(:mod:`pipelines.results.variants`), Tune's report after each task (:mod:`cluster.tune.trial`), a Ray Job's results
read back from its store, and the reports and ``compat compare``, which read the files back with the run's config
(:func:`pipelines.results.run_files.load_run`). Values are fractions; metrics undefined on the matrix (e.g. pair
metrics of one model) are ``None`` (``null`` in metrics.json).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from compat_core.evaluation.metrics import (
    CompatibilityMatrix,
    empirical_compatibility,
    metrics_by_task,
    summary_metrics,
)
from pipelines.config.schema import EvaluationSpec
from pipelines.training.settings import precision_name
from pipelines.graph.compile import StageGraph
from pipelines.records.stage_records import read_record
from pipelines.store.run_store import RunStore

MATRIX_FILE = "matrix.json"
METRICS_FILE = "metrics.json"
HEADLINE_METRICS = ("AC", "AA", "ACA", "BC", "FC")


@dataclass(frozen=True)
class RunResult:
    """A complete run's results, the one record the engine returns and emits, the result files hold, the reports show,
    ``compat compare`` lines up and a remote run (Ray Job, Tune trial) hands back.

    matrix: T x T fractions, NaN above the diagonal. metrics: the metrics.json document (fractions; ``None`` where
    undefined, e.g. pair metrics of one model). config: the resolved scenario as plain data (config.yaml), when
    known. run_dir: the local folder it was read from (a run directory or its ``eval-*`` variant folder), when read
    from one. name: the run's name (the config's; ``<run>/<folder>`` for a variant). source: where it was loaded
    from (a run directory, a trial of a search); label: its display name among compared runs (default ``name``).
    warnings: inconsistencies found while reading it (shown in the report, never silently dropped).
    """

    matrix: CompatibilityMatrix
    metrics: dict[str, Any]
    config: dict[str, Any] | None = None
    run_dir: Path | None = None
    name: str = ""
    source: str = ""
    label: str = ""
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, matrix: CompatibilityMatrix, strict: bool, config: dict[str, Any] | None = None) -> "RunResult":
        """The result of ``matrix`` with its metrics under the ECC criterion ``strict`` (``>`` when True)."""
        name = str((config or {}).get("name") or "")
        return cls(matrix, compute_metrics(matrix, strict), config, name=name)

    # ---- what the reports read ------------------------------------------------------------------------------------
    @property
    def display_name(self) -> str:
        """``label``, else ``name``: how compare tables and plots name the run."""
        return self.label or self.name

    @property
    def precision(self) -> str | None:
        """fp32 | bf16 | fp16 the run trained and extracted in (its resolved ``training.autocast``), None when the
        config is unknown."""
        training = (self.config or {}).get("training") or {}
        return precision_name(training["autocast"]) if "autocast" in training else None

    @property
    def compiled(self) -> str | None:
        """on | off: whether the run's training steps ran compiled (its resolved ``training.compile``; off for a
        config written before the setting existed), None when the config is unknown."""
        if self.config is None:
            return None
        return str(((self.config or {}).get("training") or {}).get("compile", "off"))

    @property
    def channels_last(self) -> str | None:
        """on | off: whether the run's training steps ran in the channels_last layout (its resolved
        ``training.channels_last``; "auto" for a config written before the setting existed, which chose by device),
        None when the config is unknown."""
        if self.config is None:
            return None
        return str(((self.config or {}).get("training") or {}).get("channels_last", "auto"))

    @property
    def method(self) -> str:
        """The method's name from the config ('' when the config is unknown)."""
        method = (self.config or {}).get("method")
        return str(method.get("name", "") if isinstance(method, dict) else method or "")

    @property
    def num_tasks(self) -> int:
        """T, the number of models (rows of the matrix)."""
        return self.matrix.num_models

    @property
    def metric(self) -> str:
        """The retrieval metric of the matrix entries (e.g. recall_at_1)."""
        return self.matrix.metric

    @property
    def gallery(self) -> str:
        """Gallery protocol (``instances`` or ``class_means``) from matrix.json, ``unknown`` when not recorded."""
        return str(self.matrix.protocol.get("gallery", "unknown"))

    @property
    def headline(self) -> dict[str, float]:
        """AC, AA, ACA, BC, FC as fractions, NaN where undefined (metrics.json's null)."""
        return {key: _as_float(self.metrics.get(key)) for key in HEADLINE_METRICS}

    @property
    def ac_tau(self) -> list[float]:
        """AC over the first tau tasks, tau = 1..T (fractions, NaN undefined)."""
        return [_as_float(value) for value in self.metrics.get("AC_tau") or []]

    @property
    def aa_tau(self) -> list[float]:
        """AA over the first tau tasks, tau = 1..T (fractions, NaN undefined)."""
        return [_as_float(value) for value in self.metrics.get("AA_tau") or []]

    @property
    def replacement_sources(self) -> dict[int, str]:
        """1-based task number -> weights source of every replacement in the config, by task."""
        entries = (self.config or {}).get("replacements") or []
        return dict(sorted((int(entry["at_task"]), str(entry.get("source", ""))) for entry in entries))

    @property
    def replacement_tasks(self) -> list[int]:
        """1-based task numbers where a replacement model enters, sorted."""
        return list(self.replacement_sources)

    @property
    def failing(self) -> np.ndarray:
        """Bool (T, T), True at cross-tests (t > k, 0-based) that fail the empirical compatibility criterion."""
        T = self.num_tasks
        return np.tri(T, k=-1, dtype=bool) & ~empirical_compatibility(self.matrix.values, strict=self.matrix.strict)

    # ---- result files and their travel ----------------------------------------------------------------------------
    def matrix_json(self) -> str:
        """matrix.json text."""
        return self.matrix.to_json()

    def metrics_json(self) -> str:
        """metrics.json text (no NaN: undefined metrics are null)."""
        return json.dumps(self.metrics, indent=2, allow_nan=False)

    def to_json(self) -> str:
        """One JSON text of matrix.json's and metrics.json's content (a Tune trial's last report carries it as text,
        which Tune's loggers store without turning it into metrics)."""
        return json.dumps({"matrix": self.matrix.to_dict(), "metrics": self.metrics}, allow_nan=False)

    @classmethod
    def from_json(cls, text: Any) -> "RunResult":
        """Inverse of :meth:`to_json`; ValueError/KeyError name what is missing or malformed."""
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as error:
            raise ValueError(f"run result: expected the JSON text of RunResult.to_json, got {text!r:.80} ({error})")
        if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
            raise ValueError(f"run result: expected {{'matrix': {{...}}, 'metrics': {{...}}}}, got {text!r:.200}")
        return cls(CompatibilityMatrix.from_dict(data.get("matrix")), data["metrics"])


def _as_float(value: Any) -> float:
    return float("nan") if value is None else float(value)


def matrix_values(store: RunStore, row_keys: Sequence[str], size: int | None = None) -> np.ndarray:
    """``(size, size)`` fractions (default ``len(row_keys)``): row ``t`` from the committed row record
    ``row_keys[t]``, NaN above the diagonal and in rows not given (a leading block, as Tune reports after a task)."""
    size = len(row_keys) if size is None else size
    values = np.full((size, size), np.nan)
    for row, key in enumerate(row_keys):
        values[row, : row + 1] = read_record(store, key).values
    return values


def assemble_matrix(graph: StageGraph, store: RunStore, row_keys: list[str] | None = None,
                    evaluation: EvaluationSpec | None = None) -> CompatibilityMatrix:
    """CompatibilityMatrix (T x T fractions, NaN above the diagonal) from the committed row records.

    row_keys / evaluation: another protocol's rows and EvaluationSpec (``compat eval``); default the graph's own."""
    config = graph.config
    evaluation = evaluation or config.evaluation
    T = config.num_tasks
    values = matrix_values(store, row_keys or graph.evaluate_stages, T)
    protocol = {
        "metric": evaluation.metric,
        "gallery": evaluation.gallery,
        "label_level": evaluation.label_level,
        "strict": evaluation.strict,
        "query_set": f"{evaluation.query_set.dataset}/{evaluation.query_set.split}",
        "gallery_set": f"{evaluation.gallery_set.dataset}/{evaluation.gallery_set.split}",
        "replacements_at_task": [r.at_task for r in config.replacements],  # 1-based, as the papers
    }
    return CompatibilityMatrix(values, [f"task-{t + 1}" for t in range(T)], config.evaluation.metric, protocol)


def _defined(value: Any) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def headline_metrics(values: Any, strict: bool = True) -> dict[str, float | None]:
    """AC, AA, ACA, BC, FC (fractions; None when undefined, e.g. pair metrics of one model) of a ``(tau, tau)``
    matrix or leading block (NaN above the diagonal): metrics.json, and Tune's report after each row."""
    return {name: _defined(value) for name, value in
            summary_metrics(np.asarray(values, dtype=np.float64), strict=strict).items()}


def compute_metrics(matrix: CompatibilityMatrix, strict: bool) -> dict:
    """metrics.json content: AC, AA, ACA, BC, FC (fractions; null when undefined) + AC_tau/AA_tau per task."""
    curves = metrics_by_task(matrix.values, strict=strict)
    return {
        "units": "fraction",
        "metric": matrix.metric,
        "strict": strict,
        "num_tasks": matrix.num_models,
        **headline_metrics(matrix.values, strict),
        "AC_tau": [_defined(v) for v in curves["AC_tau"]],
        "AA_tau": [_defined(v) for v in curves["AA_tau"]],
    }


def write_result(store: RunStore, result: RunResult, folder: str = "") -> None:
    """Write matrix.json and metrics.json at the top of the run directory, or in its sub-folder ``folder``."""
    prefix = f"{folder}/" if folder else ""
    store.write_text(f"{prefix}{MATRIX_FILE}", result.matrix_json())
    store.write_text(f"{prefix}{METRICS_FILE}", result.metrics_json())


def read_result(store: RunStore, folder: str = "", config: dict[str, Any] | None = None) -> RunResult:
    """The RunResult that :func:`write_result` wrote (FileNotFoundError when the run has no matrix.json yet), with
    ``config`` (the run's resolved config as plain data) when given."""
    prefix = f"{folder}/" if folder else ""
    matrix = CompatibilityMatrix.from_json(store.read_text(f"{prefix}{MATRIX_FILE}"))
    name = str((config or {}).get("name") or "")
    return RunResult(matrix, json.loads(store.read_text(f"{prefix}{METRICS_FILE}")), config, name=name)
