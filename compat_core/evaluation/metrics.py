"""Compatibility metrics over a compatibility matrix (SPEC §1-2).

Conventions used throughout this module:

* ``C`` is a ``(T, T)`` float array of **fractions** in ``[0, 1]`` (never percent). ``C[t, k]`` is the retrieval
  metric with queries from model ``t`` and gallery from model ``k`` (0-based model/task indices). The diagonal holds
  the self-tests, the strict lower triangle (``t > k``) the cross-tests. Entries above the diagonal are undefined
  (NaN by convention; the papers print 0) and are **ignored** by every function here.
* ``tau`` counts tasks: ``tau = 3`` means the leading ``3 x 3`` block (models 0, 1, 2); ``tau`` ranges over
  ``1..T`` and ``None`` means ``T``. This is the papers' 1-based ``AC_tau`` / ``AA_tau``.
* ``BC(t)``: ``t`` is the same kind of count: the number of models considered, i.e. the last row of the leading
  ``t x t`` block (row ``t - 1`` in 0-based indexing), exactly the papers' 1-based ``BC(t)``. ``BC(T) == BC``.
* Metrics that average over model *pairs* (AC, ACA, BC, FC) are undefined with a single model (no cross-test
  exists): they return ``float('nan')`` rather than raising, so per-task curves (``metrics_by_task``) can start at
  the first task. Writers of JSON should store such values as ``null``.
* ECC strictness: ``strict=True`` (default, as in the papers) counts a cross-test as compatible when
  ``C[t, k] > C[k, k]``; ``strict=False`` uses ``>=`` (one public reference implementation).
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "CompatibilityMatrix",
    "average_accuracy",
    "average_compatibility",
    "average_compatibility_accuracy",
    "backward_compatibility",
    "criterion_sign",
    "empirical_compatibility",
    "forward_compatibility",
    "is_compatible",
    "metrics_by_task",
    "summary_metrics",
    "update_gain",
    "upgrade_verdict",
    "validate_matrix",
]

_MATRIX_FORMAT = "compat-matrix/1"
_CSV_CORNER = "query\\gallery"


def validate_matrix(C: Any, name: str = "C") -> np.ndarray:
    """Return ``C`` as a float64 ``(T, T)`` copy with NaN above the diagonal, after checking it.

    Raises ``ValueError`` naming the offending entry when ``C`` is not square 2-D, is empty, or has a lower-triangle
    entry (diagonal included) that is not a finite fraction in ``[0, 1]``.
    """
    try:
        matrix = np.array(C, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}: expected a square 2-D array of floats, could not convert: {error}") from None
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"{name}: expected a square 2-D array (T, T), got shape {matrix.shape}")
    if matrix.shape[0] == 0:
        raise ValueError(f"{name}: expected at least one model (T >= 1), got shape {matrix.shape}")
    lower = np.tril(np.ones(matrix.shape, dtype=bool))
    bad = lower & ~(np.isfinite(matrix) & (matrix >= 0.0) & (matrix <= 1.0))
    if bad.any():
        t, k = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}[{t},{k}] = {float(matrix[t, k])!r}: lower-triangle entries (diagonal included) must be finite "
            "fractions in [0, 1] (divide percentages by 100)"
        )
    matrix[~lower] = np.nan
    return matrix


def _leading_block(C: Any, tau: int | None, argument: str = "tau") -> np.ndarray:
    matrix = validate_matrix(C)
    T = matrix.shape[0]
    if tau is None:
        return matrix
    if isinstance(tau, bool) or not isinstance(tau, (int, np.integer)):
        raise ValueError(f"{argument}: expected an integer number of tasks in [1, {T}] or None, got {tau!r}")
    if not 1 <= tau <= T:
        raise ValueError(f"{argument}={tau}: expected a number of tasks in [1, {T}] (it counts models, 1-based)")
    return matrix[:tau, :tau]


def is_compatible(cross: Any, self_old: Any, strict: bool = True) -> Any:
    """The compatibility criterion, the one place it is written: ``cross > self_old`` (``>=`` when not strict), for
    numbers (a bool) or arrays (element-wise; NaN compares False)."""
    with np.errstate(invalid="ignore"):
        return np.greater(cross, self_old) if strict else np.greater_equal(cross, self_old)


def criterion_sign(strict: bool = True) -> str:
    """The criterion's comparison as text: ``>`` (strict) or ``>=``."""
    return ">" if strict else ">="


