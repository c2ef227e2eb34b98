"""The exact re-rank that reads the structure's own stored rows (no prepared gallery held) against an fp64 brute
force over an fp16 unit gallery, ties by the lowest row; its memory against the raw fp16 rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compat_core.retrieval.ann import AnnIndex, ann_search, build_ann, candidate_count, tune_ann
from compat_core.retrieval.rerank import survivors
from compat_core.retrieval.search import PreparedGallery, search_prepared

DUPLICATES = (700, 1500, 3999)      # copies of row 5


def _fp16_gallery(count: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(40, dim, generator=gen), dim=1)
    labels = torch.randint(0, 40, (count,), generator=gen)
    rows = centres[labels] + 0.6 * torch.randn(count, dim, generator=gen) / dim ** 0.5
    gallery = torch.nn.functional.normalize(rows, dim=1).half()
    for row in DUPLICATES:
        gallery[row] = gallery[5]
    near = gallery[9].clone()
    near[0] = torch.nextafter(near[0].float(), torch.tensor(2.0)).half()   # one fp16 step away: a near-tie
    gallery[10] = near
    queries = torch.nn.functional.normalize(centres[torch.randint(0, 40, (120,), generator=gen)]
                                            + 0.6 * torch.randn(120, dim, generator=gen) / dim ** 0.5, dim=1)
    queries[0] = gallery[5].float() * 3.0
    queries[1] = (gallery[9].float() + gallery[10].float()) / 2
    return gallery, queries


def _brute(query: torch.Tensor, gallery: torch.Tensor, k: int, allowed: np.ndarray | None = None):
    """fp64 top-k, a stable sort of the negated cosines (ties: lowest row first), optionally among ``allowed``."""
    unit = gallery.double().numpy()
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    cosine = unit @ (query.double().numpy() / np.linalg.norm(query.double().numpy()))
    if allowed is not None:
        cosine[np.setdiff1d(np.arange(cosine.shape[0]), allowed)] = -np.inf
    order = np.argsort(-cosine, kind="stable")[:k]
    return order, cosine[order]


@pytest.fixture(scope="module")
def data():
    return _fp16_gallery(4000, 32, 0)


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_stored_rerank_is_the_fp64_brute_force_over_the_stored_rows(data, kind):
    gallery, queries = data
    ann = build_ann(gallery.float(), kind).prepare_rerank()
    # a unit fp16 gallery is stored bit for bit (the IVF lists hold the rows, not residuals)
    assert np.array_equal(ann.stored_rows(0, gallery.shape[0]), gallery.float().numpy())
    ann.set_effort({"efSearch": 2048} if kind == "hnsw" else {"nprobe": int(ann.params["nlist"])})
    prepared = PreparedGallery(gallery.float())
    for k in (1, 5):
        index, score = ann_search(queries, None, ann, k)
        assert index[0].tolist()[:min(k, 4)] == [5, *DUPLICATES][:min(k, 4)]
        assert index[1, 0] in (9, 10)
        for row in range(queries.shape[0]):
            order, expected = _brute(queries[row], gallery, k)
            assert index[row].tolist() == order.tolist()
            np.testing.assert_allclose(score[row].numpy(), expected, rtol=0, atol=1e-12)
        # the same scores, bit for bit, as the exact kernel over the same rows
        kernel_index, kernel_score = search_prepared(queries, prepared, k)
        assert torch.equal(index, kernel_index) and torch.equal(score, kernel_score)


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_stored_rerank_at_a_tuned_effort_is_exact_over_the_candidates(data, kind):
    gallery, queries = data
    ann = build_ann(gallery.float(), kind)
    prepared = PreparedGallery(gallery.float())
    measured = tune_ann(ann, prepared, queries[:60], 0.95, from_storage=True)
    assert measured["recall"] >= 0.95
    k = 3
    index, score = ann_search(queries[60:], None, ann, k)
    _, candidates = ann.scored_candidates(queries[60:].numpy(), candidate_count(k, ann.size, kind))
    for row in range(index.shape[0]):
        order, expected = _brute(queries[60 + row], gallery, k, candidates[row])
        assert index[row].tolist() == order.tolist()
        np.testing.assert_allclose(score[row].numpy(), expected, rtol=0, atol=1e-12)


def test_survivors_keep_every_candidate_within_the_bound_and_drop_the_rest():
    inverse = np.array([1.0, 1.0, 1.0, 0.5])
    cand = np.array([[0, 1, 2, 3, -1]])
    # row 1 is 1e-6 below row 0 (inside the ~2e-5 bound at D = 512), row 2 far below, row 3 scaled by its norm
    scores = np.array([[0.9, 0.9 - 1e-6, 0.5, 1.8 - 1e-6, 7.0]], dtype=np.float32)
    keep = survivors(scores, cand, inverse, 512, 1)
    assert keep.tolist() == [[True, True, False, True, False]]
    # top-3: the three near-tied rows; the fourth-best (0.5) cannot reach the third
    assert survivors(scores, cand, inverse, 512, 3).tolist() == [[True, True, False, True, False]]
    assert survivors(scores, cand, inverse, 512, 4).tolist() == [[True, True, True, True, False]]


def test_rows_the_structure_cannot_fill_are_searched_over_every_stored_row(data):
    gallery, queries = data
    ann = build_ann(gallery.float(), "ivf", {"nlist": 60})
    ann.set_effort({"nprobe": 1})
    index, _ = ann_search(queries[:3], None, ann, 200)   # more than one list holds: -1 padding from faiss
    for row in range(3):
        assert index[row].tolist() == _brute(queries[row], gallery, 200)[0].tolist()


def test_memory_is_the_structure_and_eight_bytes_a_row_and_survives_bytes():
    gallery, queries = _fp16_gallery(8000, 512, 1)
    ann = build_ann(gallery.float(), "ivf").prepare_rerank()
    raw = gallery.numel() * 2
    centres = int(ann.params["nlist"]) * 512 * 4           # fixed: the coarse quantizer
    assert ann.bytes_in_memory() - centres <= 1.1 * raw
    again = AnnIndex.from_bytes(ann.to_bytes(), "ivf", ann.params, {"nprobe": int(ann.params["nlist"])})
    ann.set_effort({"nprobe": int(ann.params["nlist"])})
    assert torch.equal(ann_search(queries, None, again, 2)[0], ann_search(queries, None, ann, 2)[0])


def test_lossy_codes_are_refused_without_the_prepared_gallery(data):
    gallery, queries = data
    ann = build_ann(gallery.float(), "ivfpq")
    with pytest.raises(ValueError, match=r"a ivfpq index does not hold its rows exactly \(only \('ivf', 'hnsw'\)"):
        ann_search(queries, None, ann, 1)
    with pytest.raises(ValueError, match="query: row 0 has zero or non-finite norm"):
        ann_search(torch.zeros(2, 32), None, build_ann(gallery.float(), "hnsw"), 1)


def test_lossy_codes_re_rank_from_a_row_file_as_the_exact_kernel_over_their_candidates(data, tmp_path):
    """IVF-PQ with its fp16 rows in a row file: every query's answer is the fp64 brute force over the
    structure's candidates (ties to the lowest row), bit for bit the exact kernel's over the gallery when every list
    is probed."""
    from compat_core.retrieval.row_file import RowFile, write_row_file

    gallery, queries = data
    ann = build_ann(gallery.float(), "ivfpq")
    ann.attach_rows(write_row_file(str(tmp_path / "rows.f16"), gallery.numpy())).prepare_rerank()
    assert np.array_equal(ann.stored_rows(0, gallery.shape[0]), gallery.float().numpy())
    ann.set_effort({"nprobe": 4})
    k = 3
    index, score = ann_search(queries, None, ann, k)
    _, candidates = ann.scored_candidates(queries.numpy(), candidate_count(k, ann.size, "ivfpq"))
    for row in range(queries.shape[0]):
        order, expected = _brute(queries[row], gallery, k, candidates[row])
        assert index[row].tolist() == order.tolist()
        np.testing.assert_allclose(score[row].numpy(), expected, rtol=0, atol=1e-12)
    ann.set_effort({"nprobe": int(ann.params["nlist"])})
    prepared = PreparedGallery(gallery.float())
    exhaustive, exhaustive_score = ann_search(queries, None, ann, 1)
    kernel, kernel_score = search_prepared(queries, prepared, 1)
    both = (exhaustive == kernel)[:, 0]
    assert float(both.float().mean()) >= 0.95        # the codes' 128 candidates hold the exact top-1
    assert torch.equal(exhaustive_score[both], kernel_score[both]) and both[0]     # row 0: the duplicates' first
    assert torch.equal(ann_search(queries, prepared, ann, 1)[1][both], exhaustive_score[both])
    rows = RowFile(str(tmp_path / "rows.f16"), gallery.shape[0], gallery.shape[1])
    with pytest.raises(ValueError, match="rows.f16: 4000 x 32 rows for a ivfpq structure of 3999 x 32"):
        build_ann(gallery[:3999].float(), "ivfpq").attach_rows(rows)
    (tmp_path / "short.f16").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="short.f16: 10 bytes, expected 256000"):
        RowFile(str(tmp_path / "short.f16"), 4000, 32)


def test_a_row_file_search_holds_none_of_the_file_after_many_batches(tmp_path):
    """Searches read their candidates' rows with positioned reads: after 20 batches of 2 queries the process maps
    none of the file (a mapping of the same file read for the same candidates, as the check's own control, holds
    more than one batch's 256 candidate pages), and every answer is the fp64 brute force over its candidates."""
    import mmap

    from compat_core.retrieval.row_file import write_row_file

    gallery, _ = _fp16_gallery(4000, 512, 2)
    queries = torch.nn.functional.normalize(torch.randn(40, 512, generator=torch.Generator().manual_seed(3)), dim=1)
    rows = write_row_file(str(tmp_path / "rows.f16"), gallery.numpy())
    ann = build_ann(gallery.float(), "ivfpq").attach_rows(rows).prepare_rerank()
    ann.set_effort({"nprobe": 4})
    count = candidate_count(1, ann.size, "ivfpq")
    batch_bound = 2 * count * 4096
    assert rows.mapped_bytes() == 0
    np.testing.assert_array_equal(rows.rows_of(np.array([7, 3, 7])), gallery[[7, 3, 7]].float().numpy())
    with pytest.raises(ValueError, match=r"rows.f16: rows outside 0..3999"):
        rows.rows_of(np.array([3, 4000]))
    for start in range(0, 40, 2):
        batch = queries[start:start + 2]
        index, score = ann_search(batch, None, ann, 1)
        _, candidates = ann.scored_candidates(batch.numpy(), count)
        for row in range(2):
            order, expected = _brute(batch[row], gallery, 1, candidates[row])
            assert index[row].tolist() == order.tolist()
            np.testing.assert_allclose(score[row].numpy(), expected, rtol=0, atol=1e-12)
        assert rows.mapped_bytes() == 0
    with open(rows.path, "rb") as source:
        mapping = mmap.mmap(source.fileno(), rows.nbytes, access=mmap.ACCESS_READ)
    try:
        view = np.frombuffer(mapping, dtype="<f2").reshape(ann.size, ann.dim)
        _, candidates = ann.scored_candidates(queries.numpy(), count)
        view[np.unique(candidates[candidates >= 0])].astype(np.float32)
        assert rows.mapped_bytes() > batch_bound
        del view
    finally:
        mapping.close()
    assert rows.mapped_bytes() == 0
