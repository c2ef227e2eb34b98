"""compat_core.retrieval.search against numpy float64 brute force and hand-worked examples."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from compat_core.evaluation.verification import tar_at_far
from compat_core.hardware.torch_settings import one_thread
from compat_core.retrieval import bridge as retrieval_bridge
from compat_core.retrieval import candidates as retrieval_candidates
from compat_core.retrieval import kernel as retrieval_kernel
from compat_core.retrieval import live as retrieval_live
from compat_core.retrieval import pruned as retrieval_pruned
from compat_core.retrieval import search as retrieval
from compat_core.retrieval import space as retrieval_space
from compat_core.retrieval.bridge import bridged_nearest_neighbours, bridged_recall_at_1
from compat_core.retrieval.int8 import quantize_rows, select_top1
from compat_core.retrieval.search import (
    class_mean_gallery,
    mean_average_precision,
    nearest_neighbours,
    recall_at_1,
    recall_at_k,
)

PRECISIONS = ["auto", "int8", "half", "fp32", "fp64"]


def patch_fastest_matmul(monkeypatch, fastest) -> None:
    """The calibration's answer, as seen by the gallery preparation ("auto") and by the kernel's demotion."""
    monkeypatch.setattr(retrieval_space, "fastest_matmul", fastest)
    monkeypatch.setattr(retrieval_kernel, "fastest_matmul", fastest)


def brute_topk(query: np.ndarray, gallery: np.ndarray, k: int):
    """fp64 cosine top-k; einsum without BLAS so identical gallery rows get bit-identical scores."""
    q = query.astype(np.float64)
    g = gallery.astype(np.float64)
    q = q / np.linalg.norm(q, axis=1, keepdims=True)
    g = g / np.linalg.norm(g, axis=1, keepdims=True)
    scores = np.einsum("qd,gd->qg", q, g, optimize=False)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]     # stable: lowest index first among ties
    return order, np.take_along_axis(scores, order, axis=1)


def planted(nq: int, ng: int, dim: int, seed: int):
    """Random data with exact ties (duplicated gallery rows) and one-ulp near-ties, each the answer of a query."""
    rng = np.random.default_rng(seed)
    gallery = rng.standard_normal((ng, dim)).astype(np.float32)
    query = rng.standard_normal((nq, dim)).astype(np.float32)
    # exact ties: rows 3 and ng-2 copy row ng-1; query 0 sits next to them, so the lowest index (3) must win
    gallery[3] = gallery[ng - 1]
    gallery[ng - 2] = gallery[ng - 1]
    query[0] = gallery[ng - 1] + np.float32(0.01) * rng.standard_normal(dim).astype(np.float32)
    # near-tie: row 5 is row 1 with one component moved by one ulp; query 1 sits next to both
    gallery[5] = gallery[1]
    c = int(np.argmax(np.abs(gallery[1])))
    gallery[5, c] = np.nextafter(gallery[1, c], np.float32(np.inf) * np.sign(gallery[1, c]), dtype=np.float32)
    query[1] = gallery[1] + np.float32(0.01) * rng.standard_normal(dim).astype(np.float32)
    return query, gallery


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", [(37, 50, 8), (130, 257, 33), (300, 600, 96)])
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_top1_and_scores_equal_fp64_brute_force(precision, shape, chunk_size):
    query, gallery = planted(*shape, seed=sum(shape))
    expected, expected_scores = brute_topk(query, gallery, 1)
    index, scores = nearest_neighbours(torch.from_numpy(query), torch.from_numpy(gallery), k=1,
                                       chunk_size=chunk_size, precision=precision)
    np.testing.assert_array_equal(index.numpy(), expected)
    np.testing.assert_allclose(scores.numpy(), expected_scores, rtol=0, atol=1e-12)
    index_only, none = nearest_neighbours(query, gallery, k=1, chunk_size=chunk_size, precision=precision,
                                          return_scores=False)
    assert none is None
    np.testing.assert_array_equal(index_only.numpy(), expected)
    assert int(index[0, 0]) == 3                      # lowest of the three identical rows


@pytest.mark.parametrize("precision", PRECISIONS)
def test_topk_order_with_ties_equals_fp64(precision):
    query, gallery = planted(90, 211, 24, seed=5)
    expected, expected_scores = brute_topk(query, gallery, 5)
    index, scores = nearest_neighbours(query, gallery, k=5, chunk_size=13, precision=precision)
    np.testing.assert_array_equal(index.numpy(), expected)
    np.testing.assert_allclose(scores.numpy(), expected_scores, rtol=0, atol=1e-12)
    assert index[0, :3].tolist() == [3, 209, 210]     # the three identical rows, in index order


def test_near_tie_one_ulp_apart_is_resolved_like_fp64():
    query, gallery = planted(40, 64, 16, seed=11)
    expected, _ = brute_topk(query, gallery, 1)
    assert expected[1, 0] in (1, 5)                   # the planted near-tie is really the answer of query 1
    for precision in PRECISIONS:
        index, _ = nearest_neighbours(query, gallery, k=1, precision=precision, return_scores=False)
        assert int(index[1, 0]) == int(expected[1, 0]), precision


def test_fp64_inputs_with_1e_12_gaps():
    rng = np.random.default_rng(3)
    gallery = rng.standard_normal((50, 12))
    query = gallery[[7]] + 1e-3 * rng.standard_normal((1, 12))
    gallery[20] = gallery[7] + 1e-11 * rng.standard_normal(12)        # far below fp32 resolution
    expected, expected_scores = brute_topk(query, gallery, 2)
    assert sorted(expected[0].tolist()) == [7, 20]
    assert 0 < expected_scores[0, 0] - expected_scores[0, 1] < 1e-9
    for precision in PRECISIONS:
        index, _ = nearest_neighbours(torch.from_numpy(query), torch.from_numpy(gallery), k=2, precision=precision)
        assert index[0].tolist() == expected[0].tolist(), precision


def test_heavily_duplicated_gallery_falls_back_and_stays_exact():
    # 300 identical rows exceed the candidate cap: the fallback chain must still return the lowest index
    rng = np.random.default_rng(8)
    gallery = rng.standard_normal((400, 10)).astype(np.float32)
    gallery[50:350] = gallery[49]
    query = gallery[[49]] + np.float32(1e-3)
    for precision in PRECISIONS:
        index, _ = nearest_neighbours(query, gallery, k=3, precision=precision)
        assert index[0].tolist() == [49, 50, 51], precision


def test_recall_at_k_hand_worked():
    # cos(q, g0) = 1/sqrt(1.01) = 0.995, cos(q, g2) = 1.1/sqrt(2.02) = 0.774, cos(q, g1) = 0.1/sqrt(1.01) = 0.0995
    gallery = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=np.float32)
    gallery_labels = np.array([0, 1, 2])
    query = np.array([[1.0, 0.1], [0.0, 2.0]], dtype=np.float32)
    query_labels = np.array([2, 1])
    # query 0 ranks g0, g2, g1: wrong at 1, right at 2; query 1 ranks g1 first: right at 1
    assert recall_at_1(query, query_labels, gallery, gallery_labels) == pytest.approx(0.5)
    assert recall_at_k(query, query_labels, gallery, gallery_labels, k=2) == pytest.approx(1.0)


def test_recall_matches_brute_force_on_random_data():
    rng = np.random.default_rng(1)
    query = rng.standard_normal((200, 20)).astype(np.float32)
    gallery = rng.standard_normal((300, 20)).astype(np.float32)
    q_labels = rng.integers(0, 5, 200)
    g_labels = rng.integers(0, 5, 300)
    order, _ = brute_topk(query, gallery, 4)
    for k in (1, 4):
        expected = np.mean(np.any(g_labels[order[:, :k]] == q_labels[:, None], axis=1))
        assert recall_at_k(query, q_labels, gallery, g_labels, k, chunk_size=33) == pytest.approx(expected)


def test_mean_average_precision_hand_worked():
    angles = np.deg2rad([0.0, 30.0, 60.0, 90.0])
    gallery = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    gallery_labels = np.array(["A", "B", "A", "B"])
    query = np.array([[1.0, 0.0], [1.0, 0.0]])
    # query "A" ranks g0 (A), g1 (B), g2 (A), g3 (B): AP = (1/1 + 2/3) / 2 = 5/6; query "C" has no relevant item
    query_labels = np.array(["A", "C"])
    assert mean_average_precision(query, query_labels, gallery, gallery_labels) == pytest.approx(5 / 6)
    assert mean_average_precision(query, query_labels, gallery, gallery_labels,
                                  no_relevant="zero") == pytest.approx(5 / 12)
    with pytest.raises(ValueError, match="query_labels"):
        mean_average_precision(query[1:], query_labels[1:], gallery, gallery_labels)


def test_mean_average_precision_ties_rank_lowest_index_first():
    gallery = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    query = np.array([[1.0, 0.0]])
    # g0 (B) and g1 (A) tie: g0 ranks first, so the relevant g1 is at rank 2: AP = 1/2
    assert mean_average_precision(query, ["A"], gallery, ["B", "A", "C"]) == pytest.approx(0.5)


def test_class_mean_gallery_normalises_each_feature_first():
    features = np.array([[3.0, 0.0], [0.0, 4.0], [0.0, -2.0]])
    labels = np.array([7, 7, 2])
    templates, template_labels = class_mean_gallery(features, labels)
    assert template_labels.tolist() == [2, 7]
    # class 7: mean of units (1,0) and (0,1) = (0.5, 0.5) -> (1/sqrt2, 1/sqrt2), not the raw mean's (0.6, 0.8)
    np.testing.assert_allclose(templates.numpy(), [[0.0, -1.0], [1 / math.sqrt(2), 1 / math.sqrt(2)]], atol=1e-7)


def random_heads(seed: int, d: int = 40, m: int = 12):
    gen = torch.Generator().manual_seed(seed)
    head_t = torch.randn(d, m, generator=gen)
    head_k = head_t + 0.5 * torch.randn(d, m, generator=gen)
    query = torch.randn(150, m, generator=gen)
    gallery = torch.randn(230, m, generator=gen)
    return query, head_t, gallery, head_k


@pytest.mark.parametrize("precision", PRECISIONS)
def test_bridge_equals_direct_features(precision):
    query, head_t, gallery, head_k = random_heads(0)
    gallery[17] = gallery[200]                        # exact tie: identical embeddings give identical features
    query[0] = gallery[200] + 0.01
    direct_q = (query.double() @ head_t.double().t()).numpy()   # (Nq, d) features the bridge never forms
    direct_g = (gallery.double() @ head_k.double().t()).numpy()
    expected, expected_scores = brute_topk(direct_q, direct_g, 3)
    index, scores = bridged_nearest_neighbours(query, head_t, gallery, head_k, k=3, chunk_size=41,
                                               precision=precision)
    np.testing.assert_array_equal(index.numpy(), expected)
    np.testing.assert_allclose(scores.numpy(), expected_scores, rtol=0, atol=1e-10)
    assert index[0, :2].tolist() == [17, 200]
    labels_q = np.arange(150) % 7
    labels_g = np.arange(230) % 7
    expected_recall = np.mean(labels_g[expected[:, 0]] == labels_q)
    assert bridged_recall_at_1(query, head_t, gallery, head_k, labels_q, labels_g,
                               precision=precision) == pytest.approx(expected_recall)


def test_bridge_names_the_first_gallery_row_without_a_feature():
    query, head_t, gallery, head_k = random_heads(1)
    head_k[:, 3] = 0.0                                 # embedding direction 3 maps to the zero feature
    gallery[9] = 0.0
    gallery[9, 3] = 1.0
    gallery[5] = gallery[9]                            # the same row earlier: the first one is named
    with pytest.raises(ValueError, match="gallery_embed: row 5 maps to a zero feature"):
        bridged_nearest_neighbours(query, head_t, gallery, head_k)


def test_bridge_gives_duplicate_embeddings_bit_identical_vectors():
    """Each distinct embedding is computed once and copied: duplicates anywhere in the gallery (other blocks,
    other positions) get the same fp64 vector, so their exact ties go to the lowest index on any device."""
    query, head_t, gallery, head_k = random_heads(2)
    gallery = gallery.repeat(40, 1)                    # 9,200 rows: each of 230 embeddings 40 times
    space = retrieval_bridge._bridge_space(gallery, head_t, head_k, "fp32")
    rows = space.exact_rows(torch.arange(gallery.shape[0]))
    assert torch.equal(rows.view(40, 230, -1), rows[:230].expand(40, -1, -1))
    index, _ = bridged_nearest_neighbours(query, head_t, gallery, head_k, k=1)
    assert int(index.max()) < 230                      # every answer is the first copy


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bridge_breaks_exact_ties_by_index():
    query, head_t, gallery, head_k = random_heads(3)
    gallery = gallery.repeat(40, 1)
    direct_q = (query.double() @ head_t.double().t()).numpy()
    direct_g = (gallery.double() @ head_k.double().t()).numpy()
    expected, _ = brute_topk(direct_q, direct_g, 1)
    index, _ = bridged_nearest_neighbours(query.cuda(), head_t.cuda(), gallery.cuda(), head_k.cuda(), k=1)
    np.testing.assert_array_equal(index.cpu().numpy(), expected)


def test_half_path_is_really_taken_when_forced(monkeypatch):
    calls = []
    original = retrieval_kernel._half_scores

    def spy(qh, half_t):
        calls.append(qh.dtype)
        return original(qh, half_t)

    monkeypatch.setattr(retrieval_kernel, "_half_scores", spy)
    query, gallery = planted(20, 30, 8, seed=2)
    nearest_neighbours(query, gallery, precision="half")
    assert calls and calls[0] in (torch.bfloat16, torch.float16)
    calls.clear()
    nearest_neighbours(query, gallery, precision="fp32")
    assert calls == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_down_never_exceeds_the_value(dtype):
    values = torch.tensor([0.3, -0.3, 0.0, 1e-30, -1e-30, 0.99999, -2.5e-5, 7.0], dtype=torch.float64)
    rounded = retrieval_candidates._round_down(values, dtype)
    assert rounded.dtype == dtype
    assert bool((rounded.double() <= values).all())
    # and it is the largest such value: the next representable value up exceeds the input
    up = torch.nextafter(rounded.float(), torch.tensor(math.inf)).to(dtype) if dtype == torch.float32 else None
    if up is not None:
        assert bool((up.double() > values).all())


def test_input_validation_names_the_field():
    gallery = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="precision"):
        nearest_neighbours(gallery, gallery, precision="int4")
    with pytest.raises(ValueError, match="query/gallery"):
        nearest_neighbours(np.ones((2, 5)), gallery)
    with pytest.raises(ValueError, match="k:"):
        nearest_neighbours(gallery, gallery, k=5)
    zero = gallery.copy()
    zero[2] = 0
    with pytest.raises(ValueError, match="gallery: row 2"):
        nearest_neighbours(gallery, zero)
    with pytest.raises(ValueError, match="query_labels"):
        recall_at_1(gallery, [0, 1], gallery, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="gallery_head"):
        bridged_nearest_neighbours(np.ones((2, 3)), np.ones((5, 3)), np.ones((2, 3)), np.ones((5, 4)))
    with pytest.raises(ValueError, match="far"):
        tar_at_far([0.1, 0.2], [True, False], 1.5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_fp64_brute_force():
    query, gallery = planted(200, 300, 40, seed=9)
    expected, _ = brute_topk(query, gallery, 2)
    index, _ = nearest_neighbours(torch.from_numpy(query).cuda(), torch.from_numpy(gallery).cuda(), k=2)
    np.testing.assert_array_equal(index.cpu().numpy(), expected)


def tied_at_odd_width(seed: int, count: int = 3000, dim: int = 1023):
    """Gallery rows 2i+1 copy rows 2i (i < 200): rows of 1023 values start at every alignment, where a device's
    row reduction can round identical rows differently; query i sits next to row 2i, whose lower index must win."""
    rng = np.random.default_rng(seed)
    gallery = rng.standard_normal((count, dim)).astype(np.float32)
    gallery[1:400:2] = gallery[0:400:2]
    query = rng.standard_normal((1000, dim)).astype(np.float32)
    query[:200] = gallery[0:400:2] + np.float32(0.01) * rng.standard_normal((200, dim)).astype(np.float32)
    return query, gallery


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["auto", "int8", "bf16", "fp32", "fp64"])
def test_cuda_exact_ties_at_odd_width_go_to_the_lowest_index(precision):
    query, gallery = tied_at_odd_width(seed=21)
    expected, _ = brute_topk(query, gallery, 1)
    assert (expected[:200, 0] == np.arange(0, 400, 2)).all()
    index, _ = nearest_neighbours(torch.from_numpy(query).cuda(), torch.from_numpy(gallery).cuda(), k=1,
                                  precision=precision)
    np.testing.assert_array_equal(index.cpu().numpy(), expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pruned_search_breaks_exact_ties_at_odd_width_by_index():
    query, gallery = tied_at_odd_width(seed=22)
    labels = np.arange(len(gallery)) % 20
    expected, _ = brute_topk(query, gallery, 1)
    index, _, report = retrieval_pruned.search_top1(torch.from_numpy(query).cuda(), torch.from_numpy(gallery).cuda(),
                                                    retrieval._group_search(None), labels=labels, prune="always")
    assert report.pruned
    np.testing.assert_array_equal(index.cpu().numpy(), expected[:, 0])


def junction_features(count: int, dim: int, rank: int, seed: int, head=None):
    """Rows of h @ A^T: features of a bias-free linear junction, rank <= ``rank`` < dim."""
    rng = np.random.default_rng(seed)
    head = rng.standard_normal((dim, rank)) if head is None else head
    return (rng.standard_normal((count, rank)) @ head.T).astype(np.float32), head


def low_rank_space_used(monkeypatch, query, gallery):
    """Run with the query-count gate off and report whether the rank-r half stage was built."""
    monkeypatch.setattr(retrieval_space, "_LOW_RANK_MIN_QUERIES_PER_DIM", 0)
    built = []
    original = retrieval._direct_space

    def spy(*args, **kwargs):
        space = original(*args, **kwargs)
        built.append(space.projection)
        return space

    monkeypatch.setattr(retrieval, "_direct_space", spy)
    return built


@pytest.mark.parametrize("precision", ["half", "int8"])
@pytest.mark.parametrize("k", [1, 3])
def test_low_rank_path_equals_fp64_with_ties_and_queries_outside_the_span(monkeypatch, k, precision):
    gallery, head = junction_features(400, 96, 20, seed=1)
    in_span, _ = junction_features(150, 96, 20, seed=2, head=head)
    outside = np.random.default_rng(3).standard_normal((150, 96)).astype(np.float32)   # not in the span
    query = np.concatenate([in_span, outside])
    gallery[7] = gallery[390]                           # exact ties: rows 7, 200, 390 identical
    gallery[200] = gallery[390]
    query[0] = gallery[390] + np.float32(0.01) * gallery[5]
    gallery[11] = gallery[3]                             # near-tie: one ulp apart in one component
    c = int(np.argmax(np.abs(gallery[3])))
    gallery[11, c] = np.nextafter(gallery[3, c], np.float32(np.inf) * np.sign(gallery[3, c]), dtype=np.float32)
    query[1] = gallery[3] + np.float32(0.01) * gallery[6]
    built = low_rank_space_used(monkeypatch, query, gallery)
    expected, expected_scores = brute_topk(query, gallery, k)
    index, scores = nearest_neighbours(query, gallery, k=k, chunk_size=64, precision=precision)
    assert built and built[0] is not None and built[0].basis.shape == (96, 20)
    assert built[0].residual_max < 1e-3
    np.testing.assert_array_equal(index.numpy(), expected)
    np.testing.assert_allclose(scores.numpy(), expected_scores, rtol=0, atol=1e-12)
    assert int(index[0, 0]) == 7                          # lowest of the identical rows
    assert int(index[1, 0]) == int(expected[1, 0]) and int(expected[1, 0]) in (3, 11)
    only, _ = nearest_neighbours(query, gallery, k=1, precision=precision, return_scores=False)
    np.testing.assert_array_equal(only.numpy(), expected[:, :1])


@pytest.mark.parametrize("precision", ["half", "int8"])
def test_low_rank_path_on_an_approximately_low_rank_gallery(monkeypatch, precision):
    gallery, head = junction_features(300, 128, 16, seed=4)
    rng = np.random.default_rng(5)
    # tiny full-rank noise: still projected, the residual enters the bound
    noisy = gallery + np.float32(1e-6) * np.linalg.norm(gallery, axis=1, keepdims=True) * \
        rng.standard_normal(gallery.shape).astype(np.float32)
    query, _ = junction_features(200, 128, 16, seed=6, head=head)
    query = query + np.float32(0.3) * rng.standard_normal(query.shape).astype(np.float32)
    built = low_rank_space_used(monkeypatch, query, noisy)
    index, _ = nearest_neighbours(query, noisy, k=2, precision=precision)
    assert built[0] is not None and 0 < built[0].residual_max < 1e-4
    np.testing.assert_array_equal(index.numpy(), brute_topk(query, noisy, 2)[0])


@pytest.mark.parametrize("k", [1, 3])
def test_wide_rows_in_any_order_keep_each_answer_on_its_row(monkeypatch, k):
    """Rows too wide for the candidate stage go to full fp32 rows. The top-1 selection returns them in two runs
    (rows whose threshold is <= 0, then rows over the cap), so not sorted; when they are the whole chunk, each
    answer must still land on its own row. The candidate stage's selection (the first of the one chunk) here
    declares every row wide, in reverse order."""
    original = {name: getattr(retrieval_kernel, name) for name in ("_select_top1", "_select")}
    calls = []

    def every_row_wide_reversed(name):
        def select(scores, bound, *args, **kwargs):
            rows, cand, wide = original[name](scores, bound, *args, **kwargs)
            calls.append(name)
            if len(calls) > 1:                        # the fp32 and fp64 stages select as they do
                return rows, cand, wide
            return rows[:0], cand[:0], torch.arange(scores.shape[0] - 1, -1, -1, device=scores.device)
        return select

    for name in original:
        monkeypatch.setattr(retrieval_kernel, name, every_row_wide_reversed(name))
    query, gallery = planted(64, 300, 40, seed=12)
    expected, _ = brute_topk(query, gallery, k)
    index, _ = nearest_neighbours(query, gallery, k=k, chunk_size=64, precision="bf16")
    np.testing.assert_array_equal(index.numpy(), expected)
    assert len(calls) >= 2


def test_full_rank_gallery_keeps_the_full_half_stage(monkeypatch):
    rng = np.random.default_rng(7)
    gallery = rng.standard_normal((300, 96)).astype(np.float32)
    query = rng.standard_normal((100, 96)).astype(np.float32)
    built = low_rank_space_used(monkeypatch, query, gallery)
    index, _ = nearest_neighbours(query, gallery, k=1, precision="half", return_scores=False)
    assert built == [None]
    np.testing.assert_array_equal(index.numpy(), brute_topk(query, gallery, 1)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32])
@pytest.mark.parametrize("k", [1, 3])
def test_select_candidates_equal_a_full_threshold_comparison(dtype, k):
    # _select settles most rows from their top 16 (floats through their bits as integers); its candidates must be
    # exactly the entries at or above each row's threshold, found here by comparing every entry
    rng = np.random.default_rng(31)
    raw = rng.standard_normal((12, 300))
    raw[0] = -np.abs(raw[0])                 # all negative: the float fallback
    raw[1, [4, 9, 200]] = raw[1].max() + 1   # exact ties at the top
    raw[2, 10:40] = raw[2].max() + 1         # 30 tied entries: more candidates than the top-16 probe
    raw[3] = 0.0                             # zeros and a negative zero
    raw[3, 7] = -0.0
    raw[3, 8] = 0.25
    raw[4, :3] = [5.0, -1.0, 4.99]           # one clear winner, a near one
    scale = 1000.0 if dtype == torch.int32 else 1.0
    scores = torch.tensor(np.round(raw * scale) if dtype == torch.int32 else raw).to(dtype)
    bound = torch.tensor(np.linspace(0.0, 0.6, 12) * scale, dtype=torch.float64)
    out_unit = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}.get(dtype, 0.0)
    rows, cand, wide = retrieval_candidates._select(scores.clone(), bound, k, None, out_unit)
    assert wide.numel() == 0 and sorted(rows.tolist()) == list(range(12))
    kth = scores.double().topk(k, dim=1).values[:, k - 1]
    threshold = retrieval_candidates._round_down(kth - out_unit * kth.abs() - 2.0 * bound - 1e-12 * (1.0 + kth.abs()),
                                                 dtype)
    for position, row in enumerate(rows.tolist()):
        expected = torch.nonzero(scores[row] >= threshold[row]).squeeze(1).tolist()
        got = [c for c in cand[position].tolist() if c >= 0]
        assert got == expected, (row, got, expected)
    assert len([c for c in cand[rows.tolist().index(2)].tolist() if c >= 0]) >= 30


# ----------------------------------------------------------------------------------------------------------------
# int8 candidate stage


def test_int8_path_is_really_taken_when_forced(monkeypatch):
    calls = []
    original = torch._int_mm

    def spy(left, right, **kwargs):
        calls.append((left.dtype, right.dtype))
        return original(left, right, **kwargs)

    monkeypatch.setattr(torch, "_int_mm", spy)
    query, gallery = planted(20, 30, 8, seed=2)
    nearest_neighbours(query, gallery, precision="int8")
    assert calls and calls[0] == (torch.int8, torch.int8)
    calls.clear()
    nearest_neighbours(query, gallery, precision="half")
    assert calls == []


def test_int8_stage_bound_holds_for_every_pair():
    # the bound of _int8_stage is in units of the exact product P_j = a.b_j: s t P_j must lie within s t bound of
    # q.g_j for every pair (fp64 reference), s the query's scale and t the gallery's common scale
    rng = np.random.default_rng(12)
    gallery = rng.standard_normal((500, 64)).astype(np.float32)
    gallery[:50] *= np.float32(1e-3)                       # tiny rows: norms differ by 1000x before normalising
    gallery[50:60, 0] *= np.float32(40.0)                  # spiky rows set the common scale
    query = rng.standard_normal((80, 64)).astype(np.float32)
    space = retrieval._direct_space(torch.from_numpy(gallery), "int8")
    queries = retrieval_kernel._Queries("query", torch.from_numpy(query))
    q32 = queries.fp32(0, 80)
    dev32 = torch.full((80,), 3.0 * 2.0 ** -24 * (1 + 1e-12), dtype=torch.float64)
    products, bound, out_unit = retrieval_kernel._int8_stage(q32, dev32, space, 1.0 + 1e-12, 0.0)
    assert products.dtype == torch.int32 and out_unit == 0.0
    _, scale, deviation = quantize_rows(q32)
    unit = scale.double().numpy() * float(space.half_scale)
    q64 = query / np.linalg.norm(query.astype(np.float64), axis=1, keepdims=True)
    g64 = gallery / np.linalg.norm(gallery.astype(np.float64), axis=1, keepdims=True)
    exact = q64 @ g64.T
    stored = products.double().numpy() * unit[:, None]
    allowed = bound.numpy() * unit
    error = np.abs(stored - exact)
    assert bool((error <= allowed[:, None]).all())
    assert error.max() > 1e-4                                # int8 really is coarse: the bound is doing work
    assert allowed.max() < 0.2                               # and it stays a usable window
    # the fp32-only query deviation bound covers the exact ||s a - x|| (fp64 evaluation, t a exact there)
    codes, _, _ = quantize_rows(q32)
    true_dev = np.linalg.norm(codes.double().numpy() * scale.double().numpy()[:, None] - q32.double().numpy(),
                              axis=1)
    assert bool((true_dev <= deviation.numpy()).all()) and bool((deviation.numpy() < 1.001 * true_dev + 1e-9).all())


def adversarial_near_ties(count: int, dim: int, seed: int):
    """Gallery of many tiny perturbations of one row, so that true cosine gaps (~1e-5) are far inside the int8
    quantisation error (~1e-2), plus exact duplicates of the best row; queries next to that row."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(dim)
    gallery = base + 1e-3 * rng.standard_normal((count, dim))
    gallery[count // 2:] = rng.standard_normal((count - count // 2, dim))      # unrelated rows
    query = base + 0.05 * rng.standard_normal((40, dim))
    return query.astype(np.float32), gallery.astype(np.float32)


def test_int8_adversarial_near_ties_and_exact_ties_equal_fp64():
    query, gallery = adversarial_near_ties(400, 96, seed=21)
    expected, _ = brute_topk(query, gallery, 1)
    gallery[[0, 1]] = gallery[expected[0, 0]]                 # exact ties with query 0's answer: row 0 must win
    expected, expected_scores = brute_topk(query, gallery, 3)
    # the int8 ranking alone is wrong for some queries: exactness comes from the bound and re-scoring
    space = retrieval._direct_space(torch.from_numpy(gallery), "int8")
    q32 = retrieval_kernel._Queries("query", torch.from_numpy(query)).fp32(0, len(query))
    products, _, _ = retrieval_kernel._int8_stage(q32, torch.zeros(len(query), dtype=torch.float64), space, 1.0, 0.0)
    assert bool((products.argmax(dim=1).numpy() != expected[:, 0]).any())
    for k in (1, 3):
        index, scores64 = nearest_neighbours(query, gallery, k=k, chunk_size=16, precision="int8")
        np.testing.assert_array_equal(index.numpy(), expected[:, :k])
        np.testing.assert_allclose(scores64.numpy(), expected_scores[:, :k], rtol=0, atol=1e-12)
    assert int(expected[0, 0]) == 0
    only, _ = nearest_neighbours(query, gallery, k=1, precision="int8", return_scores=False)
    np.testing.assert_array_equal(only.numpy(), expected[:, :1])


@pytest.mark.parametrize("fastest, stage", [("int8", torch.int8), ("bf16", torch.bfloat16), ("fp32", None)])
def test_auto_precision_follows_the_calibration(monkeypatch, fastest, stage):
    patch_fastest_matmul(monkeypatch, lambda device, exclude=(): fastest)
    query, gallery = planted(30, 40, 16, seed=4)
    space = retrieval._direct_space(torch.from_numpy(gallery), "auto")
    assert space.half_dtype == stage
    index, _ = nearest_neighbours(query, gallery, k=1, precision="auto")
    np.testing.assert_array_equal(index.numpy(), brute_topk(query, gallery, 1)[0])


def test_auto_int8_demotes_to_the_next_stage_when_its_window_rescores_too_much(monkeypatch):
    # near-duplicate gallery: the int8 window holds most rows, so after the first chunk "auto" moves to the next
    # fastest stage (here fp32); the answer stays exact throughout
    patch_fastest_matmul(monkeypatch, lambda device, exclude=(): "fp32" if "int8" in exclude else "int8")
    calls = []
    original = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b, **kw: calls.append(a.shape) or original(a, b, **kw))
    query, gallery = adversarial_near_ties(400, 96, seed=22)
    expected, _ = brute_topk(query, gallery, 1)
    index, _ = nearest_neighbours(query, gallery, k=1, chunk_size=10, precision="auto", return_scores=False)
    np.testing.assert_array_equal(index.numpy(), expected)
    assert len(calls) == 1                                    # int8 ran on the first chunk only
    calls.clear()
    forced, _ = nearest_neighbours(query, gallery, k=1, chunk_size=10, precision="int8", return_scores=False)
    np.testing.assert_array_equal(forced.numpy(), expected)
    assert len(calls) == 4                                    # forced int8 never demotes


