"""Typed record payloads: manifests written before the payloads were typed load and serialise byte-identically."""
import json
from pathlib import Path

import pytest

from pipelines.records.payloads import (
    EntryFeatures,
    FeatureLayout,
    JunctionRef,
    ReplayShard,
    TrainingSummary,
    WeightsReport,
)
from pipelines.records.stage_records import committed_stage, record_from_json, record_to_json

OLD = Path(__file__).parent / "data" / "old_records"
NODE = ("kind", "label", "placement")


def _text(value: dict) -> str:
    return json.dumps(value, indent=1, sort_keys=True)   # how pipelines.store.run_store writes a manifest


@pytest.mark.parametrize("name", sorted(path.stem for path in OLD.glob("*.json")))
def test_old_manifest_records_round_trip_byte_identically(name):
    saved = json.loads((OLD / f"{name}.json").read_text())
    data = saved["record"]
    record = record_from_json(data, saved["stage_key"])
    again = record_to_json(record, **{key: data[key] for key in NODE if key in data})
    assert _text(again) == _text(data)


def test_payload_fields_read_back_typed():
    data = json.loads((OLD / "features_direct.json").read_text())["record"]
    record = record_from_json(data)
    assert isinstance(record.layout, FeatureLayout)
    assert (record.layout.feature_way, record.layout.rows, record.layout.head) == ("direct", data["layout"]["rows"],
                                                                                 None)
    entry = record_from_json(json.loads((OLD / "entry.json").read_text())["record"])
    assert isinstance(entry.features, EntryFeatures) and entry.features.way == "direct"
    adapters = record_from_json(json.loads((OLD / "adapters.json").read_text())["record"])
    assert adapters.baseline["recall_at_1"].cross == adapters.verdict.cross == 0.7   # the stored numbers
    assert adapters.adapters["fct"].verdict.compatible is False and adapters.adapters["fct"].direction == "gallery"
    assert adapters.backfill.start == "fct" and sorted(adapters.backfill.curves()) == ["random", "uncertainty"]


def test_bridge_layout_json_and_a_layout_without_way():
    layout = FeatureLayout(["embeddings-00000.npy"], 5, 3, "float16", False, way="bridge", way_reason="auto",
                           embed_dim=3, feature_dim=7,
                           head=JunctionRef("model-a", "model.safetensors", "junction.weight"))
    expected = {"shards": ["embeddings-00000.npy"], "rows": 5, "dim": 3, "dtype": "float16", "has_coarse": False,
                "way": "bridge", "way_reason": "auto", "embed_dim": 3, "feature_dim": 7,
                "head": {"stage_key": "model-a", "blob": "model.safetensors", "tensor": "junction.weight"}}
    assert layout.to_json() == expected
    assert FeatureLayout.from_json(expected) == layout
    old = {"shards": [], "rows": 0, "dim": 4, "dtype": "float16", "has_coarse": True}   # written before "way"
    assert FeatureLayout.from_json(old).feature_way == "direct" and FeatureLayout.from_json(old).to_json() == old


def test_unknown_payload_key_is_named():
    data = json.loads((OLD / "features_direct.json").read_text())["record"]
    data["layout"]["colour"] = "blue"
    with pytest.raises(ValueError, match=r"layout: unknown key\(s\) \['colour'\] for FeatureLayout"):
        record_from_json(data, "extract-x")
    del data["layout"]["colour"], data["layout"]["rows"]
    with pytest.raises(ValueError, match=r"stage record extract-x: layout: missing key\(s\) \['rows'\]"):
        record_from_json(data, "extract-x")


def test_committed_stage_hands_on_the_manifest_record_and_blob_table():
    saved = json.loads((OLD / "model_weights.json").read_text())
    blobs = {"model.safetensors": {"sha256": "ab" * 32, "size": 10}}
    committed = committed_stage({"stage_key": saved["stage_key"], "record": saved["record"], "blobs": blobs})
    assert isinstance(committed.record.weights, WeightsReport) and committed.record.weights.loaded == 25
    assert isinstance(committed.record.training, TrainingSummary) and committed.record.training.selected_epoch == 0
    assert isinstance(committed.record.memory.shard, ReplayShard)
    assert [part.task for part in committed.record.memory.shard.memory_parts()] == [0, 1, 2]
    assert committed.blob_table == {"blobs": blobs}
    assert _text(committed.record_json()) == _text(saved["record"])
