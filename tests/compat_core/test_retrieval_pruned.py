"""compat_core.retrieval.pruned: the pruned exact top-1 against an fp64 brute force, including planted exact ties
and near-ties placed across group boundaries, and its bounds against fp64 scores."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compat_core.retrieval import groups as retrieval_groups
from compat_core.retrieval import pruned as retrieval_pruned
from compat_core.retrieval import search as retrieval


def brute_top1(query: np.ndarray, gallery: np.ndarray):
    """fp64 cosine top-1, lowest index among ties (einsum without BLAS: identical rows score bit for bit alike)."""
    q = query.astype(np.float64)
    g = gallery.astype(np.float64)
    q = q / np.linalg.norm(q, axis=1, keepdims=True)
    g = g / np.linalg.norm(g, axis=1, keepdims=True)
    scores = np.einsum("qd,gd->qg", q, g, optimize=False)
    return np.argmax(scores, axis=1), scores


def simplex_like(count: int, dim: int, classes: int, cosine: float, seed: int, centres=None):
    """Rows at cosine ``cosine`` to their class centre (random unit centres), random directions off it."""
    rng = np.random.default_rng(seed)
    if centres is None:
        centres = rng.standard_normal((classes, dim))
        centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    labels = rng.integers(0, classes, count)
    noise = rng.standard_normal((count, dim))
    noise -= np.sum(noise * centres[labels], axis=1, keepdims=True) * centres[labels]
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    rows = cosine * centres[labels] + np.sqrt(1.0 - cosine ** 2) * noise
    return rows.astype(np.float32), labels, centres


kernel_search = retrieval._group_search(None)       # the exact kernel as the product's pruned search calls it


def run(query, gallery, labels, prune="always"):
    index, _, report = retrieval_pruned.search_top1(torch.from_numpy(query), torch.from_numpy(gallery),
                                                    kernel_search, labels=labels, prune=prune)
    return index, report


@pytest.mark.parametrize("cosine", [0.95, 0.85, 0.75])
def test_pruned_top1_equals_fp64_on_class_groups_and_prunes(cosine):
    query, _, centres = simplex_like(300, 64, 8, cosine, seed=1)
    gallery, labels, _ = simplex_like(800, 64, 8, cosine, seed=2, centres=centres)
    index, report = run(query, gallery, labels)
    expected, _ = brute_top1(query, gallery)
    np.testing.assert_array_equal(index.numpy(), expected)
    assert report.pruned and report.groups == 8
    if cosine >= 0.85:                                       # tight classes: most groups are skipped
        assert report.groups_per_query < 2.0
        assert report.items_per_query < 0.3 * len(gallery)


@pytest.mark.parametrize("half", [None, torch.bfloat16])
def test_planted_ties_and_near_ties_across_group_boundaries_equal_fp64(monkeypatch, half):
    """The winner sits in a group the query is far from, next to its own class's best item: exact duplicates in
    other groups (lower and higher index) and one-ulp / 1e-9 perturbations of the best row placed in other
    groups, so that the answer is decided across group boundaries by the fp64 order and the lowest index. The
    bounds' product in fp32 and in bf16 (what "auto" takes where bf16 products measured faster)."""
    monkeypatch.setattr(retrieval_groups, "_grouping_dtype", lambda device: half or torch.float32)
    query, _, centres = simplex_like(60, 48, 6, 0.9, seed=3)
    gallery, labels, _ = simplex_like(600, 48, 6, 0.9, seed=4, centres=centres)
    expected, _ = brute_topk_rows(query, gallery)
    rng = np.random.default_rng(5)
    planted_rows, duplicates = [], []
    host = 0                   # every plant goes into class 0's group: one wide group, the others stay tight
    chosen = [q for q in range(60) if labels[expected[q]] != host][:20]
    for q in chosen:
        best = expected[q]
        # rows of the host group not planted yet, and not any query's answer
        others = np.setdiff1d(np.nonzero(labels == host)[0], planted_rows + expected.tolist())
        low, high = int(others.min()), int(others.max())
        if q % 2 == 0:
            # exact duplicates of the answer in other groups, one with a lower index: it must win
            gallery[low] = gallery[best]
            gallery[high] = gallery[best]
            planted_rows += [low, high]
            duplicates.append((q, int(best), low))
        else:
            # near-ties in another group: the best row moved by one ulp in its largest component, and by ~1e-9
            # along the query (either direction: fp64 decides)
            pick = rng.choice(others, 2, replace=False)
            c = int(np.argmax(np.abs(gallery[best])))
            gallery[pick[0]] = gallery[best]
            gallery[pick[0], c] = np.nextafter(gallery[best, c], np.float32(np.inf) * np.sign(gallery[best, c]),
                                               dtype=np.float32)
            direction = 1.0 if q % 4 == 1 else -1.0
            gallery[pick[1]] = (gallery[best].astype(np.float64)
                                + direction * 3e-7 * query[q] / np.linalg.norm(query[q])).astype(np.float32)
            planted_rows += pick.tolist()
    expected, scores = brute_top1(query, gallery)
    # the plants really reach across groups and really are near-ties
    crossing = [q for q in chosen if expected[q] in planted_rows]
    assert len(crossing) >= 10
    gaps = np.sort(scores, axis=1)[:, -1] - np.sort(scores, axis=1)[:, -2]
    assert (gaps[chosen] < 1e-6).all()
    index, report = run(query, gallery, labels)
    np.testing.assert_array_equal(index.numpy(), expected)
    assert report.pruned and report.groups_per_query < 3.0               # the other groups were still skipped
    # planted exact duplicates in other groups: the lowest index wins, across groups where it is lower
    for q, best, low in duplicates:
        assert expected[q] == min(best, low)
    assert any(low < best for _, best, low in duplicates)