def test_candidate_scores32_equal_fp32_products_with_gaps_in_the_padding():
    # the sampled product scores exactly the listed (query, candidate) pairs; -1 entries (anywhere) stay -inf
    rng = np.random.default_rng(41)
    gallery = torch.from_numpy(rng.standard_normal((200, 33)).astype(np.float32))
    query = torch.from_numpy(rng.standard_normal((5, 33)).astype(np.float32))
    candidates = torch.tensor([[3, 17, 150, -1], [-1, -1, -1, -1], [0, -1, 199, -1], [5, 6, 7, 8],
                               [42, -1, -1, -1]])
    scores = retrieval_candidates._candidate_scores32(query, candidates, gallery)
    exact = query.double() @ gallery.double().t()
    gamma = 33 * 2.0 ** -24 / (1 - 33 * 2.0 ** -24)
    for row in range(5):
        for position, column in enumerate(candidates[row].tolist()):
            value = float(scores[row, position])
            if column < 0:
                assert value == -math.inf
            else:
                magnitude = float(query[row].double().abs() @ gallery[column].double().abs())
                assert abs(value - float(exact[row, column])) <= gamma * magnitude


def test_auto_demotion_keeps_the_low_rank_basis_and_stays_exact(monkeypatch):
    # a low-rank gallery of near-duplicates: int8's window holds most rows, "auto" moves to the next stage on the
    # same basis and coordinates (no second basis search) and the answers equal fp64, exact ties included
    patch_fastest_matmul(monkeypatch, lambda device, exclude=(): "bf16" if "int8" in exclude else "int8")
    monkeypatch.setattr(retrieval_space, "_LOW_RANK_MIN_QUERIES_PER_DIM", 0)
    monkeypatch.setattr(retrieval_kernel, "_INT8_PROBE_QUERIES", 16)
    rng = np.random.default_rng(43)
    head = rng.standard_normal((96, 24))
    base = rng.standard_normal(24)
    embed = base + 1e-3 * rng.standard_normal((300, 24))
    gallery = (embed @ head.T).astype(np.float32)
    gallery[[0, 1]] = gallery[150]                          # exact ties: the lowest index must win
    query = ((base + 0.05 * rng.standard_normal((60, 24))) @ head.T).astype(np.float32)
    searches = []
    monkeypatch.setattr(retrieval_space, "_dominant_basis",
                        lambda *args, original=retrieval_space._dominant_basis: searches.append(1) or original(*args))
    stages = []
    original_with_stage = retrieval._with_stage

    def spy(space, half_dtype):
        stages.append((space.projection, half_dtype))
        rebuilt = original_with_stage(space, half_dtype)
        stages.append((rebuilt.projection, rebuilt.half_dtype))
        return rebuilt

    monkeypatch.setattr(retrieval, "_with_stage", spy)
    expected, expected_scores = brute_topk(query, gallery, 2)
    index, scores = nearest_neighbours(query, gallery, k=2, chunk_size=16, precision="auto")
    np.testing.assert_array_equal(index.numpy(), expected)
    np.testing.assert_allclose(scores.numpy(), expected_scores, rtol=0, atol=1e-12)
    assert len(searches) == 1                                # one basis search, reused after the demotion
    assert len(stages) == 2 and stages[0][0] is not None and stages[1][0] is stages[0][0]
    assert stages[1][1] == torch.bfloat16


