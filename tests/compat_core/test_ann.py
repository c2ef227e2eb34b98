"""The approximate candidate stage (faiss) + exact re-rank against an fp64 brute force on clustered synthetic rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compat_core.retrieval.ann import (
    KINDS,
    AnnIndex,
    ann_search,
    build_ann,
    candidate_count,
    default_params,
    recall_of_exact,
    tune_ann,
)
from compat_core.retrieval.search import PreparedGallery, search_candidates


def _clustered(count: int, dim: int, classes: int, seed: int, centres=None):
    gen = torch.Generator().manual_seed(seed)
    if centres is None:
        centres = torch.nn.functional.normalize(torch.randn(classes, dim, generator=gen), dim=1)
    labels = torch.randint(0, classes, (count,), generator=gen)
    return (centres[labels] + 0.6 * torch.randn(count, dim, generator=gen) / dim ** 0.5).float(), centres


@pytest.fixture(scope="module")
def data():
    gallery, centres = _clustered(3000, 24, 40, 0)
    sample, _ = _clustered(200, 24, 40, 1, centres)
    fresh, _ = _clustered(200, 24, 40, 2, centres)
    return gallery, sample, fresh, PreparedGallery(gallery)


def _brute(query: torch.Tensor, gallery: torch.Tensor, k: int, allowed: np.ndarray | None = None):
    """fp64 top-k by (score descending, row ascending), optionally among ``allowed`` rows only."""
    q = query.double().numpy()
    g = gallery.double().numpy()
    scores = (g / np.linalg.norm(g, axis=1, keepdims=True)) @ (q / np.linalg.norm(q))
    rows = np.arange(g.shape[0]) if allowed is None else np.unique(allowed[allowed >= 0])
    order = rows[np.lexsort((rows, -scores[rows]))][:k]
    return order, scores[order]


@pytest.mark.parametrize("kind", ["ivf", "hnsw", "ivfpq"])
def test_tuned_ann_reranked_equals_brute_force_over_its_candidates(data, kind):
    gallery, sample, fresh, prepared = data
    ann = build_ann(gallery, kind)
    measured = tune_ann(ann, prepared, sample, 0.99)
    exact_sample = np.array([_brute(row, gallery, 1)[0][0] for row in sample])
    top_sample, _ = ann_search(sample, prepared, ann, 1)
    assert measured["recall"] >= 0.99
    assert measured["recall"] == recall_of_exact(top_sample[:, 0].numpy(), exact_sample)
    assert measured["curve"][-1] == [next(iter(measured["effort"].values())), measured["recall"]]
    # the smallest effort of the ladder that reaches the target: every earlier rung missed it
    assert all(value < 0.99 for _, value in measured["curve"][:-1])
    k = 5
    index, score = ann_search(fresh, prepared, ann, k)
    candidates = ann.candidates(fresh, candidate_count(k, prepared.size, kind))
    exact_top1 = []
    for row in range(fresh.shape[0]):
        order, scores = _brute(fresh[row], gallery, k, candidates[row])
        assert index[row].tolist() == order.tolist()
        np.testing.assert_allclose(score[row].numpy(), scores, rtol=0, atol=1e-12)
        exact_top1.append(_brute(fresh[row], gallery, 1)[0][0])
    assert recall_of_exact(index[:, 0].numpy(), np.array(exact_top1)) >= 0.95


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_exact_ties_go_to_the_lowest_row(data, kind):
    gallery, _, _, _ = data
    gallery = gallery.clone()
    for row in (700, 1500, 2999):
        gallery[row] = gallery[5]
    prepared = PreparedGallery(gallery)
    ann = build_ann(gallery, kind)
    ann.set_effort({"efSearch": 256} if kind == "hnsw" else {"nprobe": int(ann.params["nlist"])})
    index, score = ann_search(gallery[5:6] * 3.0, prepared, ann, 3)
    assert index[0].tolist() == [5, 700, 1500]
    assert score[0, 0] == score[0, 1] == score[0, 2]


def test_search_candidates_orders_duplicates_and_padding(data):
    gallery, sample, _, prepared = data
    candidates = np.array([[40, -1, 7, 40, 2999, 7], [1, 2, 3, -1, -1, -1]])
    index, score = search_candidates(sample[:2], prepared, candidates, 3)
    for row in range(2):
        order, scores = _brute(sample[row], gallery, 3, candidates[row])
        assert index[row].tolist() == order.tolist()
        np.testing.assert_allclose(score[row].numpy(), scores, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="query row 0 has fewer than k = 4"):
        search_candidates(sample[:2], prepared, candidates, 4)
    with pytest.raises(ValueError, match="candidates: expected gallery rows in 0..2999"):
        search_candidates(sample[:1], prepared, np.array([[3000]]), 1)


def test_rows_the_structure_cannot_fill_are_searched_exactly(data):
    gallery, sample, _, prepared = data
    ann = build_ann(gallery, "ivf", {"nlist": 60})
    ann.set_effort({"nprobe": 1})
    # k above what one list holds: the structure returns -1 padding, so those rows take the exact path
    index, _ = ann_search(sample[:3], prepared, ann, 200)
    for row in range(3):
        assert index[row].tolist() == _brute(sample[row], gallery, 200)[0].tolist()


def test_bytes_round_trip_and_refusals(data):
    gallery, sample, _, prepared = data
    ann = build_ann(gallery, "hnsw")
    ann.set_effort({"efSearch": 48})
    again = AnnIndex.from_bytes(ann.to_bytes(), "hnsw", ann.params, ann.effort)
    assert np.array_equal(again.candidates(sample, 32), ann.candidates(sample, 32))
    with pytest.raises(ValueError, match="ann/x.faiss: not a faiss index"):
        AnnIndex.from_bytes(b"not faiss", "hnsw", ann.params, ann.effort, "ann/x.faiss")
    with pytest.raises(ValueError, match=r"kind: expected one of \('flat', 'ivf', 'hnsw', 'ivfpq'\), got 'lsh'"):
        build_ann(gallery, "lsh")
    with pytest.raises(ValueError, match="kind 'flat' is the exact kernel alone"):
        build_ann(gallery, "flat")
    with pytest.raises(ValueError, match=r"recall: expected a fraction in \(0, 1\], got 1.5"):
        tune_ann(ann, prepared, sample, 1.5)
    with pytest.raises(ValueError, match="a hnsw index takes {'efSearch': positive int}"):
        ann.set_effort({"nprobe": 3})
    with pytest.raises(ValueError, match="does not match the gallery's 10 x 24"):
        ann_search(sample, PreparedGallery(gallery[:10]), ann, 1)
    assert set(KINDS) == {"flat", "ivf", "hnsw", "ivfpq"}


def test_default_params_follow_the_size():
    assert default_params("ivf", 1_000_000, 512) == {"nlist": 2000}
    assert default_params("ivf", 30, 9) == {"nlist": 1}
    assert default_params("ivfpq", 200_000, 512) == {"nlist": 894, "pq_m": 128, "pq_bits": 8}
    assert default_params("hnsw", 10, 4) == {"M": 32, "efConstruction": 64}


def test_version_group_uses_the_structure_only_over_the_rows_it_was_built_on(data):
    from compat_core.retrieval.mixed_gallery import build_groups, search_groups

    gallery, sample, _, _ = data
    ann = build_ann(gallery, "ivf")
    ann.set_effort({"nprobe": int(ann.params["nlist"])})
    versions = np.array(["1"] * gallery.shape[0])
    groups = build_groups(gallery.numpy(), versions, ann=ann, ann_version="1")
    assert groups[0].ann is ann
    positions, scores, _ = search_groups(sample[:20], groups, 3)
    for row in range(20):
        order, expected = _brute(sample[row], gallery, 3)
        assert positions[row].tolist() == order.tolist()
        np.testing.assert_allclose(scores[row], expected, rtol=0, atol=1e-6)   # the query is made unit in fp32
    backfilled = versions.copy()
    backfilled[[3, 30]] = "2"   # two rows re-embedded by another version: masked in the structure of group "1"
    old, new = build_groups(gallery.numpy(), backfilled, ann=ann, ann_version="1")
    assert old.ann is ann and old.ann_subset.rows.tolist() == old.positions.tolist() and new.ann is None
    assert 3 not in old.positions and 30 not in old.positions
    small = build_ann(gallery[:5], "hnsw")   # 5 rows: neither the gallery's 3000 nor group "2"'s 2
    assert build_groups(gallery.numpy(), backfilled, structures={"2": small})[1].ann is None
    adapted = build_groups(gallery.numpy(), versions, gallery_maps={"1": lambda rows: rows * 2}, ann=ann,
                           ann_version="1")
    assert adapted[0].ann is None
    assert build_groups(gallery.numpy(), versions, ann=ann, ann_version="7")[0].ann is None