def brute_topk_rows(query, gallery):
    index, scores = brute_top1(query, gallery)
    return index, scores


def test_kmeans_groups_without_labels_equal_fp64():
    query, _, centres = simplex_like(200, 40, 12, 0.9, seed=6)
    gallery, _, _ = simplex_like(1500, 40, 12, 0.9, seed=7, centres=centres)
    gallery[10] = gallery[900]                                 # an exact tie: index 10 must win
    query[0] = gallery[900] + 1e-3
    index, report = run(query, gallery, None)
    expected, _ = brute_top1(query, gallery)
    np.testing.assert_array_equal(index.numpy(), expected)
    assert expected[0] == 10
    assert report.pruned and report.groups > 2 and report.groups_per_query < report.groups


@pytest.mark.parametrize("half", [None, torch.bfloat16, torch.float16])
def test_bounds_hold_against_fp64_scores(monkeypatch, half):
    """Every skipped group holds no member whose fp64 score reaches the query's lower bound, the lower bound is at
    most the best fp64 score, and the centre scores stay within their error term; with the bounds' product in
    fp32 and in the half formats (their rounding is in the error terms)."""
    monkeypatch.setattr(retrieval_groups, "_grouping_dtype", lambda device: half or torch.float32)
    query, _, centres = simplex_like(200, 32, 5, 0.8, seed=8)
    gallery, labels, _ = simplex_like(500, 32, 5, 0.8, seed=9, centres=centres)
    groups = retrieval_pruned.group_gallery(torch.from_numpy(gallery), labels)
    assert groups.half == half
    t, e_t, lower = retrieval_pruned.bounds(retrieval_pruned._unit32(torch.from_numpy(query)), groups)
    need = retrieval_pruned.needed(t, e_t, lower, groups).numpy()
    _, scores = brute_top1(query, gallery)
    q64 = query / np.linalg.norm(query, axis=1, keepdims=True)
    m64 = groups.centres.double().numpy()
    m64 /= np.linalg.norm(m64, axis=1, keepdims=True)
    assert (np.abs(t.double().numpy() - q64 @ m64.T) <= e_t).all()
    for group in range(groups.count):
        members = groups.members(group).numpy()
        assert (np.all(np.diff(members) > 0))                  # ascending gallery order inside a group
        group_best = scores[:, members].max(axis=1)
        assert (group_best[~need[:, group]] < lower.numpy()[~need[:, group]]).all()
    assert (lower.numpy() <= scores.max(axis=1)).all()
    assert (scores.max(axis=1) - lower.numpy() < 0.5).all()    # and it is a useful bound, not -1
    assert need.sum(axis=1).mean() < 0.6 * groups.count       # and groups are skipped