def test_one_thread_sections_restore_the_thread_count_when_nested_and_concurrent():
    # two searches in two Python threads overlap their one-thread sections: the process keeps its setting
    import threading

    before = torch.get_num_threads()
    query, gallery = planted(200, 300, 40, seed=13)
    expected, _ = brute_topk(query, gallery, 1)
    results = []

    def search():
        index, _ = nearest_neighbours(query, gallery, k=1, chunk_size=16, precision="int8", return_scores=False)
        results.append(index.numpy())

    workers = [threading.Thread(target=search) for _ in range(2)]
    for worker in workers:
        worker.start()
    with retrieval_kernel._one_thread():
        with retrieval_kernel._one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    for worker in workers:
        worker.join()
    assert torch.get_num_threads() == before
    assert len(results) == 2
    for index in results:
        np.testing.assert_array_equal(index, expected)


# ----------------------------------------------------------------------------------------------------------------
# int8 top-1 selection by block maxima, raw (unnormalised) query rows


@pytest.mark.parametrize("width", [10, 64, 300, 1000])
@pytest.mark.parametrize("cap", [None, 5])
def test_select_top1_equals_a_full_threshold_comparison(width, cap):
    # the int8 top-1 selection (block maxima, then the open blocks) must return exactly the entries at or above
    # each row's threshold, in ascending order, like _select with k = 1; rows over the cap come back as wide
    rng = np.random.default_rng(width)
    scores = torch.tensor(rng.integers(-20000, 20000, (40, width)), dtype=torch.int32)
    scores[0, [1, width // 2, width - 1]] = 30000           # exact ties at the top, spread over blocks
    scores[1] = 7                                            # a constant row: everything ties
    scores[2, -1] = 40000                                    # the maximum in the last (narrow) block
    scores[3, :] = -(2 ** 31) + 5                            # near the int32 floor: the threshold is clamped
    scores[4, : min(width, 70)] = 25000                      # a run of ties crossing a block boundary
    bound = torch.tensor(rng.uniform(0.0, 3000.0, 40), dtype=torch.float64)
    bound[5] = 0.0
    rows, cand, wide = retrieval_candidates._select_top1(scores, bound, cap)
    got = {r: [c for c in row if c >= 0] for r, row in zip(rows.tolist(), cand.tolist())}
    if cap is None:          # (_select applies the cap only to rows its top-16 probe leaves open)
        ref_rows, ref_cand, ref_wide = retrieval_candidates._select(scores.clone(), bound, 1, cap, 0.0)
        assert wide.numel() == 0 and ref_wide.numel() == 0
        assert got == {r: [c for c in row if c >= 0] for r, row in zip(ref_rows.tolist(), ref_cand.tolist())}
    assert sorted(list(got) + wide.tolist()) == list(range(40))
    best = scores.double().max(dim=1).values
    threshold = torch.floor(best - 2.0 * bound - 1e-12 * (1.0 + best.abs()))
    for row in range(40):
        full = torch.nonzero(scores[row].double() >= threshold[row]).squeeze(1).tolist()
        if row in got:
            assert got[row] == full
        else:
            assert cap is not None and len(full) > cap


@pytest.mark.parametrize("width", [10, 64, 300, 1000])
@pytest.mark.parametrize("min_open", [0, 8])
def test_select_top1_with_a_lower_bound_keeps_exactly_the_items_that_can_reach_it(monkeypatch, width, min_open):
    # reference scores R, stage scores S with |S - R| <= bound; lower(rows, columns) = R of the pairs handed over.
    # A row asks for L when its plain window (v - 2 bound) opens >= min_open blocks of 64 columns; its candidates
    # must then be {S >= floor(max(v - 2 bound, L - bound))}, else {S >= floor(v - 2 bound)} (brute force here);
    # the column handed over must hold its row's maximum S, and the top-1 of R must always survive
    from compat_core.retrieval import int8 as retrieval_int8
    monkeypatch.setattr(retrieval_int8, "LOWER_MIN_OPEN_BLOCKS", min_open)
    rng = np.random.default_rng(100 + width)
    reference = rng.uniform(-1000.0, 1000.0, (30, width))
    reference[0, [2, width - 1]] = 5000.0                   # an exact tie of the reference top-1
    bound = rng.uniform(0.0, 400.0, 30)
    bound[1] = 0.0
    noise = rng.uniform(-1.0, 1.0, (30, width)) * bound[:, None]
    scores = torch.tensor(np.floor(reference + noise), dtype=torch.int32)
    bound_t = torch.tensor(bound + 1.0, dtype=torch.float64)          # flooring: |S - R| <= bound + 1
    handed = {}

    def lower(rows, columns):
        rows = torch.arange(30)[rows]                            # a tensor of rows, or slice(None): all of them
        handed.update(zip(rows.tolist(), columns.tolist()))
        return torch.tensor(reference[rows.numpy(), columns.numpy()], dtype=torch.float64)

    rows, cand, wide, _ = select_top1(scores, bound_t, None, 0.0, retrieval_candidates._round_down, lower)
    assert wide.numel() == 0 and sorted(rows.tolist()) == list(range(30))
    best = scores.double().max(dim=1).values
    margin = 1e-12 * (1.0 + best.abs())
    plain = torch.floor(best - 2.0 * bound_t - margin)
    plain_count = narrowed_count = 0
    for position, row in enumerate(rows.tolist()):
        got = [c for c in cand[position].tolist() if c >= 0]
        blocks = [scores[row, b:b + 64].max() >= plain[row] for b in range(0, width, 64)]
        assert (row in handed) == (sum(blocks) >= min_open), row
        threshold = plain[row]
        if row in handed:
            assert scores[row, handed[row]] == best[row]
            low = reference[row, handed[row]]
            threshold = math.floor(max(best[row] - 2.0 * bound_t[row], low - bound_t[row]) - margin[row])
        assert got == torch.nonzero(scores[row].double() >= threshold).squeeze(1).tolist(), row
        assert int(np.argmax(reference[row])) in got, row
        narrowed_count += len(got)
        plain_count += int((scores[row].double() >= plain[row]).sum())
    assert narrowed_count <= plain_count
    if width >= max(300, 64 * min_open):                    # enough blocks for rows to ask for L
        assert handed and narrowed_count < plain_count       # the lower bound really narrows wide windows


def test_filter_moves_survivors_forward_in_index_order():
    # hand-worked: row 0 keeps 3 and 9 (score 0.5 within 2 x 0.05 of the best 0.58), row 1 keeps only 7
    candidates = torch.tensor([[1, 3, 5, 9], [2, 7, -1, -1]])
    scores = torch.tensor([[0.1, 0.5, 0.2, 0.58], [0.3, 0.9, -math.inf, -math.inf]])
    bound = torch.tensor([0.05, 0.05], dtype=torch.float64)
    kept = retrieval_candidates._filter(scores, candidates, bound, 1)
    assert kept.tolist() == [[3, 9], [7, -1]]


def _tied_rows(monkeypatch, low_rank: bool, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """120 query and 300 gallery rows (junction features of rank 24 with the low-rank path forced, or planted
    full-rank rows) where gallery row 20 is an exact copy of query 2's answer 250: row 20 must win."""
    if low_rank:
        gallery, head = junction_features(300, 96, 24, seed=seed)
        query, _ = junction_features(120, 96, 24, seed=seed + 1, head=head)
        monkeypatch.setattr(retrieval_space, "_LOW_RANK_MIN_QUERIES_PER_DIM", 0)
    else:
        query, gallery = planted(120, 300, 96, seed=seed + 2)
    gallery[20] = gallery[250]
    query[2] = gallery[250] + np.float32(1e-3) * gallery[4]
    return query, gallery


def _rows_of_any_norm(query: np.ndarray) -> np.ndarray:
    """The 120 query rows scaled to huge, tiny and ordinary norms; rows 112 and 115 lie outside the raw range (their
    chunk falls back to unit rows)."""
    scale = np.ones((120, 1), np.float32)
    scale[10:20] = 1e4
    scale[20:30] = 1e-3
    scale[30:40] = 3e3
    scale[112] = 1e12
    scale[115] = 1e-30
    return (query * scale).astype(np.float32)


def _record_raw_chunks(monkeypatch) -> list:
    """Spy on the kernel's raw query rows: the list gets True for each chunk ranked on raw rows, False for each
    chunk that fell back to unit rows."""
    raw_chunks = []
    original = retrieval_kernel._Queries.raw_rows
    monkeypatch.setattr(retrieval_kernel._Queries, "raw_rows",
                        lambda self, a, b: raw_chunks.append(original(self, a, b) is not None) or original(self, a, b))
    return raw_chunks


@pytest.mark.parametrize("low_rank", [False, True])
def test_int8_raw_query_rows_of_any_norm_equal_fp64(monkeypatch, low_rank):
    # the int8 stage ranks raw fp32 query rows (no normalisation): rows of huge, tiny and ordinary norms, and
    # rows out of the raw range (their chunk falls back to unit rows), must all give the fp64 answer, ties included
    query, gallery = _tied_rows(monkeypatch, low_rank, seed=8)
    query = _rows_of_any_norm(query)
    expected, expected_scores = brute_topk(query, gallery, 1)
    assert int(expected[2, 0]) == 20
    raw_chunks = _record_raw_chunks(monkeypatch)
    _assert_int8_top1(query, gallery, expected, expected_scores, (None, 16))
    index3, _ = nearest_neighbours(query, gallery, k=3, precision="int8")
    np.testing.assert_array_equal(index3.numpy(), brute_topk(query, gallery, 3)[0])
    assert True in raw_chunks and False in raw_chunks        # both the raw rows and the fallback were used


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("low_rank", [False, True])
def test_float_stages_rank_raw_query_rows_of_any_norm_equal_fp64(monkeypatch, precision, low_rank):
    # the bf16 and fp32 stages also rank the raw fp32 query rows r (bounds scaled by ||r||), fp16 keeps unit rows:
    # huge, tiny and ordinary norms, rows out of the raw range (their chunk falls back to unit rows), an exact tie
    # (lowest index wins) and a near-tie must all give the fp64 answer, for k = 1 (with and without scores), k = 3
    if low_rank and precision == "fp32":
        pytest.skip("the fp32 stage has no low-rank path")
    query, gallery = _tied_rows(monkeypatch, low_rank, seed=18)
    gallery[60] = gallery[61] * np.float32(1.0 + 2.0 ** -20)  # same direction to fp32 precision: a near-tie
    query[5] = gallery[61] + np.float32(1e-3) * gallery[7]
    query = _rows_of_any_norm(query)
    expected, expected_scores = brute_topk(query, gallery, 1)
    assert int(expected[2, 0]) == 20
    raw_chunks = _record_raw_chunks(monkeypatch)
    for chunk in (None, 16):
        index, scores = nearest_neighbours(query, gallery, k=1, chunk_size=chunk, precision=precision)
        np.testing.assert_array_equal(index.numpy(), expected)
        np.testing.assert_allclose(scores.numpy(), expected_scores, rtol=0, atol=1e-12)
        only, _ = nearest_neighbours(query, gallery, k=1, chunk_size=chunk, precision=precision, return_scores=False)
        np.testing.assert_array_equal(only.numpy(), expected)
    index3, _ = nearest_neighbours(query, gallery, k=3, precision=precision)
    np.testing.assert_array_equal(index3.numpy(), brute_topk(query, gallery, 3)[0])
    if precision == "fp16":
        assert True not in raw_chunks                        # fp16 (range 65504) keeps unit rows
    else:
        assert True in raw_chunks and False in raw_chunks    # both the raw rows and the fallback were used


def test_int8_raw_query_bound_holds_for_every_pair():
    # raw rows r (not unit): s t P_j must lie within s t bound of r.g_j (g_j the fp64 unit gallery rows)
    rng = np.random.default_rng(14)
    gallery = rng.standard_normal((400, 64)).astype(np.float32)
    query = (rng.standard_normal((60, 64)) * rng.uniform(1e-3, 1e3, (60, 1))).astype(np.float32)
    space = retrieval._direct_space(torch.from_numpy(gallery), "int8")
    queries = retrieval_kernel._Queries("query", torch.from_numpy(query), raw=True)
    rows = queries.raw_rows(0, 60)
    assert rows is not None
    norm = queries.norm32
    products, bound, _ = retrieval_kernel._int8_stage(rows, torch.zeros(60, dtype=torch.float64), space, norm, 0.0)
    _, scale, _ = quantize_rows(rows)
    unit = scale.double().numpy() * float(space.half_scale)
    g64 = gallery / np.linalg.norm(gallery.astype(np.float64), axis=1, keepdims=True)
    exact = query.astype(np.float64) @ g64.T
    error = np.abs(products.double().numpy() * unit[:, None] - exact)
    assert bool((error <= (bound.numpy() * unit)[:, None]).all())
    assert bool((norm.numpy() >= np.linalg.norm(query.astype(np.float64), axis=1)).all())


def test_raw_query_validation_names_the_first_bad_row():
    rng = np.random.default_rng(15)
    gallery = rng.standard_normal((50, 16)).astype(np.float32)
    query = rng.standard_normal((30, 16)).astype(np.float32)
    query[5] = 1e-30                                         # tiny but valid
    query[17] = 0.0
    query[23, 2] = np.inf
    with pytest.raises(ValueError, match="query: row 17"):
        nearest_neighbours(query, gallery, precision="int8")
    query[17] = 1.0
    with pytest.raises(ValueError, match="query: row 23"):
        nearest_neighbours(query, gallery, precision="int8")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [10, 300])
def test_select_top1_on_float_scores_equals_a_full_threshold_comparison(dtype, width):
    # float scores are compared through their bits as integers; rows whose threshold is <= 0 (negative entries,
    # -0) must still get every entry >= the threshold, as _select finds them
    rng = np.random.default_rng(40 + width)
    raw = rng.uniform(-0.2, 0.9, (16, width))
    raw[0] = -np.abs(raw[0])                                 # all negative
    raw[1] = 0.0                                             # zeros and a negative zero: threshold <= 0
    raw[1, 3] = -0.0
    raw[1, 5] = 0.004
    raw[2, [1, width - 1]] = 0.95                            # exact ties at the top
    raw[3, :4] = [0.5, 0.499, -0.3, 0.4995]                  # near ties
    raw[4] = rng.uniform(-0.01, 0.01, width)                 # threshold crosses zero
    scores = torch.tensor(raw).to(dtype)
    bound = torch.tensor(rng.uniform(0.0, 0.01, 16), dtype=torch.float64)
    out_unit = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}.get(dtype, 0.0)
    rows, cand, wide = retrieval_candidates._select_top1(scores, bound, None, out_unit)
    assert wide.numel() == 0 and sorted(rows.tolist()) == list(range(16))
    best = scores.double().max(dim=1).values
    threshold = retrieval_candidates._round_down(best - out_unit * best.abs() - 2.0 * bound - 1e-12 * (1.0 + best.abs()),
                                                 dtype)
    for position, row in enumerate(rows.tolist()):
        expected = torch.nonzero(scores[row] >= threshold[row]).squeeze(1).tolist()
        assert [c for c in cand[position].tolist() if c >= 0] == expected, row
    assert 3 in [c for c in cand[rows.tolist().index(1)].tolist() if c >= 0]      # -0 >= a threshold of 0


@pytest.mark.parametrize("low_rank", [False, True])
def test_int8_top1_in_small_product_blocks_equals_fp64(monkeypatch, low_rank):
    # int8 with k = 1 quantises a query chunk at once and runs products and selection in blocks of rows; tiny
    # blocks (16 rows, more than one per chunk) must still give the fp64 answer, exact ties to the lowest index
    from compat_core.retrieval import int8 as retrieval_int8
    monkeypatch.setattr(retrieval_int8, "INT8_BLOCK_SCORES", 16 * 300)
    if low_rank:
        gallery, head = junction_features(300, 96, 24, seed=11)
        query, _ = junction_features(100, 96, 24, seed=12, head=head)
        monkeypatch.setattr(retrieval_space, "_LOW_RANK_MIN_QUERIES_PER_DIM", 0)
    else:
        query, gallery = adversarial_near_ties(300, 96, seed=13)
        query = np.concatenate([query, planted(60, 300, 96, seed=14)[0]])
    gallery[30] = gallery[290]
    query[17] = gallery[290] + np.float32(1e-3) * gallery[2]
    expected, expected_scores = brute_topk(query, gallery, 1)
    assert int(expected[17, 0]) == 30
    _assert_int8_top1(query, gallery, expected, expected_scores, (None, 40))


def _assert_int8_top1(query, gallery, expected, expected_scores, chunks) -> None:
    """int8 top-1 indices equal ``expected`` (and scores ``expected_scores``) at every chunk size, with and without
    scores returned."""
    for chunk in chunks:
        index, scores = nearest_neighbours(query, gallery, k=1, chunk_size=chunk, precision="int8")
        np.testing.assert_array_equal(index.numpy(), expected)
        np.testing.assert_allclose(scores.numpy(), expected_scores, rtol=0, atol=1e-12)
        only, _ = nearest_neighbours(query, gallery, k=1, chunk_size=chunk, precision="int8", return_scores=False)
        np.testing.assert_array_equal(only.numpy(), expected)


def test_fp32_products_run_in_full_fp32_whatever_the_global_matmul_precision(monkeypatch):
    # a training script's torch.set_float32_matmul_precision("medium") would let fp32 products use TF32 / bf16
    # passes, outside the fp32 bounds: the kernel runs them at "highest" and restores the caller's setting
    seen = []
    original = retrieval_kernel._search_chunk
    monkeypatch.setattr(retrieval_kernel, "_search_chunk",
                        lambda *args: seen.append(torch.get_float32_matmul_precision()) or original(*args))
    query, gallery = planted(40, 60, 16, seed=31)
    expected, _ = brute_topk(query, gallery, 1)
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        index, _ = nearest_neighbours(query, gallery, precision="fp32", return_scores=False)
        assert torch.get_float32_matmul_precision() == "medium"
        # kernels in several threads at once: each runs at "highest", the caller's setting comes back at the end
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: nearest_neighbours(query, gallery, precision="fp32",
                                                                 return_scores=False)[0], range(6)))
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(saved)
    for answer in [index] + answers:
        np.testing.assert_array_equal(answer.numpy(), expected)
    assert len(seen) >= 7 and set(seen) == {"highest"}