def _compatible_mask(matrix: np.ndarray, strict: bool) -> np.ndarray:
    """Boolean (T, T): True at t > k where the cross-test beats the self-test of the gallery model k."""
    self_tests = np.diag(matrix)[np.newaxis, :]  # broadcast C[k, k] along each column k
    # NaN above the diagonal compares False, which is what we want
    return is_compatible(matrix, self_tests, strict) & np.tri(matrix.shape[0], k=-1, dtype=bool)


def empirical_compatibility(C: Any, strict: bool = True) -> np.ndarray:
    """ECC per model pair: bool ``(T, T)``, True at ``[t, k]`` (t > k, 0-based) where ``C[t,k] > C[k,k]``.

    With ``strict=False`` the comparison is ``>=``. The diagonal and the upper triangle are always False.
    """
    return _compatible_mask(validate_matrix(C), strict)


def average_compatibility(C: Any, tau: int | None = None, strict: bool = True) -> float:
    """AC (or AC_tau): fraction of the ``tau(tau-1)/2`` model pairs that satisfy the ECC.

    ``tau`` counts tasks (leading ``tau x tau`` block, ``None`` = all ``T``). Returns a fraction in ``[0, 1]``;
    NaN when ``tau == 1`` (no pair exists).
    """
    block = _leading_block(C, tau)
    pairs = block.shape[0] * (block.shape[0] - 1) // 2
    if pairs == 0:
        return float("nan")
    return float(_compatible_mask(block, strict).sum() / pairs)


def average_accuracy(C: Any, tau: int | None = None) -> float:
    """AA (alias AM; or AA_tau): mean of the ``tau(tau+1)/2`` entries of the lower triangle, diagonal included.

    ``tau`` counts tasks (leading ``tau x tau`` block, ``None`` = all ``T``). Returns a fraction.
    """
    block = _leading_block(C, tau)
    return float(block[np.tril_indices(block.shape[0])].mean())


def average_compatibility_accuracy(C: Any, tau: int | None = None, strict: bool = True) -> float:
    """ACA: sum of the cross-tests that satisfy the ECC, divided by the number of **all** pairs ``tau(tau-1)/2``.

    Incompatible cross-tests contribute 0 (not excluded from the denominator), matching the published tables.
    Returns a fraction; NaN when ``tau == 1``.
    """
    block = _leading_block(C, tau)
    pairs = block.shape[0] * (block.shape[0] - 1) // 2
    if pairs == 0:
        return float("nan")
    mask = _compatible_mask(block, strict)
    return float(block[mask].sum() / pairs)


def backward_compatibility(C: Any, t: int | None = None) -> float:
    """BC (or BC(t)): mean over ``k < t`` of ``C[t,k] - C[k,k]`` using the last row of the leading ``t x t`` block.

    ``t`` counts models, 1-based as in CL2R (``t = 3`` uses row 2 in 0-based indexing); ``None`` = ``T``, so
    ``BC(T) == BC``. Returns a signed fraction in ``[-1, 1]``; NaN when ``t == 1``.
    """
    block = _leading_block(C, t, argument="t")
    last = block.shape[0] - 1
    if last == 0:
        return float("nan")
    return float(np.mean(block[last, :last] - np.diag(block)[:last]))


def forward_compatibility(C: Any) -> float:
    """FC: mean over consecutive models of ``C[k, k-1] - C[k, k]`` (0-based k = 1..T-1; CL2R's k = 2..T).

    The cross-test of each model against its predecessor's gallery minus its own self-test. Returns a signed
    fraction in ``[-1, 1]``; NaN when ``T == 1``.
    """
    matrix = validate_matrix(C)
    T = matrix.shape[0]
    if T == 1:
        return float("nan")
    rows = np.arange(1, T)
    return float(np.mean(matrix[rows, rows - 1] - matrix[rows, rows]))