def test_auto_declines_pruning_on_unclustered_rows_and_stays_exact():
    rng = np.random.default_rng(10)
    query = rng.standard_normal((5000, 32)).astype(np.float32)
    gallery = rng.standard_normal((4000, 32)).astype(np.float32)
    labels = rng.integers(0, 10, 4000)
    index, report = run(query, gallery, labels, prune="auto")
    assert not report.pruned and report.estimated_share > 0.9
    np.testing.assert_array_equal(index.numpy(), brute_top1(query, gallery)[0])


def test_recall_at_1_prunes_on_clustered_classes_and_equals_fp64(monkeypatch):
    query, q_labels, centres = simplex_like(4200, 32, 10, 0.95, seed=11)
    gallery, g_labels, _ = simplex_like(4100, 32, 10, 0.95, seed=12, centres=centres)
    reports = []
    original = retrieval_pruned.search_top1

    def spy(*args, **kwargs):
        index, score, report = original(*args, **kwargs)
        reports.append(report)
        return index, score, report
    monkeypatch.setattr(retrieval_pruned, "search_top1", spy)
    value = retrieval.recall_at_1(query, q_labels, gallery, g_labels)
    expected, _ = brute_top1(query, gallery)
    assert value == pytest.approx(float(np.mean(g_labels[expected] == q_labels)), abs=0)
    assert len(reports) == 1 and reports[0].pruned and reports[0].groups_per_query < 1.5