@pytest.mark.parametrize("slower", [True, False])
def test_auto_leaves_a_stage_that_the_live_check_finds_slower_than_fp32(monkeypatch, slower):
    # early chunks of an "auto" search alternate between the candidate stage and the fp32 stage, each timed; a
    # stage found slower hands the rest to the fp32 stage, and the answer stays exact either way. The readings are
    # replaced by fixed ones (seconds per row) so that the decision is the test's, not the machine's
    patch_fastest_matmul(monkeypatch, lambda device, exclude=(): "bf16")
    readings = []

    class FixedReadings(retrieval_live.LiveCheck):
        def record(self, stage, seconds_per_row):
            readings.append(stage)
            super().record(stage, 2.0 if slower and stage == retrieval_live.CANDIDATE else 1.0)

    monkeypatch.setattr(retrieval_kernel, "LiveCheck", FixedReadings)
    stages = []
    original = retrieval._with_stage
    monkeypatch.setattr(retrieval, "_with_stage", lambda space, dtype: stages.append(dtype) or original(space, dtype))
    query, gallery = planted(8 * 512 + 100, 300, 24, seed=31)
    chunks = []
    search_chunk = retrieval_kernel._search_chunk
    monkeypatch.setattr(retrieval_kernel, "_search_chunk",
                        lambda space, *args: chunks.append(space.half_dtype) or search_chunk(space, *args))
    with one_thread():          # chunks in order: one warm chunk, then candidate / fp32 / candidate / fp32
        index, scores = nearest_neighbours(query, gallery, k=2, precision="auto")
    expected, expected_scores = brute_topk(query, gallery, 2)
    np.testing.assert_array_equal(index.numpy(), expected)
    np.testing.assert_allclose(scores.numpy(), expected_scores, rtol=0, atol=1e-12)
    assert stages == [None]                     # the fp32 stage, built once for the check
    if slower:
        # two readings of each side must say "slower"; every chunk after them runs on the fp32 stage
        assert readings == ["candidate", "fp32", "candidate", "fp32"]
        assert chunks[:5] == [torch.bfloat16, torch.bfloat16, None, torch.bfloat16, None]
        assert set(chunks[5:]) == {None}
    else:
        # the first pair keeps the stage: the rest, the second pair's planned fp32 chunk included, runs on it
        assert readings == ["candidate", "fp32"]
        assert chunks[:3] == [torch.bfloat16, torch.bfloat16, None]
        assert set(chunks[3:]) == {torch.bfloat16}


