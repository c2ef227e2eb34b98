"""Typed payloads of the stage records (:mod:`pipelines.records.stage_records`): the nested values a record carries
(feature layout, evaluation protocol, training summary, weights report, replay shard, adapter results).

Each payload is a dataclass whose JSON form is a plain mapping, exactly what the manifest holds, written and read
by the one record codec :mod:`compat_core.codec`: fields declared ``optional`` are left out of the mapping when they
are None, so a record written before the field existed reads back and writes again to the same JSON; a key the
payload does not know is refused, naming it and where it was found.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from compat_core.codec import from_json, optional, to_json

P = TypeVar("P", bound="Payload")


class Payload:
    """Base of the record payloads: :meth:`to_json` / :meth:`from_json` through :mod:`compat_core.codec`."""

    def to_json(self) -> dict:
        """The manifest form: every field (nested payloads as mappings) but ``optional`` ones that are None."""
        return to_json(self)

    @classmethod
    def from_json(cls: type[P], data: dict, where: str = "") -> P:
        """The payload of a manifest mapping; ValueError naming ``where`` and the keys on a key it does not know."""
        return from_json(cls, data, where)


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

    parts: list[ShardPart] | None = optional()

    def memory_parts(self) -> list[ShardPart]:
        """The shards holding the memory, oldest first."""
        if self.parts is not None:
            return list(self.parts)
        return [ShardPart(self.folder, self.task, self.sha256, self.rows, self.stage_key)]


# ---- adapters at a replacement -------------------------------------------------------------------------------------
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
           "JunctionRef", "Payload", "ReplayShard", "ShardPart", "TrainingSummary", "UpgradeVerdict", "WeightsReport",
           "optional"]
