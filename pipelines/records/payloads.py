"""Typed payloads of the stage records (:mod:`pipelines.records.stage_records`): the nested values a record carries (feature
layout, evaluation protocol, training summary, weights report, replay shard, adapter results).

Each payload is a dataclass whose JSON form is a plain mapping (:meth:`Payload.to_json`), exactly what the manifest
holds: fields declared ``optional`` are left out of the mapping when they are None, so a record written before the
field existed reads back and writes again to the same JSON. :meth:`Payload.from_json` refuses keys it does not
know, naming them and where they were found.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

P = TypeVar("P", bound="Payload")


def optional(default: Any = None) -> Any:
    """A payload field left out of the JSON mapping while it is None (``default``: its value when absent)."""
    return field(default=default, metadata={"optional": True})


def json_value(value: Any) -> Any:
    """``value`` with every payload (also inside lists and mappings) replaced by its JSON mapping."""
    if isinstance(value, Payload):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: json_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {key: json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(item) for item in value]
    return value


class Payload:
    """Base of the record payloads: JSON mapping <-> dataclass, with ``optional`` fields omitted while None.

    NESTED: field name -> payload class of a nested mapping (read back typed by :meth:`from_json`)."""

    NESTED: ClassVar[dict[str, type]] = {}

    def to_json(self) -> dict:
        """The manifest form: every field (nested payloads as mappings) but ``optional`` ones that are None."""
        out = {}
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if value is None and spec.metadata.get("optional"):
                continue
            out[spec.name] = json_value(value)
        return out

    @classmethod
    def from_json(cls: type[P], data: dict, where: str = "") -> P:
        """The payload of a manifest mapping; ValueError naming ``where`` and the keys on a key it does not know."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"{where or cls.__name__}: expected a mapping for {cls.__name__}, got "
                             f"{type(data).__name__}")
        names = [spec.name for spec in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"{where or cls.__name__}: unknown key(s) {unknown} for {cls.__name__}; known: "
                             f"{', '.join(names)}")
        missing = [spec.name for spec in dataclasses.fields(cls) if spec.name not in data
                   and spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{where or cls.__name__}: missing key(s) {missing} for {cls.__name__}")
        values = dict(data)
        for name, nested in cls.NESTED.items():
            value, inner = values.get(name), f"{where}.{name}" if where else name
            if isinstance(value, list):
                values[name] = [nested.from_json(item, f"{inner}[{index}]") for index, item in enumerate(value)]
            elif value is not None:
                values[name] = nested.from_json(value, inner)
        return cls(**values)


# ---- features ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JunctionRef(Payload):
    """Where a bridge extract's junction weights live: tensor ``tensor`` of blob ``blob`` of model stage
    ``stage_key`` (read by ranged reads, checked against that stage's manifest)."""

    stage_key: str
    blob: str
    tensor: str


@dataclass
class FeatureLayout(Payload):
    """Blobs of an extract stage: ``shards`` (.npy, ``rows`` x ``dim`` of ``dtype`` in all), labels.npy and, when
    ``has_coarse``, coarse_labels.npy. way: "direct" (d-dim features) or "bridge" (m-dim embeddings, ``dim`` = m =
    ``embed_dim``, d = ``feature_dim``, junction weights at ``head``); way_reason: why that way was taken."""

    NESTED: ClassVar[dict[str, type]] = {"head": JunctionRef}
    shards: list[str]
    rows: int
    dim: int
    dtype: str
    has_coarse: bool
    way: str | None = optional()
    way_reason: str | None = optional()
    embed_dim: int | None = optional()
    feature_dim: int | None = optional()
    head: JunctionRef | None = optional()

    @property
    def feature_way(self) -> str:
        """"bridge" or "direct" (layouts written before the way was recorded are direct)."""
        return self.way or "direct"


@dataclass
class EntryFeatures(Payload):
    """How one matrix entry used its features: way ("bridge", "direct" or "materialized"), the bridge kernel or
    the reason for not bridging, the device its search ran on ("cpu", "cuda:0", ...) and the seconds it took."""

    way: str | None = optional()
    kernel: str | None = optional()
    reason: str | None = optional()
    seconds: float | None = optional()
    device: str | None = optional()


# ---- evaluation protocol -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvaluationProtocol(Payload):
    """The evaluation settings that change a matrix entry (``pipelines.stages.inputs.MatrixProtocol``): metric, gallery
    ("instances" | "class_means"), label_level ("fine" | "coarse"), far (false-accept rate of the verification
    metric, a fraction) and verification_pairs (positive pairs, as many negatives)."""

    metric: str
    gallery: str
    label_level: str
    far: float
    verification_pairs: int


# ---- training and weights ------------------------------------------------------------------------------------------
@dataclass
class TrainingSummary(Payload):
    """Summary of a stage's training run: selected epoch (0-based), images/s, seconds, last epoch's mean loss (nats,
    None without epochs), epochs recorded, the epoch checkpoint resumed from (None: none); where the time went:
    input_stall_fraction (device idle waiting for input, fraction of the training seconds), first_step_seconds,
    peak_device_memory_bytes (None off accelerators), loop_unix_seconds (loop start/end, to align device
    samples), checkpoints_written and checkpoint_seconds (epoch checkpoints saved during the task and their write
    seconds, inside ``seconds``; left out when unknown, as in records written before they existed). Every other field
    is written, null when unknown."""

    selected_epoch: int | None = None
    images_per_s: float | None = None
    seconds: float | None = None
    final_loss: float | None = None
    epochs_recorded: int | None = None
    resumed_from_epoch: int | None = None
    input_stall_fraction: float | None = None
    first_step_seconds: float | None = None
    peak_device_memory_bytes: int | None = None
    loop_unix_seconds: list[float] = field(default_factory=list)
    checkpoints_written: int | None = optional()
    checkpoint_seconds: float | None = optional()

    # the per-task metrics the tracker logs on the parent run
    TASK_METRICS: ClassVar[tuple[str, ...]] = ("final_loss", "images_per_s", "seconds", "selected_epoch",
                                               "input_stall_fraction", "first_step_seconds",
                                               "peak_device_memory_bytes")

    def task_metrics(self) -> dict[str, float]:
        """The known :attr:`TASK_METRICS` by name (unknown ones left out)."""
        return {name: getattr(self, name) for name in self.TASK_METRICS if getattr(self, name) is not None}


@dataclass(frozen=True)
class WeightsReport(Payload):
    """Load report of the external weights a stage started from (compat_core.models.weights.LoadReport.to_json
    plus the config ``key`` naming the file): source, sha256, format, layout, target_keys and loaded (counts), then
    per kind (missing, unexpected, shape_mismatches, dropped, ignored, fresh) up to 10 names and the count."""

    key: str
    source: str
    sha256: str
    format: str
    layout: str
    target_keys: int
    loaded: int
    missing: list[str]
    missing_count: int
    unexpected: list[str]
    unexpected_count: int
    shape_mismatches: list[list[str]]
    shape_mismatch_count: int
    dropped: dict[str, str]
    dropped_count: int
    ignored: list[str]
    ignored_count: int
    unused_ignore: list[str]
    fresh: list[str]
    fresh_count: int
    resampled: list = field(default_factory=list)


# ---- replay memory -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardPart(Payload):
    """One replay shard (pipelines.stages.replay_store): ``folder`` relative to the run, the 0-based ``task`` it was
    written after, its Parquet file's ``sha256``, ``rows``, and the ``stage_key`` that wrote it (to recompute)."""

    folder: str
    task: int
    sha256: str
    rows: int
    stage_key: str | None = optional()


@dataclass(frozen=True)
class ReplayShard(ShardPart):
    """The replay memory of a model record as shards: this stage's own shard (the inherited fields) and ``parts``,
    every shard of the memory oldest first, this one last (None in records written before the memory was appended:
    then the shard holds the whole memory)."""

    NESTED: ClassVar[dict[str, type]] = {"parts": ShardPart}
    parts: list[ShardPart] | None = optional()

    def memory_parts(self) -> list[ShardPart]:
        """The shards holding the memory, oldest first."""
        if self.parts is not None:
            return list(self.parts)
        return [ShardPart(self.folder, self.task, self.sha256, self.rows, self.stage_key)]


# ---- adapters at a replacement -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MapOf:
    """A record field that maps names (metrics, adapter kinds) to payloads of ``payload``."""

    payload: type

    def from_json(self, data: dict, where: str = "") -> dict:
        """{name: payload} of a manifest mapping."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a mapping of {self.payload.__name__}, got {type(data).__name__}")
        return {name: self.payload.from_json(value, f"{where}.{name}") for name, value in data.items()}


@dataclass(frozen=True)
class CrossTests(Payload):
    """One metric's entries at an upgrade (fractions): M(Q_old, G_old), M(Q_new, G_new) and M(Q_new, G_old)."""

    self_old: float
    self_new: float
    cross: float


@dataclass(frozen=True)
class UpgradeVerdict(Payload):
    """compat_core.evaluation.metrics.upgrade_verdict as a payload: compatible (cross > self_old, >= when not strict), margin
    cross - self_old, reindex_margin self_new - self_old and update_gain (None without self_new); fractions."""

    compatible: bool
    strict: bool
    cross: float
    self_old: float
    margin: float
    self_new: float | None = None
    reindex_margin: float | None = None
    update_gain: float | None = None


@dataclass(frozen=True)
class AdapterResult(Payload):
    """One adapter fitted at a replacement: its direction ("gallery": old gallery into the new space, else new
    queries into the old), stored ``blob``, the ``params`` it was built with, last fit loss, fit + evaluation
    seconds, the cross-tests with it (fractions) and their verdict."""

    NESTED: ClassVar[dict[str, type]] = {"verdict": UpgradeVerdict}
    direction: str
    blob: str
    params: dict
    fit_loss: float
    seconds: float
    cross_recall_at_1: float
    cross_map: float
    verdict: UpgradeVerdict


@dataclass
class BackfillCurves(Payload):
    """Partial backfilling at a replacement: the gallery it starts from ("fct" or "old features") and, per order
    ("random", "uncertainty"), the curve {"fraction": re-embedded fractions, metric name: values (fractions)}."""

    start: str | None = optional()
    random: dict[str, list[float]] | None = optional()
    uncertainty: dict[str, list[float]] | None = optional()

    def curves(self) -> dict[str, dict[str, list[float]]]:
        """{order: curve} of the orders computed."""
        return {order: curve for order, curve in (("random", self.random), ("uncertainty", self.uncertainty))
                if curve is not None}


__all__ = ["AdapterResult", "BackfillCurves", "CrossTests", "EntryFeatures", "EvaluationProtocol", "FeatureLayout",
           "JunctionRef", "MapOf", "Payload", "ReplayShard", "ShardPart", "TrainingSummary", "UpgradeVerdict",
           "WeightsReport", "json_value", "optional"]
