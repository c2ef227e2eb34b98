"""The one record codec (compat_core.codec) and the one integrity error (compat_core.integrity): dataclass <-> JSON
round trips, optional fields, typed nesting, errors naming where, the manifest's stored form."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest

from compat_core.codec import decode_manifest, encode_manifest, from_json, optional, to_json
from compat_core.integrity import IntegrityError


@dataclass(frozen=True)
class Part:
    name: str
    rows: int


@dataclass
class Document:
    title: str
    shape: tuple[int, int, int]
    parts: list[Part]
    by_name: dict[str, Part]
    first: Part | None = None
    note: str | None = optional()
    weights: tuple[float, ...] = ()
    extra: dict = field(default_factory=dict)


def _document() -> Document:
    return Document("d", (2, 3, 1), [Part("a", 1), Part("b", 2)], {"x": Part("c", 3)}, Part("a", 1),
                    weights=(0.5, 0.25), extra={"k": [1, 2]})


def test_round_trip_rebuilds_nested_dataclasses_tuples_and_maps():
    document = _document()
    data = to_json(document)
    assert data == {"title": "d", "shape": [2, 3, 1], "parts": [{"name": "a", "rows": 1}, {"name": "b", "rows": 2}],
                    "by_name": {"x": {"name": "c", "rows": 3}}, "first": {"name": "a", "rows": 1},
                    "weights": [0.5, 0.25], "extra": {"k": [1, 2]}}
    assert list(data) == ["title", "shape", "parts", "by_name", "first", "weights", "extra"]  # declaration order
    back = from_json(Document, json.loads(json.dumps(data)))
    assert back == document and isinstance(back.shape, tuple) and isinstance(back.parts[1], Part)
    assert isinstance(back.by_name["x"], Part) and isinstance(back.weights, tuple)


def test_optional_fields_are_left_out_while_none_and_plain_none_is_written():
    document = _document()
    document.first = None
    data = to_json(document)
    assert "note" not in data and data["first"] is None
    document.note = "n"
    assert to_json(document)["note"] == "n" and from_json(Document, to_json(document)).note == "n"
    assert to_json({"a": np.float32(0.5), "b": np.arange(3)}) == {"a": 0.5, "b": [0, 1, 2]}


def test_errors_name_the_document_the_key_path_and_the_keys():
    data = to_json(_document())
    data["parts"][1]["colour"] = "blue"
    with pytest.raises(ValueError, match=r"^search\.json: parts\[1\]: unknown key\(s\) \['colour'\] for Part; "
                                         r"known: name, rows$"):
        from_json(Document, data, "search.json")
    del data["parts"][1]["colour"], data["by_name"]["x"]["rows"]
    with pytest.raises(ValueError, match=r"^record: by_name\.x: missing key\(s\) \['rows'\] for Part$"):
        from_json(Document, data, "record")
    with pytest.raises(ValueError, match=r"^Document: expected a mapping for Document, got list$"):
        from_json(Document, [1])
    assert from_json(Part, Part("a", 1)) == Part("a", 1)  # a typed value passes as is


def test_manifest_stored_form_and_its_integrity_errors(tmp_path):
    document = {"b": 1, "a": {"z": [1, 2], "y": None}}
    data = encode_manifest(document)
    assert data == json.dumps(document, indent=1, sort_keys=True).encode("utf-8")
    assert decode_manifest(data, "/x/manifest.json") == document
    assert encode_manifest(Part("p", 2)) == json.dumps({"name": "p", "rows": 2}, indent=1, sort_keys=True).encode()
    with pytest.raises(IntegrityError) as error:
        decode_manifest(b"{not json", "s3://bucket/run/manifests/k.json", "stage manifest", stage_key="k")
    assert str(error.value).startswith("stage manifest s3://bucket/run/manifests/k.json (bucket 'bucket', key "
                                       "'run/manifests/k.json'): manifest JSON expected valid JSON, actual invalid")
    assert (error.value.bucket, error.value.key, error.value.stage_key) == ("bucket", "run/manifests/k.json", "k")
    with pytest.raises(IntegrityError, match=r"local file '/x/m.json'\): manifest expected a JSON object, actual list"):
        decode_manifest(b"[1]", "/x/m.json")


def test_integrity_error_keeps_its_fields_and_pickles():
    import pickle

    error = IntegrityError.mismatch("dataset shard", "s3://b/k/part-1.parquet", "sha256", "aa", "bb", "rewritten")
    assert str(error) == ("dataset shard s3://b/k/part-1.parquet (bucket 'b', key 'k/part-1.parquet'): sha256 "
                          "expected aa, actual bb; rewritten")
    again = pickle.loads(pickle.dumps(error))  # errors cross process boundaries (Ray workers)
    assert str(again) == str(error)
    assert (again.bucket, again.key, again.field, again.expected, again.actual) == ("b", "k/part-1.parquet",
                                                                                    "sha256", "aa", "bb")
    local = IntegrityError("blob missing", uri="/r/artifacts/k/f.npy", stage_key="k")
    assert (local.bucket, local.key, local.stage_key) == (None, "/r/artifacts/k/f.npy", "k")
    assert isinstance(local, IOError)