def test_pair_scores64_tie_identical_rows_bit_for_bit_across_blocks(monkeypatch):
    # the fp64 finish scores only valid (query, candidate) pairs, in blocks: identical gallery rows must get the
    # identical score wherever their pairs fall, and every score is the fp64 reference sum_i q_i (g_ji / ||g_j||)
    monkeypatch.setattr(retrieval_candidates, "_GATHER_BUDGET", 7 * 33)      # blocks of 7 pairs
    generator = np.random.default_rng(41)
    gallery = torch.from_numpy(generator.standard_normal((20, 33)).astype(np.float32))
    gallery[13] = gallery[2]
    gallery[19] = gallery[2]
    query = torch.from_numpy(generator.standard_normal((6, 33)))
    query64 = query / torch.linalg.vector_norm(query, dim=1, keepdim=True)
    space = retrieval._direct_space(gallery, "fp32")
    pair_row = torch.tensor([0, 0, 0, 1, 2, 3, 3, 3, 4, 5, 5, 5, 5, 5, 5, 1, 2])
    pair_column = torch.tensor([2, 13, 19, 5, 7, 19, 2, 13, 0, 13, 1, 2, 3, 4, 19, 2, 19])
    scores = retrieval_candidates._pair_scores64(query64, space.exact_rows, pair_row, pair_column)
    unit = gallery.double() / torch.linalg.vector_norm(gallery.double(), dim=1, keepdim=True)
    reference = (query64[pair_row] * unit[pair_column]).sum(dim=1)
    np.testing.assert_allclose(scores.numpy(), reference.numpy(), rtol=0, atol=1e-14)
    for row in range(6):
        tied = scores[(pair_row == row) & torch.isin(pair_column, torch.tensor([2, 13, 19]))]
        assert tied.numel() == 0 or bool((tied == tied[0]).all())


