"""The prepared-gallery kernel path and the exact merge of version groups against fp64 brute force (pure, fast)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from compat_core.retrieval.mixed_gallery import build_groups, search_groups
from compat_core.retrieval.search import PRECISIONS, PreparedGallery, nearest_neighbours, search_prepared
from compat_core.retrieval.search_request import RequestError, SearchLimits, parse_search_request


def brute(query: np.ndarray, gallery: np.ndarray, k: int):
    """fp64 cosine top-k, einsum without BLAS (identical rows, identical scores); stable: lowest index first."""
    q = query.astype(np.float64) / np.linalg.norm(query.astype(np.float64), axis=1, keepdims=True)
    g = gallery.astype(np.float64) / np.linalg.norm(gallery.astype(np.float64), axis=1, keepdims=True)
    scores = np.einsum("qd,gd->qg", q, g, optimize=False)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(scores, order, axis=1)


def tied_data(seed: int, nq: int = 40, ng: int = 300, dim: int = 24):
    rng = np.random.default_rng(seed)
    gallery = rng.standard_normal((ng, dim)).astype(np.float32)
    query = rng.standard_normal((nq, dim)).astype(np.float32)
    gallery[[5, 77, 250]] = gallery[160]           # exact ties across the whole gallery
    query[0] = gallery[160] + np.float32(0.01) * rng.standard_normal(dim).astype(np.float32)
    return query, gallery


@pytest.mark.parametrize("precision", PRECISIONS)
def test_prepared_gallery_equals_brute_force_and_the_per_call_kernel(precision):
    query, gallery = tied_data(1)
    prepared = PreparedGallery(gallery, precision)
    for _ in range(2):   # the preparation is reused: a second search gives the same answer
        index, scores = search_prepared(query, prepared, k=6)
        expected, expected_scores = brute(query, gallery, 6)
        np.testing.assert_array_equal(index.numpy(), expected)
        np.testing.assert_allclose(scores.numpy(), expected_scores, rtol=0, atol=1e-12)
    assert index[0, :4].tolist() == [5, 77, 160, 250]
    direct, _ = nearest_neighbours(query, gallery, k=6, precision=precision)
    np.testing.assert_array_equal(direct.numpy(), index.numpy())


def test_search_prepared_validates_its_inputs():
    prepared = PreparedGallery(np.eye(4, dtype=np.float32))
    with pytest.raises(ValueError, match="k"):
        search_prepared(np.ones((1, 4), np.float32), prepared, k=5)
    with pytest.raises(ValueError):
        search_prepared(np.ones((1, 3), np.float32), prepared, k=1)
    with pytest.raises(TypeError, match="PreparedGallery"):
        search_prepared(np.ones((1, 4), np.float32), np.eye(4), k=1)


def test_version_groups_merge_exactly_like_one_search_over_the_whole_gallery():
    """Groups searched with the same query: the merge equals the single brute force, exact ties across groups
    resolved by the lowest gallery position."""
    query, gallery = tied_data(2)
    versions = np.where(np.arange(gallery.shape[0]) % 3 == 0, "1", "2")   # ties 5, 77, 160, 250 span both groups
    groups = build_groups(gallery, versions, "auto")
    positions, scores, group_of = search_groups(torch.from_numpy(query), groups, k=7)
    expected, expected_scores = brute(query, gallery, 7)
    np.testing.assert_array_equal(positions, expected)
    # the rows are normalised in fp32 first (as the evaluation does), so scores differ from fp64 at ~1e-8
    np.testing.assert_allclose(scores, expected_scores, rtol=0, atol=1e-6)
    assert [groups[g].version for g in group_of[0, :4]] == [versions[p] for p in positions[0, :4]]


def test_an_old_group_is_searched_with_its_mapped_query():
    """A query adapter for group '1' (here: a fixed rotation R, the old space = R x new space): its items score
    against R q, the other group against q; the merge equals brute force over those two searches."""
    rng = np.random.default_rng(3)
    query, gallery = tied_data(3)
    rotation = np.linalg.qr(rng.standard_normal((24, 24)))[0].astype(np.float32)
    versions = np.where(np.arange(gallery.shape[0]) < 150, "1", "2")
    groups = build_groups(gallery, versions, "fp32",
                          query_maps={"1": lambda rows: rows @ torch.from_numpy(rotation).T})
    positions, scores, _ = search_groups(torch.from_numpy(query), groups, k=5)
    q = query.astype(np.float64) / np.linalg.norm(query.astype(np.float64), axis=1, keepdims=True)
    mapped = (torch.nn.functional.normalize(torch.from_numpy(query), dim=1) @ torch.from_numpy(rotation).T)
    mapped = torch.nn.functional.normalize(mapped, dim=1).double().numpy()
    g = gallery.astype(np.float64) / np.linalg.norm(gallery.astype(np.float64), axis=1, keepdims=True)
    all_scores = np.where(versions[None, :] == "1", mapped @ g.T, q @ g.T)
    expected = np.argsort(-all_scores, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(positions, expected)
    np.testing.assert_allclose(scores, np.take_along_axis(all_scores, expected, axis=1), atol=1e-6)


def test_k_beyond_the_gallery_is_refused():
    groups = build_groups(np.eye(3, dtype=np.float32), np.array(["1", "1", "2"]))
    with pytest.raises(ValueError, match="k"):
        search_groups(torch.ones(1, 3), groups, k=4)


def test_request_parsing_accepts_a_valid_embedding_and_defaults():
    parsed = parse_search_request(b'{"embedding": [1, 0, 0.5]}', "application/json", dim=3, image_shape=None,
                                  gallery_size=50)
    assert parsed.k == 10 and parsed.embedding.dtype == np.float32 and parsed.embedding.tolist() == [1, 0, 0.5]
    with pytest.raises(RequestError) as caught:
        parse_search_request(b'{"image": "AAAA"}', None, dim=3, image_shape=None, gallery_size=50)
    assert caught.value.field == "image" and caught.value.status == 400


HOSTILE_BODIES = [  # (what, body, field named)
    ("400-digit integer item", b'{"embedding": [' + b"9" * 400 + b', 1, 1]}', "embedding"),
    ("5000-digit integer k", b'{"embedding": [1, 1, 1], "k": ' + b"9" * 5000 + b"}", "body"),
    ("400-digit integer k", b'{"embedding": [1, 1, 1], "k": ' + b"9" * 400 + b"}", "k"),
    ("norm underflows float32", json.dumps({"embedding": [1e-300] * 3}).encode(), "embedding"),
    ("squared norm underflows float32", json.dumps({"embedding": [1e-30] * 3}).encode(), "embedding"),
    ("norm overflows float32", json.dumps({"embedding": [3e38] * 3}).encode(), "embedding"),
    ("100k-deep nesting", b'{"embedding": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
]


@pytest.mark.parametrize("what,body,field", HOSTILE_BODIES, ids=[h[0] for h in HOSTILE_BODIES])
def test_hostile_numbers_and_nesting_are_400_naming_the_field(what, body, field):
    with pytest.raises(RequestError) as caught:
        parse_search_request(body, "application/json", dim=3, image_shape=None, gallery_size=50,
                             limits=SearchLimits(max_body_bytes=1 << 20))
    assert (caught.value.status, caught.value.field) == (400, field), (what, caught.value)
    assert len(caught.value.message) < 400


def test_tiny_but_representable_embeddings_are_accepted():
    """A norm of 3e-12 is above the 1e-12 floor of the kernel's normalisation: accepted, and the kernel ranks it
    like the unit vector (1/3, 2/3, 2/3); 3e-13 is below it and refused."""
    parsed = parse_search_request(json.dumps({"embedding": [1e-12, 2e-12, 2e-12]}).encode(), None, dim=3,
                                  image_shape=None, gallery_size=50)
    gallery = np.asarray([[1, 0, 0], [1 / 3, 2 / 3, 2 / 3], [0, 1, 0]], dtype=np.float32)
    groups = build_groups(gallery, np.asarray(["1"] * 3), "fp32")
    positions, scores, _ = search_groups(torch.as_tensor(parsed.embedding[None]), groups, 3)
    assert positions[0].tolist() == [1, 2, 0]
    np.testing.assert_allclose(scores[0], [1.0, 2 / 3, 1 / 3], atol=1e-6)
    with pytest.raises(RequestError, match="norm underflows"):
        parse_search_request(json.dumps({"embedding": [1e-13, 2e-13, 2e-13]}).encode(), None, dim=3,
                             image_shape=None, gallery_size=50)