def test_bad_rows_and_modes_are_refused():
    gallery = np.ones((4, 3), dtype=np.float32)
    query = np.ones((2, 3), dtype=np.float32)
    query[1] = 0.0
    with pytest.raises(ValueError, match="query: row 1"):
        run(query, gallery, np.array([0, 0, 1, 1]))
    bad = gallery.copy()
    bad[2] = np.nan
    with pytest.raises(ValueError, match="gallery: row 2"):
        run(np.ones((2, 3), dtype=np.float32), bad, np.array([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="prune"):
        run(query, gallery, None, prune="sometimes")


@pytest.mark.parametrize("gain, pruned", [(0.0, True), (1e9, False)])
def test_cost_model_decides_and_both_ways_are_exact(monkeypatch, gain, pruned):
    query, _, centres = simplex_like(900, 24, 6, 0.95, seed=13)
    gallery, labels, _ = simplex_like(300, 24, 6, 0.95, seed=14, centres=centres)
    monkeypatch.setattr(retrieval_pruned, "_MIN_PAIRS", 0)
    monkeypatch.setattr(retrieval_pruned, "_PRUNE_GAIN", gain)
    index, report = run(query, gallery, labels, prune="auto")
    np.testing.assert_array_equal(index.numpy(), brute_top1(query, gallery)[0])
    assert report.pruned is pruned


def test_exact_counts_overrule_an_optimistic_estimate(monkeypatch):
    """The estimate says pruning pays, the bounds of every query say otherwise: the whole gallery is searched."""
    rng = np.random.default_rng(15)
    query = rng.standard_normal((600, 32)).astype(np.float32)
    gallery = rng.standard_normal((2000, 32)).astype(np.float32)
    monkeypatch.setattr(retrieval_pruned, "_MIN_PAIRS", 0)
    monkeypatch.setattr(retrieval_pruned, "estimate", lambda *args: retrieval_pruned.Estimate(0.01, 1.0, 62))
    index, report = run(query, gallery, None, prune="auto")
    np.testing.assert_array_equal(index.numpy(), brute_top1(query, gallery)[0])
    assert not report.pruned and report.estimated_share == 0.01


def mirrored_ties(seed: int, half: int = 24, pairs: int = 30):
    """k-means clusters with planted exact ties and near-ties between rows of different clusters.

    Rows are [u, v] (two halves of ``half`` coordinates): u a random part, v = 0.9 c_k + noise for a cluster
    centre c_k of random signs (+-1 / sqrt(half)), so the clusters differ only in the signs of their second
    halves. Each pair takes a member s of one cluster and plants t = [u_s, D v_s] with D the sign flips taking
    c_k to another cluster's centre: t is a member of that other cluster, with the same norm as s, bit for bit.
    A query [u_s + a little noise, 0] then scores s and t with the same fp64 sum, term by term (the second-half
    products are +-0): an exact tie that the lowest index must win. Every third t is moved by one ulp in its
    largest first-half component, every third by 3e-7 along the query (either direction): near-ties that fp64
    decides. The planted queries are the last ``pairs`` rows (the estimate's probe spans all rows)."""
    rng = np.random.default_rng(seed)
    clusters = 12
    signs = rng.choice([-1.0, 1.0], (clusters, half))

    def rows(count):
        labels = rng.integers(0, clusters, count)
        u = 0.4 * rng.standard_normal((count, half)) / np.sqrt(half)
        v = (0.9 * signs[labels] + 0.25 * rng.standard_normal((count, half))) / np.sqrt(half)
        return np.hstack([u, v]).astype(np.float32), labels

    query, _ = rows(700)
    gallery, labels = rows(3000)
    chosen = rng.choice(len(gallery), 2 * pairs, replace=False)
    planted = []
    for j, (s, t) in enumerate(zip(chosen[:pairs], chosen[pairs:])):
        q = len(query) - pairs + j
        other = (labels[s] + 1 + j % (clusters - 1)) % clusters
        gallery[t, :half] = gallery[s, :half]
        gallery[t, half:] = gallery[s, half:] * (signs[labels[s]] * signs[other]).astype(np.float32)
        query[q] = 0.0
        query[q, :half] = gallery[s, :half] + 1e-3 * rng.standard_normal(half).astype(np.float32)
        if j % 3 == 1:
            c = int(np.argmax(np.abs(gallery[t, :half])))
            gallery[t, c] = np.nextafter(gallery[t, c], np.float32(np.inf) * np.sign(gallery[t, c]),
                                         dtype=np.float32)
        elif j % 3 == 2:
            direction = 1.0 if j % 2 else -1.0
            gallery[t] = (gallery[t].astype(np.float64)
                          + direction * 3e-7 * query[q] / np.linalg.norm(query[q])).astype(np.float32)
        planted.append((q, int(s), int(t), j % 3 == 0))
    return query, gallery, planted


def spy_reports(monkeypatch):
    reports = []
    original = retrieval_pruned.search_top1

    def spy(*args, **kwargs):
        index, score, report = original(*args, **kwargs)
        reports.append(report)
        return index, score, report
    monkeypatch.setattr(retrieval_pruned, "search_top1", spy)
    return reports


def spy_estimates(monkeypatch):
    """(per_group, Estimate) of every ``estimate`` call "auto" makes."""
    calls = []
    original = retrieval_pruned.estimate

    def spy(query, gallery, labels=None, per_group=retrieval_pruned._ESTIMATE_SAMPLE_PER_GROUP, *args):
        found = original(query, gallery, labels, per_group, *args)
        calls.append((per_group, found))
        return found
    monkeypatch.setattr(retrieval_pruned, "estimate", spy)
    return calls


@pytest.mark.parametrize("return_scores", [False, True])
def test_nearest_neighbours_auto_prunes_kmeans_groups_and_equals_fp64_on_cross_group_ties(monkeypatch,
                                                                                          return_scores):
    """The product's exact top-1 (``nearest_neighbours``, k = 1, "auto") with k-means groups: planted exact
    ties and near-ties between rows of different groups, fp64 brute force as the reference."""
    query, gallery, planted = mirrored_ties(seed=21)
    groups = retrieval_pruned.group_gallery(torch.from_numpy(gallery))
    group_of = np.empty(len(gallery), dtype=np.int64)
    for group in range(groups.count):
        group_of[groups.members(group).numpy()] = group
    expected, scores = brute_top1(query, gallery)
    # the plants decide their queries, across group boundaries, as exact ties or near-ties
    crossing = [(q, s, t, tie) for q, s, t, tie in planted if group_of[s] != group_of[t] and expected[q] in (s, t)]
    assert len(crossing) >= 20
    for q, s, t, tie in crossing:
        ordered = np.sort(scores[q])
        if tie:
            assert scores[q, s] == scores[q, t] and expected[q] == min(s, t)
        else:
            assert ordered[-1] - ordered[-2] < 1e-6
    assert any(tie and t < s for _, s, t, tie in crossing) and any(tie and s < t for _, s, t, tie in crossing)
    monkeypatch.setattr(retrieval_pruned, "_MIN_PAIRS", 0)
    reports = spy_reports(monkeypatch)
    estimates = spy_estimates(monkeypatch)
    index, found = retrieval.nearest_neighbours(query, gallery, 1, return_scores=return_scores)
    np.testing.assert_array_equal(index[:, 0].numpy(), expected)
    assert len(reports) == 1 and reports[0].pruned and reports[0].groups == groups.count
    # the cheap estimate let the full one decide, and the full one's share is the report's
    assert [per_group for per_group, _ in estimates] == [retrieval_pruned._EARLY_SAMPLE_PER_GROUP,
                                                         retrieval_pruned._ESTIMATE_SAMPLE_PER_GROUP]
    assert reports[0].estimated_share == estimates[1][1].share
    assert reports[0].groups_per_query < 0.25 * groups.count and reports[0].items_per_query < 0.25 * len(gallery)
    if return_scores:
        np.testing.assert_allclose(found[:, 0].numpy(), scores.max(axis=1), rtol=0, atol=1e-12)
    else:
        assert found is None


@pytest.mark.parametrize("clustered", [False, True])
def test_nearest_neighbours_auto_runs_the_whole_gallery_where_pruning_does_not_pay(monkeypatch, clustered):
    """Full-rank random rows: the estimate declines; clustered rows where the cost model sees no gain: the search
    runs as one whole-gallery kernel call. Exact either way."""
    if clustered:
        query, gallery, _ = mirrored_ties(seed=31)
        monkeypatch.setattr(retrieval_pruned, "_PRUNE_GAIN", 1e9)       # the cost model never lets pruning win
    else:
        rng = np.random.default_rng(32)
        query = rng.standard_normal((700, 48)).astype(np.float32)
        gallery = rng.standard_normal((3000, 48)).astype(np.float32)
    monkeypatch.setattr(retrieval_pruned, "_MIN_PAIRS", 0)
    reports = spy_reports(monkeypatch)
    estimates = spy_estimates(monkeypatch)
    index, _ = retrieval.nearest_neighbours(query, gallery, 1, return_scores=False)
    np.testing.assert_array_equal(index[:, 0].numpy(), brute_top1(query, gallery)[0])
    assert len(reports) == 1 and not reports[0].pruned
    # the cheap first estimate declined on its own: the full one never ran
    assert [per_group for per_group, _ in estimates] == [retrieval_pruned._EARLY_SAMPLE_PER_GROUP]
    assert reports[0].estimated_share == estimates[0][1].share
    if not clustered:
        # most of the gallery left to search: far from the cost model's threshold even at a third of it
        assert reports[0].estimated_share > 0.5
        assert not retrieval_pruned.worth_pruning(reports[0].estimated_share / retrieval_pruned._EARLY_FACTOR,
                                                  reports[0].groups, len(gallery), torch.device("cpu"))