@pytest.mark.parametrize("k", [1, 3])
def test_low_rank_fp32_stage_equals_fp64_with_ties_and_queries_outside_the_span(k):
    # the live check's fp32 side on a low-rank gallery: an fp32 candidate pass in the r-dim coordinates, the
    # residual in the bound; exact ties go to the lowest index, near-ties and queries off the span stay exact
    gallery, head = junction_features(400, 96, 20, seed=51)
    in_span, _ = junction_features(150, 96, 20, seed=52, head=head)
    outside = np.random.default_rng(53).standard_normal((150, 96)).astype(np.float32)
    query = np.concatenate([in_span, outside])
    gallery[9] = gallery[300]
    query[0] = gallery[300] + np.float32(0.01) * gallery[4]
    query[:120] = _rows_of_any_norm(query[:120])       # raw rows of huge and tiny norms, two outside the raw range
    with torch.inference_mode():
        space = retrieval._direct_space(torch.from_numpy(gallery), "half", 10 ** 6)
        assert space.projection is not None and space.projection.basis.shape == (96, 20)
        assert retrieval_kernel._low_rank_fp32_pays(space)
        low_rank = retrieval._with_stage(space, retrieval_space._half_dtype_for(retrieval_space.LOW_RANK_FP32, "cpu"))
        assert low_rank.half_dtype == torch.float32 and tuple(low_rank.half_t.shape) == (20, 400)
        queries = retrieval_kernel._Queries("query", torch.from_numpy(query), raw=True)
        result = retrieval_kernel._search(low_rank, queries, k, "half", 64, True)
    expected, expected_scores = brute_topk(query, gallery, k)
    np.testing.assert_array_equal(result.index.numpy(), expected)
    np.testing.assert_allclose(result.score.numpy(), expected_scores, rtol=0, atol=1e-12)
    assert int(result.index[0, 0]) == 9


