"""The gallery index store: content addressing, sha256 checks naming the file, later shards overriding earlier
ones (the backfill's chunk flip), the HEAD guard against a second writer, locally and on a real S3 server."""
from __future__ import annotations

import numpy as np
import pytest

from cluster.serving.index_store import (commit_manifest, load_index, new_manifest, read_head, read_manifest,
                                         shard_table, write_shard)
from compat_core.integrity import IntegrityError


def _build(root: str, rng) -> tuple[np.ndarray, str]:
    embeddings = rng.standard_normal((10, 4)).astype(np.float32)
    shards = [write_shard(root, shard_table(np.arange(s, s + 5), [f"id{i}" for i in range(s, s + 5)],
                                            embeddings[s:s + 5], "1", labels=np.arange(s, s + 5) % 3))
              for s in (0, 5)]
    head = commit_manifest(root, new_manifest(4, 10, {"name": "m", "version": "1"}, shards))
    return embeddings, head


def test_round_trip_override_and_guards(tmp_path):
    rng = np.random.default_rng(0)
    root = str(tmp_path / "index")
    embeddings, head = _build(root, rng)
    index = load_index(root)
    np.testing.assert_array_equal(index.embeddings, embeddings)
    assert index.item_ids.tolist() == [f"id{i}" for i in range(10)] and set(index.versions) == {"1"}
    assert index.labels.tolist() == [i % 3 for i in range(10)] and index.manifest_sha == head == read_head(root)
    # a chunk re-embedded by version 2 (positions 2, 7) flips with one manifest: the later shard wins
    new_rows = rng.standard_normal((2, 4)).astype(np.float32)
    entry = write_shard(root, shard_table([2, 7], ["id2", "id7"], new_rows, "2", labels=[2, 1]))
    manifest = {**index.manifest, "shards": index.manifest["shards"] + [entry]}
    flipped = commit_manifest(root, manifest, expected_head=head)
    index2 = load_index(root)
    assert index2.manifest_sha == flipped and index2.versions.tolist() == ["1", "1", "2"] + ["1"] * 4 + ["2", "1", "1"]
    np.testing.assert_array_equal(index2.embeddings[[2, 7]], new_rows)
    np.testing.assert_array_equal(load_index(root, head).embeddings, embeddings)   # the old manifest still reads
    with pytest.raises(ValueError, match="HEAD moved"):
        commit_manifest(root, manifest, expected_head=head)
    # a tampered shard is refused, naming the file and both hashes
    victim = tmp_path / "index" / entry["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=entry["file"].split("/")[-1]):
        load_index(root)
    # a manifest that leaves positions uncovered is refused
    commit_manifest(root, {**index.manifest, "shards": index.manifest["shards"][:1]})
    with pytest.raises(IntegrityError, match="5 of 10"):
        load_index(root)


def test_a_request_of_another_version_is_answered_from_the_versions_found_at_load(tmp_path):
    """The versions an index holds are found once at load (the distinct values of its (N,) column); a request
    embedded by another version gets the same answer as a check against the column: 400 naming the held versions
    when it holds none of that version's rows, 409 when it does, nothing when it is the serving version."""
    from cluster.serving.state import check_model_version
    from compat_core.retrieval.search_request import RequestError

    rng = np.random.default_rng(0)
    root = str(tmp_path / "index")
    embeddings, head = _build(root, rng)
    entry = write_shard(root, shard_table([2, 7], ["id2", "id7"], embeddings[[2, 7]], "2", labels=[2, 1]))
    _, manifest = read_manifest(root, head)
    commit_manifest(root, {**manifest, "shards": manifest["shards"] + [entry]}, expected_head=head)
    index = load_index(root)
    assert index.version_set == frozenset(index.versions.tolist()) == {"1", "2"}
    for serving in ("1", "2"):
        check_model_version(serving, index, None)
        check_model_version(serving, index, serving)
        other = "2" if serving == "1" else "1"
        with pytest.raises(RequestError, match=f"made by version {other}, the service now embeds with {serving}") \
                as conflict:
            check_model_version(serving, index, other)
        assert (conflict.value.status, conflict.value.field) == (409, "model_version")
        with pytest.raises(RequestError, match=r"unknown version '3': .* the index holds \['1', '2'\]") as unknown:
            check_model_version(serving, index, "3")
        assert (unknown.value.status, unknown.value.field) == (400, "model_version")


def test_missing_index_names_the_root(tmp_path):
    with pytest.raises(FileNotFoundError, match="compat index build"):
        read_head(str(tmp_path / "nowhere"))


@pytest.mark.integration
def test_index_on_s3(s3_bucket, fresh_object_storage):
    from cluster.storage import s3 as storage

    storage.configure_object_storage()  # undone after the test (fresh_object_storage)
    root = f"s3://{s3_bucket}/galleries/a"
    embeddings, head = _build(root, np.random.default_rng(1))
    index = load_index(root)
    assert index.manifest_sha == head
    np.testing.assert_array_equal(index.embeddings, embeddings)


@pytest.mark.integration
def test_an_ivfpq_index_on_s3_re_ranks_from_its_row_file_fetched_once(s3_bucket, fresh_object_storage, tmp_path,
                                                                      monkeypatch):
    """A lean load of an IVF-PQ index on S3 fetches its row file once into COMPAT_ROW_FILE_CACHE (digest checked),
    reuses it at the next load, fetches it again when the local copy was altered, and answers as the full load
    does (same candidates; its rows are the build's unit rows in fp16)."""
    import torch

    from cluster.serving.index_build import AnnSettings, build_search_entry
    from cluster.serving.state import build_state, search_summary
    from cluster.storage import s3 as storage
    from compat_core.retrieval.ann import stored_fp16_rows
    from compat_core.retrieval.mixed_gallery import search_groups, unit_rows
    from pipelines.config.model_uri import ModelUri

    storage.configure_object_storage()  # undone after the test (fresh_object_storage)
    monkeypatch.setenv("COMPAT_ROW_FILE_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(4)
    root = f"s3://{s3_bucket}/galleries/pq"
    rows = rng.standard_normal((600, 16))
    rows = (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float16).astype(np.float32)
    entry = build_search_entry(root, rows, rng.standard_normal((60, 16)), AnnSettings("ivfpq", 0.5, 60, 0), "1",
                               log=lambda _: None)
    shards = [write_shard(root, shard_table(np.arange(600), [f"id{i}" for i in range(600)], rows, "1"))]
    commit_manifest(root, new_manifest(16, 600, {"name": "m", "version": "1"}, shards, search=entry))
    lean = load_index(root, lean=True)
    cached = tmp_path / "cache" / f"{entry['row_file']['sha256']}.f16"
    assert lean.ann.row_file.path == str(cached) and cached.stat().st_size == 600 * 16 * 2
    stored = stored_fp16_rows(unit_rows(rows)).astype(np.float32)   # the build's unit rows, in fp16
    np.testing.assert_array_equal(lean.ann.row_file.stored_rows(0, 600), stored)
    stamp = cached.stat().st_mtime_ns
    assert load_index(root, lean=True).ann.row_file.path == str(cached) and cached.stat().st_mtime_ns == stamp
    data = bytearray(cached.read_bytes())
    data[3] ^= 0x01
    cached.write_bytes(bytes(data))
    np.testing.assert_array_equal(load_index(root, lean=True).row(0), stored[0])   # fetched again, intact
    state = build_state(ModelUri("m", "1"), None, lean, None, "auto")
    full = build_state(ModelUri("m", "1"), None, load_index(root), None, "auto")
    assert search_summary(state)["rerank"] == "row_file" and search_summary(full)["rerank"] == "gallery"
    queries = torch.from_numpy(rng.standard_normal((20, 16)).astype(np.float32))
    assert np.array_equal(search_groups(queries, state.groups, 3)[0], search_groups(queries, full.groups, 3)[0])


def test_ann_structure_beside_the_shards_is_digest_checked(tmp_path):
    """An index built with an approximate structure: the "search" entry records kind, parameters, the measured
    recall on the held-out sample and its seed; the structure loads with the index and a changed byte is refused."""
    from cluster.serving.index_build import AnnSettings, build_search_entry
    from compat_core.retrieval.ann import ann_search
    from compat_core.retrieval.search import PreparedGallery

    rng = np.random.default_rng(3)
    centres = rng.standard_normal((20, 16))
    gallery = (centres[rng.integers(0, 20, 2000)] + 0.3 * rng.standard_normal((2000, 16))).astype(np.float32)
    queries = (centres[rng.integers(0, 20, 300)] + 0.3 * rng.standard_normal((300, 16))).astype(np.float32)
    root = str(tmp_path / "index")
    shards = [write_shard(root, shard_table(np.arange(2000), [str(i) for i in range(2000)], gallery, "4"))]
    search = build_search_entry(root, gallery, queries, AnnSettings("ivf", 0.99, 200, 7), "4", log=lambda _: None)
    assert search["kind"] == "ivf" and search["recall"] >= 0.99 and search["sample"] == {"pool": "query",
                                                                                            "size": 200, "seed": 7}
    assert search["rows"] == 2000 and search["model_version"] == "4" and search["file"].startswith("ann/")
    commit_manifest(root, new_manifest(16, 2000, {"name": "m", "version": "4"}, shards, search=search))
    index = load_index(root)
    assert index.search_kind == "ivf" and index.ann.effort == search["effort"]
    # the stored effort reproduces the recall measured at build time on the same seeded sample
    rows = np.sort(np.random.default_rng(7).choice(300, 200, replace=False))
    prepared = PreparedGallery(gallery / np.linalg.norm(gallery, axis=1, keepdims=True))
    q = queries[rows].astype(np.float64)
    exact = np.argmax((gallery / np.linalg.norm(gallery, axis=1, keepdims=True)).astype(np.float64)
                      @ (q / np.linalg.norm(q, axis=1, keepdims=True)).T, axis=0)
    top1, _ = ann_search(queries[rows], prepared, index.ann, 1)
    assert float(np.mean(top1[:, 0].numpy() == exact)) == search["recall"]
    victim = tmp_path / "index" / search["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=search["sha256"]):
        load_index(root)
    with pytest.raises(ValueError, match="--kind 'annoy': expected one of flat, ivf, hnsw, ivfpq"):
        AnnSettings("annoy")
    with pytest.raises(ValueError, match=r"--recall 0: expected a fraction of exact Recall@1 in \(0, 1\]"):
        AnnSettings("ivf", 0)


def test_backfill_structures_flip_with_their_rows_and_the_old_one_retires(tmp_path, capsys):
    """A chunk's manifest carries a structure over exactly the rows the new version holds ("search_backfill",
    same kind, effort by the same recall rule) beside the old one, both loaded back and keyed by version; the
    manifest of the last chunk has the new structure as "search" and no other; `compat index show` prints both."""
    import json

    from app.cli import main
    from cluster.serving.backfill_job import _BackfillStructure, _chunk_manifest
    from cluster.serving.index_build import AnnSettings, build_search_entry

    rng = np.random.default_rng(3)
    root = str(tmp_path / "index")
    old, new, held_out = (rng.standard_normal((n, 8)).astype(np.float32) for n in (60, 60, 20))
    shard = write_shard(root, shard_table(np.arange(60), [str(i) for i in range(60)], old, "1"))
    search = build_search_entry(root, old, held_out, AnnSettings("hnsw", 1.0, 20, 0), "1", "query", log=print)
    head = commit_manifest(root, new_manifest(8, 60, {"name": "m", "version": "1"}, [shard], search=search))
    structure = _BackfillStructure(root, search, held_out, "2", log=print)
    versions, embeddings = np.array(["1"] * 60), old.copy()
    for chunk in (np.arange(0, 60, 3), np.setdiff1d(np.arange(60), np.arange(0, 60, 3))):
        embeddings[chunk], versions[chunk] = new[chunk], "2"
        entries = structure.entries(embeddings, versions)
        entry = write_shard(root, shard_table(chunk, [str(i) for i in chunk], new[chunk], "2"))
        _, manifest = read_manifest(root, head)
        head = commit_manifest(root, _chunk_manifest(manifest, head, entry, entries, {"done": int(chunk.size)}),
                               expected_head=head)
        index = load_index(root)
        if chunk.size == 20:
            assert index.manifest["search"] == search and index.manifest["search_backfill"]["rows"] == 20
            assert index.manifest["search_backfill"]["kind"] == "hnsw"
            assert index.manifest["search_backfill"]["recall"] == 1.0 and index.ann_backfill.size == 20
            assert {v: s.size for v, s in index.structures().items()} == {"1": 60, "2": 20}
            capsys.readouterr()
            assert main(["index", "show", root]) == 0
            shown = json.loads(capsys.readouterr().out)
            assert shown["search"]["model_version"] == "1" and shown["search_backfill"]["model_version"] == "2"
            assert shown["search_backfill"]["rows"] == 20 and "curve" not in shown["search_backfill"]
        else:
            assert "search_backfill" not in index.manifest and index.manifest["search"]["model_version"] == "2"
            assert index.manifest["search"]["rows"] == 60 and index.ann_backfill is None
            assert {v: s.size for v, s in index.structures().items()} == {"2": 60}


@pytest.mark.parametrize("kind", ["ivf", "hnsw", "ivfpq"])
def test_a_lean_load_keeps_the_rows_only_in_a_structure_that_holds_them_exactly(tmp_path, kind):
    """lean: an IVF / HNSW index of one version is held by its structure alone (its stored rows read back equal the
    fp16 rows given); IVF-PQ (lossy codes) by its codes and its row file, read per candidate (the fp16 rows given, its
    digest checked); a flat index and a gallery of two versions keep the loaded rows."""
    from cluster.serving.index_build import AnnSettings, build_search_entry
    from compat_core.retrieval.mixed_gallery import unit_rows

    rng = np.random.default_rng(1)
    root = str(tmp_path / "index")
    rows = rng.standard_normal((400, 8))
    rows = (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float16).astype(np.float32)
    entry = build_search_entry(root, rows, rng.standard_normal((50, 8)), AnnSettings(kind, 0.5, 50, 0), "1")
    shards = [write_shard(root, shard_table(np.arange(400), [f"id{i}" for i in range(400)], rows, "1"))]
    head = commit_manifest(root, new_manifest(8, 400, {"name": "m", "version": "1"}, shards, search=entry))
    lean = load_index(root, lean=True)
    assert lean.rows_in_structure and lean.embeddings is None
    assert (lean.size, lean.dim) == (400, 8) and lean.item_ids[399] == "id399"
    # the build stores L2-normalised fp32 rows: IVF keeps them in fp16 (the given fp16 rows back), HNSW in fp32,
    # IVF-PQ's row file in fp16 as IVF does
    unit = unit_rows(rows).numpy()
    expected = {"ivf": rows[123], "hnsw": unit[123], "ivfpq": rows[123]}[kind]
    np.testing.assert_array_equal(lean.row(123), expected)
    assert ("row_file" in entry) is (kind == "ivfpq") and (lean.ann.row_file is not None) is (kind == "ivfpq")
    if kind == "ivfpq":   # a row file altered after the build is refused, naming it
        path = tmp_path / "index" / entry["row_file"]["file"]
        data = bytearray(path.read_bytes())
        data[7] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(IntegrityError, match=entry["row_file"]["sha256"][:12]):
            load_index(root, lean=True)
        data[7] ^= 0x01
        path.write_bytes(bytes(data))
    assert not load_index(root).rows_in_structure          # the default load keeps the rows
    other = write_shard(root, shard_table([5], ["id5"], rows[6:7], "2"))
    commit_manifest(root, {**lean.manifest, "shards": lean.manifest["shards"] + [other]}, expected_head=head)
    mixed = load_index(root, lean=True)
    assert not mixed.rows_in_structure and mixed.versions[5] == "2"
    flat = str(tmp_path / "flat")
    commit_manifest(flat, new_manifest(8, 400, {"name": "m", "version": "1"},
                                       [write_shard(flat, shard_table(np.arange(400), range(400), rows, "1"))]))
    assert not load_index(flat, lean=True).rows_in_structure


def test_serving_state_of_a_lean_index_searches_the_stored_rows_and_refuses_a_gallery_adapter(tmp_path):
    """build_state over a lean IVF index: one version group with no prepared gallery whose answers equal fp64 brute
    force over the structure's stored rows (ties to the lowest row); a gallery adapter (it maps stored rows) needs
    the rows loaded and is refused on a lean index, accepted on a full one."""
    import torch

    from cluster.serving.index_build import AnnSettings, build_search_entry
    from cluster.serving.state import build_state
    from compat_core.kinds import GALLERY_ADAPTERS
    from compat_core.retrieval.mixed_gallery import search_groups, unit_rows
    from pipelines.config.model_uri import ModelUri

    rng = np.random.default_rng(2)
    root = str(tmp_path / "index")
    rows = rng.standard_normal((300, 8)).astype(np.float32)
    rows[250] = rows[40]                                      # a tie: row 40 first
    entry = build_search_entry(root, rows, rng.standard_normal((40, 8)), AnnSettings("ivf", 0.9, 40, 0), "1")
    shards = [write_shard(root, shard_table(np.arange(300), [f"id{i}" for i in range(300)], rows, "1"))]
    commit_manifest(root, new_manifest(8, 300, {"name": "m", "version": "1"}, shards, search=entry))
    state = build_state(ModelUri("m", "1"), None, load_index(root, lean=True), None, "auto")
    assert len(state.groups) == 1 and state.groups[0].prepared is None and state.groups[0].ann is not None
    stored = state.index.ann.stored_rows(0, 300).astype(np.float64)
    stored /= np.linalg.norm(stored, axis=1, keepdims=True)
    queries = np.vstack([rows[40], rng.standard_normal((20, 8))]).astype(np.float32)
    positions, scores, _ = search_groups(torch.from_numpy(queries), state.groups, 3)
    answered = 0
    for query, got, got_scores in zip(unit_rows(queries).double().numpy(), positions, scores):
        brute = stored @ (query / np.linalg.norm(query))     # the fp32 unit query, scored in fp64
        order = np.lexsort((np.arange(300), -brute))[:3]
        if got.tolist() != order.tolist():    # the structure may miss a row; recall target 0.9, not 1
            continue
        answered += 1
        np.testing.assert_allclose(got_scores, brute[order], rtol=0, atol=1e-12)
    assert positions[0][:2].tolist() == [40, 250] and answered >= 18
    adapter = (GALLERY_ADAPTERS[0], "1", None)
    with pytest.raises(ValueError, match="gallery adapter needs them loaded"):
        build_state(ModelUri("m", "2"), None, load_index(root, lean=True), adapter, "auto")
    full = build_state(ModelUri("m", "2"), None, load_index(root), (GALLERY_ADAPTERS[0], "1", _Identity()), "auto")
    assert full.groups[0].prepared is not None and full.groups[0].ann is None and full.adapter[1] == "1"


class _Identity:
    """A gallery adapter stand-in that leaves the rows as they are."""

    def apply(self, rows):
        return rows


def test_ids_and_payloads_of_varied_lengths_and_unicode_read_back_and_answer_as_given(tmp_path):
    """Item ids and payload URIs of every length (empty, one character, several hundred) and script (accents,
    CJK, emoji), some payloads null, a later shard overriding some rows: the loaded columns equal the strings as
    written position by position (one at a time, by an array of positions, all at once), for a full and a lean
    load, and a served answer serialises to the same JSON bytes as one built from plain Python strings."""
    import json
    from types import SimpleNamespace

    import torch

    from cluster.serving.app import _answer
    from cluster.serving.index_build import AnnSettings, build_search_entry
    from cluster.serving.state import build_state
    from compat_core.retrieval.mixed_gallery import search_groups
    from pipelines.config.model_uri import ModelUri

    rng = np.random.default_rng(3)
    root, count = str(tmp_path / "index"), 120
    shapes = ["", "a", "é", "日本語の商品", "🙂" * 3, "x" * 300, "naïve-ü-", "ID\u00a0with space", "Ωmega/ß"]
    ids = [shapes[i % len(shapes)] + (str(i) if i % 4 else "") for i in range(count)]
    payloads = [None if i % 3 == 0 else f"s3://bücket/画像/{ids[i]}.jpg" for i in range(count)]
    rows = rng.standard_normal((count, 8))
    rows = (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float16).astype(np.float32)
    entry = build_search_entry(root, rows, rng.standard_normal((40, 8)), AnnSettings("ivf", 0.5, 40, 0), "1")
    shards = [write_shard(root, shard_table(np.arange(s, s + 60), ids[s:s + 60], rows[s:s + 60], "1",
                                            payload_uris=payloads[s:s + 60])) for s in (60, 0)]   # out of order
    overridden = [7, 64, 119]
    for position, new_id, new_payload in zip(overridden, ["", "新しい🙂", "z" * 70], ["s3://ü/1", None, ""]):
        ids[position], payloads[position] = new_id, new_payload
    shards.append(write_shard(root, shard_table(overridden, [ids[p] for p in overridden], rows[overridden], "1",
                                                payload_uris=[payloads[p] for p in overridden])))
    commit_manifest(root, new_manifest(8, count, {"name": "m", "version": "1"}, shards, search=entry))
    picked = np.array([119, 0, 7, 64, 5, 5])
    for lean in (False, True):
        index = load_index(root, lean=lean)
        assert index.rows_in_structure is lean
        assert index.item_ids.tolist() == ids and index.payload_uris.tolist() == payloads
        assert [index.item_ids[p] for p in range(count)] == ids and index.item_ids[np.int64(64)] == "新しい🙂"
        assert index.item_ids[picked].tolist() == [ids[p] for p in picked]
        assert index.payload_uris[picked].tolist() == [payloads[p] for p in picked]
        assert len(index.item_ids) == index.size == count and index.item_ids[-1] == ids[-1]
        state = build_state(ModelUri("m", "1"), None, index, None, "auto")
        positions, scores, groups = search_groups(torch.from_numpy(rows[[7, 64, 30]]), state.groups, 4)
        for row in range(3):
            answer = _answer(state, SimpleNamespace(k=4, include_payload=True), positions[row], scores[row],
                             groups[row])
            expected = [{"id": ids[p], "position": int(p), "score": float(s), "item_version": "1", "adapter": None,
                         "payload_uri": payloads[p]} for p, s in zip(positions[row], scores[row])]
            assert json.dumps(answer["results"], allow_nan=False) == json.dumps(expected, allow_nan=False)
        assert positions[:, 0].tolist() == [7, 64, 30]     # each stored row finds itself first
