"""Typed payloads of the stage records (:mod:`pipelines.records`): the nested values a record carries (feature
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
        values = dict(data)
        for name, nested in cls.NESTED.items():
            if values.get(name) is not None:
                values[name] = nested.from_json(values[name], f"{where}.{name}" if where else name)
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
    the reason for not bridging, and the seconds the entry took."""

    way: str | None = optional()
    kernel: str | None = optional()
    reason: str | None = optional()
    seconds: float | None = optional()


# ---- evaluation protocol -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvaluationProtocol(Payload):
    """The evaluation settings that change a matrix entry (``pipelines.graph.protocol_params``): metric, gallery
    ("instances" | "class_means"), label_level ("fine" | "coarse"), far (false-accept rate of the verification
    metric, a fraction) and verification_pairs (positive pairs, as many negatives)."""

    metric: str
    gallery: str
    label_level: str
    far: float
    verification_pairs: int


__all__ = ["EntryFeatures", "EvaluationProtocol", "FeatureLayout", "JunctionRef", "Payload", "json_value",
           "optional"]