def test_live_check_times_the_low_rank_fp32_stage_on_a_low_rank_gallery(monkeypatch):
    patch_fastest_matmul(monkeypatch, lambda device, exclude=(): "bf16")

    class CandidateSlower(retrieval_live.LiveCheck):
        def record(self, stage, seconds_per_row):
            super().record(stage, 2.0 if stage == retrieval_live.CANDIDATE else 1.0)

    monkeypatch.setattr(retrieval_kernel, "LiveCheck", CandidateSlower)
    stages = []
    original = retrieval._with_stage
    monkeypatch.setattr(retrieval, "_with_stage", lambda space, dtype: stages.append(dtype) or original(space, dtype))
    gallery, head = junction_features(300, 96, 20, seed=54)
    query, _ = junction_features(8 * 512 + 50, 96, 20, seed=55, head=head)
    chunks = []
    search_chunk = retrieval_kernel._search_chunk
    monkeypatch.setattr(retrieval_kernel, "_search_chunk",
                        lambda space, *args: chunks.append(space.half_dtype) or search_chunk(space, *args))
    with one_thread():
        index, _ = nearest_neighbours(query, gallery, k=1, precision="auto", return_scores=False)
    np.testing.assert_array_equal(index.numpy(), brute_topk(query, gallery, 1)[0])
    assert stages == [torch.float32]
    assert chunks[:3] == [torch.bfloat16, torch.bfloat16, torch.float32] and set(chunks[5:]) == {torch.float32}


