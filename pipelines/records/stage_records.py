"""Typed records of the stage graph: what each node produced, passed between stages as these dataclasses.

A record becomes JSON only at the edges, through the one record codec (:mod:`compat_core.codec`): in the store's
manifest (:func:`record_to_json` when a stage commits, :func:`read_record` when a later stage or the engine reads it
back) and in the tracker. Records hold blob names
and run-relative locations, never tensors, so they travel to Ray workers and back as small objects.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from compat_core.codec import from_json, to_json
from pipelines.records.payloads import (
    AdapterResult,
    BackfillCurves,
    CrossTests,
    EntryFeatures,
    EvaluationProtocol,
    FeatureLayout,
    ReplayShard,
    TrainingSummary,
    UpgradeVerdict,
    WeightsReport,
)


@dataclass
class MemoryRecord:
    """Replay memory after a task: blob names of .npy arrays (pool indices, class positions, source task).

    shard: the exemplars' images as a replay shard (pipelines.stages.replay_store format), when written.
    """

    indices_blob: str
    positions_blob: str
    tasks_blob: str
    size: int
    per_class: int
    shard: ReplayShard | None = None


@dataclass
class ModelRecord:
    """A trained model: folder ``uri`` (run-relative) holding model.safetensors + config.json (save_model layout).

    task: 0-based task (None for pretrain). line: 0-based model line (+1 at each replacement). pretrained_classes:
    P, classes the line's starting model was pre-trained on (slots 0..P-1). positions_seen: fine-tuning classes
    learned so far (positions 0..positions_seen-1). memory: the replay memory after this task, or None.
    extra_blobs: blobs of modules a method exports (FAN's adapter). training: summary of the training run.
    pretrain_name: the pretrain entry a pre-training stage trained (None otherwise). weights: the load report of
    the external weights the stage started from (counts, sha256, up to 10 names per kind; None without a file).
    """

    TYPE: ClassVar[str] = "model"
    stage_key: str
    uri: str
    task: int | None
    line: int
    pretrained_classes: int
    positions_seen: int
    classifier: str
    num_active_classes: int
    source: str | None = None
    memory: MemoryRecord | None = None
    extra_blobs: list[str] = field(default_factory=list)
    training: TrainingSummary = field(default_factory=TrainingSummary)
    pretrain_name: str | None = None
    weights: WeightsReport | None = None


@dataclass
class FeatureRecord:
    """Features of one model on one evaluation split: .npy shards + labels under the stage folder (``layout``).

    model_stage_key: the model stage the features come from. adapter_blob: that stage's FAN adapter blob (maps
    features of the previous model into this model's space), or None. num_classes_model: classifier outputs of the
    model (learnable classifiers; PSP/LSP project into this space). seconds / images_per_second: extraction time.
    """

    TYPE: ClassVar[str] = "features"
    stage_key: str
    task: int
    split: str
    uri: str
    layout: FeatureLayout
    num_classes_model: int
    seconds: float
    images_per_second: float
    model_stage_key: str = ""
    adapter_blob: str | None = None


@dataclass
class EntryRecord:
    """Matrix entry C[row, column] (a fraction): query / gallery are the extract keys it was computed from;
    features says how they were used (direct, bridge, materialised) and the seconds it took."""

    TYPE: ClassVar[str] = "entry"
    stage_key: str
    row: int
    column: int
    value: float
    query: str
    gallery: str
    protocol: EvaluationProtocol
    features: EntryFeatures = field(default_factory=EntryFeatures)


@dataclass
class RowRecord:
    """Row ``row`` of the compatibility matrix: ``values[k] = C[row, k]`` for k = 0..row (fractions)."""

    TYPE: ClassVar[str] = "matrix_row"
    stage_key: str
    row: int
    values: list[float]
    entry_keys: list[str]
    metric: str
    protocol: EvaluationProtocol


@dataclass
class AdaptersRecord:
    """Adapters fitted at a replacement (pipelines.stages.adapt): the cross-tests without (``baseline``) and with each
    adapter, their verdicts, and partial-backfilling curves. task: 0-based first task of the new model."""

    TYPE: ClassVar[str] = "adapters"
    stage_key: str
    task: int
    old_task: int
    metric: str
    baseline: dict[str, CrossTests]
    verdict: UpgradeVerdict
    adapters: dict[str, AdapterResult] = field(default_factory=dict)
    backfill: BackfillCurves = field(default_factory=BackfillCurves)
    units: str = "fraction"
    fit_on: str = "paired gallery features"


Record = Union[ModelRecord, FeatureRecord, EntryRecord, RowRecord, AdaptersRecord]
RECORD_TYPES: dict[str, type] = {cls.TYPE: cls for cls in (ModelRecord, FeatureRecord, EntryRecord, RowRecord,
                                                          AdaptersRecord)}
# What the store adds next to a record in its manifest (the graph node it came from, where it ran).
_NODE_KEYS = ("type", "kind", "label", "placement")


def record_to_json(record: Record, **node: Any) -> dict:
    """The manifest form of ``record``: its fields (nested records as mappings), its ``type`` and ``node`` keys."""
    return {"type": record.TYPE, **to_json(record), **node}


def record_from_json(data: dict, stage_key: str | None = None) -> Record:
    """The typed record of a manifest's ``record`` mapping (``stage_key``: the manifest's key, when known)."""
    kind = data.get("type")
    if kind not in RECORD_TYPES:
        raise ValueError(f"stage record {stage_key or data.get('stage_key')}: unknown record type {kind!r}; "
                         f"known: {', '.join(RECORD_TYPES)}")
    cls = RECORD_TYPES[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names - set(_NODE_KEYS))
    if unknown:
        raise ValueError(f"stage record {stage_key or data.get('stage_key')}: {kind} record has unknown field(s) "
                         f"{unknown}; written by another version of the code?")
    values = {name: value for name, value in data.items() if name in names}
    if stage_key is not None:
        values["stage_key"] = stage_key
    return from_json(cls, values, f"stage record {stage_key or data.get('stage_key')}")


@dataclass(frozen=True)
class CommittedStage:
    """A committed stage as the engine hands it on with its "done" event: the typed ``record``, the graph node keys
    the manifest keeps beside it (``node``: kind, label, placement) and the manifest's blob table (``blobs``: name
    -> {"sha256", "size", ...}), which is what a reader needs to fetch and verify the blobs it uploads."""

    record: Record
    node: dict
    blobs: dict

    @property
    def blob_table(self) -> dict:
        """The manifest part :meth:`pipelines.store.run_store.RunStore.read_blob` verifies blobs against."""
        return {"blobs": self.blobs}

    def record_json(self) -> dict:
        """The record as the manifest holds it (fields, type and node keys)."""
        return record_to_json(self.record, **self.node)


def committed_stage(manifest: dict) -> CommittedStage:
    """The :class:`CommittedStage` of a stage manifest (``RunStore.load_manifest`` / ``commit``)."""
    data = manifest["record"]
    node = {key: data[key] for key in _NODE_KEYS if key in data and key != "type"}
    return CommittedStage(record_from_json(data, manifest["stage_key"]), node, dict(manifest.get("blobs", {})))


def read_committed(store: Any, stage_key: str) -> CommittedStage:
    """The committed stage ``stage_key`` of ``store`` (FileNotFoundError when it is not committed)."""
    return committed_stage(store.load_manifest(stage_key))


def read_record(store: Any, stage_key: str) -> Record:
    """The typed record committed with ``stage_key`` (FileNotFoundError when the stage is not committed)."""
    return record_from_json(store.load_record(stage_key), stage_key)


__all__ = ["AdaptersRecord", "CommittedStage", "EntryRecord", "FeatureRecord", "MemoryRecord", "ModelRecord",
           "RECORD_TYPES", "Record", "RowRecord", "committed_stage", "read_committed", "read_record",
           "record_from_json", "record_to_json"]