def metrics_by_task(C: Any, strict: bool = True) -> dict[str, list[float]]:
    """Per-task curves: lists of length T whose entry ``i`` is the metric at ``tau = i + 1`` tasks.

    Keys: ``AC_tau``, ``AA_tau``, ``ACA_tau``, ``BC_t`` (fractions; the ``tau = 1`` entry of every pair metric is
    NaN, see the module docstring).
    """
    matrix = validate_matrix(C)
    taus = range(1, matrix.shape[0] + 1)
    return {
        "AC_tau": [average_compatibility(matrix, tau, strict) for tau in taus],
        "AA_tau": [average_accuracy(matrix, tau) for tau in taus],
        "ACA_tau": [average_compatibility_accuracy(matrix, tau, strict) for tau in taus],
        "BC_t": [backward_compatibility(matrix, tau) for tau in taus],
    }


def update_gain(cross: float, self_old: float, self_upper: float) -> float:
    """CoReS update gain (Eq. 4): ``(cross - self_old) / (self_upper - self_old)``.

    ``cross`` = M(Q_new, G_old), ``self_old`` = M(Q_old, G_old), ``self_upper`` = M(Q~new, G~new) of an upper-bound
    model trained jointly and re-indexed; all fractions. Returns a unitless ratio (1 = the update recovers all the
    re-indexed improvement). Raises ``ValueError`` when the upper bound equals the old self-test (zero denominator).
    """
    values = {"cross": cross, "self_old": self_old, "self_upper": self_upper}
    for argument, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"update_gain: {argument} must be a number (fraction), got {value!r}")
        if not math.isfinite(float(value)):
            raise ValueError(f"update_gain: {argument} must be finite, got {value!r}")
    denominator = float(self_upper) - float(self_old)
    if denominator == 0.0:
        raise ValueError(
            f"update_gain: self_upper ({self_upper!r}) equals self_old ({self_old!r}); the gain is undefined "
            "when the upper-bound model does not differ from the old model"
        )
    return (float(cross) - float(self_old)) / denominator


def summary_metrics(matrix: np.ndarray, strict: bool = True) -> dict[str, float]:
    """AC, AA, ACA, BC, FC of a ``(T, T)`` matrix (fractions, NaN above the diagonal; pair metrics NaN at T = 1)."""
    return {
        "AC": average_compatibility(matrix, strict=strict),
        "AA": average_accuracy(matrix),
        "ACA": average_compatibility_accuracy(matrix, strict=strict),
        "BC": backward_compatibility(matrix),
        "FC": forward_compatibility(matrix),
    }