def test_auto_without_a_faster_half_product_runs_fp32_in_low_rank_coordinates(monkeypatch):
    # a machine where fp32 is the fastest product: "auto" still moves a gallery of rank <= D/2 to an fp32 pass in
    # its r-dim coordinates, and the live check times it against the full fp32 product; a full-rank gallery keeps
    # the plain fp32 stage (no candidate pass, no check)
    patch_fastest_matmul(monkeypatch, lambda device, exclude=(): "fp32")
    stages = []
    original = retrieval._with_stage
    monkeypatch.setattr(retrieval, "_with_stage", lambda space, dtype: stages.append(dtype) or original(space, dtype))
    built = low_rank_space_used(monkeypatch, None, None)
    gallery, head = junction_features(300, 96, 20, seed=56)
    query, _ = junction_features(8 * 512 + 50, 96, 20, seed=57, head=head)
    gallery[17] = gallery[250]
    index, _ = nearest_neighbours(query, gallery, k=1, precision="auto", return_scores=False)
    np.testing.assert_array_equal(index.numpy(), brute_topk(query, gallery, 1)[0])
    assert built[0] is not None and built[0].basis.shape == (96, 20)
    assert stages == [None]                      # the check's other side: the full fp32 product
    rng = np.random.default_rng(58)
    full_rank = rng.standard_normal((300, 96)).astype(np.float32)
    index, _ = nearest_neighbours(query, full_rank, k=1, precision="auto", return_scores=False)
    np.testing.assert_array_equal(index.numpy(), brute_topk(query, full_rank, 1)[0])
    assert built[1] is None and stages == [None]
