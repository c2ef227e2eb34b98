"""A backfill into a mixed gallery with approximate structures: the old model's structure serves the rows not yet
re-embedded (the others masked in it), a structure built for the new model serves the re-embedded rows, and the
merged answers are checked against an fp64 brute force over the mixed gallery; the probe Recall@1 curve at 0, 25,
50, 75 and 100 % re-embedded against M(new, old), M(old, old) and M(new, new) computed by fp64 brute force."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compat_core.retrieval.ann import build_ann, tune_ann
from compat_core.retrieval.mixed_gallery import build_groups, search_groups, unit_rows
from compat_core.retrieval.search import PreparedGallery

CLASSES, PER_CLASS, DIM = 16, 20, 12


def _models(seed: int):
    """Features of one gallery, one probe and one held-out query set by an "old" and a "new" model sharing one
    space (the new one's features sit closer to their class centre, as a better compatible model's do)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(CLASSES, DIM))

    def items(count_per_class):
        labels = np.repeat(np.arange(CLASSES), count_per_class)
        latent = rng.normal(size=(labels.size, DIM))
        old = centres[labels] + 0.9 * latent + 0.8 * rng.normal(size=latent.shape)
        new = centres[labels] + 0.7 * latent + 0.4 * rng.normal(size=latent.shape)
        return labels, old.astype(np.float32), new.astype(np.float32)

    return items(PER_CLASS), items(8), items(6)


def _recall_at_1(query: np.ndarray, query_labels, gallery: np.ndarray, gallery_labels) -> tuple[float, np.ndarray]:
    """fp64 brute force: Recall@1 and the top-1 rows (ties by the lowest row)."""
    q = query.astype(np.float64) / np.linalg.norm(query.astype(np.float64), axis=1, keepdims=True)
    g = gallery.astype(np.float64) / np.linalg.norm(gallery.astype(np.float64), axis=1, keepdims=True)
    top = np.array([np.lexsort((np.arange(g.shape[0]), -row))[0] for row in q @ g.T])
    return float(np.mean(gallery_labels[top] == query_labels)), top


@pytest.mark.parametrize("kind", ["ivf", "hnsw", "ivfpq"])
def test_probe_curve_of_a_backfill_into_a_mixed_gallery(kind):
    (labels, g_old, g_new), (probe_labels, q_old, q_new), (_, held_old, held_new) = _models(3)
    m_new_old, _ = _recall_at_1(q_new, probe_labels, g_old, labels)
    m_old_old, _ = _recall_at_1(q_old, probe_labels, g_old, labels)
    m_new_new, _ = _recall_at_1(q_new, probe_labels, g_new, labels)
    floor = min(m_new_old, m_old_old)
    assert m_new_new > floor   # the upgrade is worth a backfill on these features

    old_structure = build_ann(unit_rows(g_old), kind, seed=0)
    tune_ann(old_structure, PreparedGallery(unit_rows(g_old)), held_old, 0.99)
    order = np.random.default_rng(0).permutation(labels.size)
    curve = []
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        moved = np.sort(order[:int(round(fraction * labels.size))])
        versions = np.array(["1"] * labels.size)
        versions[moved] = "2"
        mixed = g_old.copy()
        mixed[moved] = g_new[moved]
        structures = {"1": old_structure} if fraction < 1.0 else {}   # retired once empty
        if moved.size:   # built for the new model over the re-embedded rows, tuned by the same rule
            new_structure = build_ann(unit_rows(g_new[moved]), kind, seed=0)
            tune_ann(new_structure, PreparedGallery(unit_rows(g_new[moved])), held_new, 0.99)
            structures["2"] = new_structure
        groups = build_groups(mixed, versions, structures=structures)
        assert all(group.ann is not None for group in groups)   # every group searched through its structure
        assert sorted(np.concatenate([g.positions for g in groups]).tolist()) == list(range(labels.size))
        for group in groups:   # the old structure returns only its own version's rows (masked, not removed)
            if group.ann_subset is not None:
                assert group.version == "1" and group.ann_subset.rows.tolist() == group.positions.tolist()
        positions, _, group_of = search_groups(torch.from_numpy(q_new), groups, 1)
        brute, top = _recall_at_1(q_new, probe_labels, mixed, labels)   # each row in its own model's space
        assert positions[:, 0].tolist() == top.tolist()
        assert [groups[g].version for g in group_of[:, 0]] == versions[top].tolist()
        curve.append(float(np.mean(labels[positions[:, 0]] == probe_labels)))
        assert curve[-1] == brute
    print(f"{kind}: M(new,old) {m_new_old:.4f} M(old,old) {m_old_old:.4f} M(new,new) {m_new_new:.4f} curve {curve}")
    assert curve[0] == m_new_old and curve[-1] == m_new_new
    assert min(curve) >= floor


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
@pytest.mark.parametrize("kept", [5, 150])
def test_a_masked_structure_re_ranks_from_its_own_rows(kind, kept):
    """The re-rank from the structure's stored rows (no prepared gallery) over a subset: the fp64 brute force over
    exactly the subset's stored rows, indices counted in the subset; a subset of 5 rows with k = 5 leaves the
    structure short of candidates for some queries, which the exhaustive pass over the subset completes."""
    from compat_core.retrieval.ann import ann_search, ann_subset

    (_, g_old, _), (_, _, q_new), _ = _models(5)
    structure = build_ann(unit_rows(g_old), kind, seed=0)
    rows = np.sort(np.random.default_rng(1).choice(g_old.shape[0], kept, replace=False))
    if kept > 5:   # the largest effort, so that the candidates hold the top-k (as a tuned effort does for top-1)
        structure.set_effort({"efSearch": 512} if kind == "hnsw" else {"nprobe": int(structure.params["nlist"])})
    else:          # the smallest: the structure finds fewer than 5 of the subset's rows for some queries
        found = structure.candidates(q_new, 5, ann_subset(structure, rows))
        assert ((found >= 0).sum(axis=1) < 5).any()
    index, score = ann_search(torch.from_numpy(q_new), None, structure, 5, ann_subset(structure, rows))
    stored = structure.stored_rows(0, structure.size)[rows].astype(np.float64)
    stored /= np.linalg.norm(stored, axis=1, keepdims=True)
    q = q_new.astype(np.float64) / np.linalg.norm(q_new.astype(np.float64), axis=1, keepdims=True)
    for row, scores in enumerate(q @ stored.T):
        order = np.lexsort((np.arange(kept), -scores))[:5]
        assert index[row].tolist() == order.tolist()
        np.testing.assert_allclose(score[row].numpy(), scores[order], rtol=0, atol=1e-12)