@dataclass(eq=False)
class CompatibilityMatrix:
    """A compatibility matrix with the information needed to read it.

    values: float64 ``(T, T)`` fractions, rows = query model, columns = gallery model (0-based), NaN above the
        diagonal (any value given there is replaced by NaN).
    model_ids: ``T`` distinct non-empty strings, row/column ``i`` belongs to ``model_ids[i]``.
    metric: name of the retrieval metric ``M``, e.g. ``"recall_at_1"``.
    protocol: free-form description, e.g. ``{"gallery": "instances" | "class_means", "query": "...",
        "strict": True}``; ``protocol["strict"]`` (default True) is the ECC strictness used by ``summary``/``render``.
    units: always ``"fraction"`` (kept in files so readers need not guess).
    """

    values: np.ndarray
    model_ids: list[str]
    metric: str
    protocol: dict[str, Any] = field(default_factory=dict)
    units: str = "fraction"

    def __post_init__(self) -> None:
        self.values = validate_matrix(self.values, name="values")
        T = self.values.shape[0]
        if isinstance(self.model_ids, (str, bytes)) or not isinstance(self.model_ids, (list, tuple)):
            raise ValueError(f"model_ids: expected a list of {T} strings, got {type(self.model_ids).__name__}")
        ids = list(self.model_ids)
        if len(ids) != T:
            raise ValueError(f"model_ids: expected {T} ids (one per row of values), got {len(ids)}")
        for index, model_id in enumerate(ids):
            if not isinstance(model_id, str) or not model_id:
                raise ValueError(f"model_ids[{index}]: expected a non-empty string, got {model_id!r}")
        if len(set(ids)) != T:
            duplicates = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"model_ids: ids must be distinct, repeated: {duplicates}")
        self.model_ids = ids
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"metric: expected a non-empty metric name such as 'recall_at_1', got {self.metric!r}")
        if not isinstance(self.protocol, dict):
            raise ValueError(f"protocol: expected a dict, got {type(self.protocol).__name__}")
        self.protocol = dict(self.protocol)
        try:
            json.dumps(self.protocol, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise ValueError(f"protocol: must be JSON-serialisable (it is written to matrix.json): {error}") from None
        if not isinstance(self.protocol.get("strict", True), bool):
            raise ValueError(f"protocol['strict']: expected a bool, got {self.protocol['strict']!r}")
        if self.units != "fraction":
            raise ValueError(f"units: only 'fraction' is supported (values in [0, 1]), got {self.units!r}")

    @property
    def num_models(self) -> int:
        """T, the number of models (rows)."""
        return self.values.shape[0]

    @property
    def strict(self) -> bool:
        """ECC strictness taken from ``protocol['strict']`` (default True)."""
        return bool(self.protocol.get("strict", True))

    def summary(self) -> dict[str, float]:
        """AC, AA, ACA, BC, FC of the whole matrix as fractions (NaN for the pair metrics when T == 1)."""
        return summary_metrics(self.values, self.strict)

    # --- serialisation -------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; undefined entries (above the diagonal) become ``None``."""
        rows = [
            [float(self.values[t, k]) if k <= t else None for k in range(self.num_models)]
            for t in range(self.num_models)
        ]
        return {
            "format": _MATRIX_FORMAT,
            "metric": self.metric,
            "units": self.units,
            "protocol": self.protocol,
            "model_ids": list(self.model_ids),
            "values": rows,
        }

    @classmethod
    def from_dict(cls, data: Any) -> "CompatibilityMatrix":
        """Inverse of ``to_dict``; raises ``ValueError``/``KeyError`` naming the missing or malformed key."""
        if not isinstance(data, dict):
            raise ValueError(f"compatibility matrix: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != _MATRIX_FORMAT:
            raise ValueError(f"format: expected {_MATRIX_FORMAT!r}, got {data.get('format')!r}")
        for key in ("metric", "model_ids", "values"):
            if key not in data:
                raise KeyError(f"compatibility matrix: missing key {key!r}")
        rows = data["values"]
        if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
            raise ValueError("values: expected a list of rows (lists), null above the diagonal")
        T = len(rows)
        values = np.full((T, T), np.nan)
        for t, row in enumerate(rows):
            if len(row) != T:
                raise ValueError(f"values[{t}]: expected {T} entries, got {len(row)}")
            for k, value in enumerate(row[: t + 1]):
                if value is None:
                    raise ValueError(f"values[{t}][{k}]: expected a number on/below the diagonal, got null")
                values[t, k] = value
        return cls(values, data["model_ids"], data["metric"], data.get("protocol", {}), data.get("units", "fraction"))

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text (``null`` above the diagonal); floats are written exactly, so ``from_json`` round-trips."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> "CompatibilityMatrix":
        """Parse the text written by ``to_json``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"compatibility matrix JSON: {error}") from None
        return cls.from_dict(data)

    def to_csv(self) -> str:
        """CSV text: header ``query\\gallery,<id0>,...``, one row per query model, empty cells above the diagonal.

        Only values and ids travel in CSV; pass ``metric``/``protocol`` again to ``from_csv``.
        """
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow([_CSV_CORNER, *self.model_ids])
        for t, model_id in enumerate(self.model_ids):
            # repr() of a Python float is the shortest string that reads back to the same float64
            cells = [repr(float(self.values[t, k])) if k <= t else "" for k in range(self.num_models)]
            writer.writerow([model_id, *cells])
        return buffer.getvalue()

    @classmethod
    def from_csv(
        cls, text: str, metric: str, protocol: dict[str, Any] | None = None, units: str = "fraction"
    ) -> "CompatibilityMatrix":
        """Parse the text written by ``to_csv``; rows and columns must list the same model ids in the same order."""
        rows = [row for row in csv.reader(io.StringIO(text)) if row]
        if not rows:
            raise ValueError("compatibility matrix CSV: empty text, expected a header row")
        header = rows[0]
        if not header or header[0] != _CSV_CORNER:
            raise ValueError(f"compatibility matrix CSV: header must start with {_CSV_CORNER!r}, got {header[:1]!r}")
        ids = header[1:]
        body = rows[1:]
        if len(body) != len(ids):
            raise ValueError(f"compatibility matrix CSV: header lists {len(ids)} models but there are {len(body)} rows")
        values = np.full((len(ids), len(ids)), np.nan)
        for t, row in enumerate(body):
            if len(row) != len(ids) + 1:
                raise ValueError(f"CSV row {t + 1} ({row[:1]!r}): expected {len(ids) + 1} cells, got {len(row)}")
            if row[0] != ids[t]:
                raise ValueError(f"CSV row {t + 1}: row id {row[0]!r} differs from column id {ids[t]!r}")
            for k in range(t + 1):
                cell = row[k + 1]
                try:
                    values[t, k] = float(cell)
                except ValueError:
                    raise ValueError(f"CSV cell [{ids[t]}, {ids[k]}]: expected a number, got {cell!r}") from None
        return cls(values, ids, metric, protocol or {}, units)

    # --- display ---------------------------------------------------------------------------------------------------

    def render(self) -> str:
        """Readable text table in **percent** (2 decimals), ``-`` above the diagonal, ``*`` after cross-tests that
        fail the ECC, followed by a legend line and the summary metrics."""
        T = self.num_models
        failing = np.tri(T, k=-1, dtype=bool) & ~_compatible_mask(self.values, self.strict)
        cells = [[""] * T for _ in range(T)]
        for t in range(T):
            for k in range(T):
                if k > t:
                    cells[t][k] = "-"
                else:
                    cells[t][k] = f"{100.0 * self.values[t, k]:.2f}" + ("*" if failing[t, k] else " ")
        corner = "query \\ gallery"
        label_width = max(len(corner), *(len(i) for i in self.model_ids))
        column_width = max(8, *(len(i) for i in self.model_ids))
        protocol_text = ", ".join(f"{key}={value}" for key, value in sorted(self.protocol.items()))
        lines = [f"{self.metric} (percent){'; ' + protocol_text if protocol_text else ''}"]
        # ids end where the numbers end; the column after a number holds its ECC marker
        header_cells = "".join(" " + i.rjust(column_width) + " " for i in self.model_ids)
        lines.append((corner.ljust(label_width) + header_cells).rstrip())
        for t in range(T):
            # the trailing ' '/'*' marker sits after the number, so pad the dash to keep columns aligned
            row_cells = "".join((c if c != "-" else "- ").rjust(column_width + 2) for c in cells[t])
            lines.append((self.model_ids[t].ljust(label_width) + row_cells).rstrip())
        comparison = criterion_sign(self.strict)
        lines.append(
            f"legend: rows = query model, columns = gallery model, diagonal = self-test; "
            f"* = cross-test that fails the ECC (not C[t,k] {comparison} C[k,k]); - = undefined"
        )
        summary = self.summary()
        lines.append(
            "summary: "
            + ", ".join(
                f"{name} n/a" if math.isnan(value)
                else f"{name} {value:.4f}" if name == "AC"
                else f"{name} {100.0 * value:.2f}%"
                for name, value in summary.items()
            )
            + " (AC as a fraction of pairs; n/a = undefined with one model)"
        )
        return "\n".join(lines)


def upgrade_verdict(cross: float, self_old: float, self_new: float | None = None, strict: bool = True) -> dict:
    """The compatibility criterion for one model upgrade (SPEC §1), as a decision record.

    cross: M(Q_new, G_old); self_old: M(Q_old, G_old); self_new: M(Q_new, G_new) (full re-indexing), optional.
    Returns ``{"compatible": cross > self_old (>= when not strict), "margin": cross - self_old,
    "reindex_margin": self_new - self_old, "update_gain": CoReS Eq. 4 with self_new as the upper bound}``;
    all fractions, the last two None without ``self_new`` (update_gain also None when self_new == self_old).
    """
    for name, value in (("cross", cross), ("self_old", self_old)) + ((("self_new", self_new),) if self_new is not None
                                                                     else ()):
        if not (isinstance(value, (int, float, np.floating)) and 0.0 <= float(value) <= 1.0):
            raise ValueError(f"upgrade verdict {name}: expected a fraction in [0, 1], got {value!r}")
    compatible = is_compatible(float(cross), float(self_old), strict)
    result = {"compatible": bool(compatible), "strict": bool(strict), "cross": float(cross),
              "self_old": float(self_old), "margin": float(cross) - float(self_old), "self_new": None,
              "reindex_margin": None, "update_gain": None}
    if self_new is not None:
        result["self_new"] = float(self_new)
        result["reindex_margin"] = float(self_new) - float(self_old)
        if float(self_new) != float(self_old):
            result["update_gain"] = update_gain(cross, self_old, self_new)
    return result
