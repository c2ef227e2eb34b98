"""Approximate candidate stage over a gallery (faiss), its exact re-ranking, and the choice of its search effort.

An ``AnnIndex`` holds a faiss structure over the gallery's L2-normalised fp32 rows (inner product = cosine):
``ivf`` (IVF-Flat with the rows stored in fp16, as the gallery's fp16 storage: faiss' ``IndexIVFScalarQuantizer``
QT_fp16), ``hnsw`` (HNSW-Flat) or ``ivfpq`` (IVF with product-quantised codes, the compressed option).
A search asks it for ``candidate_count(k)`` rows per query and re-ranks them with the exact kernel's fp64 scores
(``compat_core.retrieval.search.search_candidates``): the answer is the exact top-k whenever the candidates hold
it, with exact ties broken by the lowest gallery row as the exact search does. ``flat`` is the exact kernel alone
(no structure).

The search effort (``nprobe`` for the IVF kinds, ``efSearch`` for HNSW) is chosen by measurement
(:func:`tune_ann`): the smallest effort of a doubling ladder whose answers' top-1 equals the exact top-1 on at
least ``recall`` of a held-out query sample ("Recall@1 of exact"). The structure's build parameters follow fixed
rules recorded with it (``nlist`` = 2 sqrt(N) lists trained on at most 40 rows per list, HNSW degree M = 32,
PQ with 8-bit codes over D/4 sub-vectors where D allows: 1/8 of the fp16 rows' bytes).

The IVF lists and HNSW's storage hold the rows themselves (fp16 rows, not residuals to a list centre; fp32 rows),
so these two can also re-rank without the gallery's prepared rows (``ann_search(query, None, ann, k)``): the
structure's own fp32 scores of its candidates, scaled by each stored row's fp64 inverse norm, rule out every
candidate that a proven bound keeps from the top-k (``compat_core.retrieval.rerank``), and only the survivors
(about one a query for top-1) are decoded and scored in fp64. The answer is then the exact top-k over the rows as
stored, whenever the candidates hold it. ``ivfpq``'s codes are lossy: it re-ranks against the prepared gallery, or,
with the gallery's fp16 rows in a local file (:meth:`AnnIndex.attach_rows`, ``compat_core.retrieval.row_file``),
from the rows of its candidates read there (all of them: lossy scores bound nothing; positioned reads, nothing
mapped), holding the codes and 8 bytes a row, plus one search's candidate rows while it runs.

faiss is imported inside the functions that use it (a heavy optional dependency); the index travels as
``faiss.serialize_index`` bytes, never pickled.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from compat_core.retrieval.rerank import compact, rerank_vectors, stored_inverse_norms, survivors, unit_queries
from compat_core.retrieval.row_file import RowFile
from compat_core.retrieval.search import PreparedGallery, search_candidates, search_prepared

__all__ = ["KINDS", "STORED_EXACT", "AnnIndex", "AnnSubset", "build_ann", "tune_ann", "ann_search", "ann_subset",
           "candidate_count", "candidate_rule", "default_params", "effort_ladder", "recall_of_exact",
           "set_faiss_threads", "stored_fp16_rows"]

KINDS = ("flat", "ivf", "hnsw", "ivfpq")
STORED_EXACT = ("ivf", "hnsw")   # structures holding the rows themselves (fp16, fp32): the re-rank reads them there
_UNIT_SLACK = 2.0 ** -10         # rows whose norms are this close to 1 are stored as given (an fp16 unit gallery
                                 # is then held bit for bit), others are normalised first
_EXACT_BLOCK = 4096              # stored rows per block of the exhaustive fallback
_MIN_CANDIDATES = 32
_CANDIDATES_PER_K = 4
_TRAIN_ROWS_PER_LIST = 40    # faiss k-means asks for at least 39 training rows per centroid
_PQ_CANDIDATE_FACTOR = 4
_HNSW_M = 32
_HNSW_EF_CONSTRUCTION = 64
_EF_LADDER = (16, 32, 64, 128, 256, 512, 1024, 2048)


def candidate_rule(kind: str) -> dict:
    """How many rows the approximate stage returns per query: {"per_k": a, "min": b} means max(a k, b). Four
    candidates per result, at least 32; four times that for the compressed ``ivfpq`` (its codes rank coarsely)."""
    factor = _PQ_CANDIDATE_FACTOR if kind == "ivfpq" else 1
    return {"per_k": factor * _CANDIDATES_PER_K, "min": factor * _MIN_CANDIDATES}


def candidate_count(k: int, size: int, kind: str = "ivf") -> int:
    """Rows the approximate stage returns per query for a top-k (:func:`candidate_rule`), at most ``size``."""
    rule = candidate_rule(kind)
    return int(min(size, max(rule["per_k"] * k, rule["min"])))


def _faiss():
    import faiss

    return faiss


def set_faiss_threads(count: int) -> None:
    """faiss' OpenMP thread count for this process (searches of every structure)."""
    _faiss().omp_set_num_threads(int(count))


def _unit32(rows, name: str = "gallery") -> np.ndarray:
    array = rows.detach().cpu().float().numpy() if torch.is_tensor(rows) else np.asarray(rows, dtype=np.float32)
    if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"{name}: expected a non-empty (rows, dim) array, got shape {array.shape}")
    norms = np.linalg.norm(array.astype(np.float64), axis=1)
    if not np.all(np.isfinite(norms) & (norms > 0)):
        row = int(np.flatnonzero(~(np.isfinite(norms) & (norms > 0)))[0])
        raise ValueError(f"{name}: row {row} has zero or non-finite norm; cosine similarity is undefined")
    return np.ascontiguousarray((array / norms[:, None]).astype(np.float32))


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")


def default_params(kind: str, size: int, dim: int) -> dict:
    """The structure's build parameters for ``size`` rows of width ``dim`` (the rules in the module docstring)."""
    _check_kind(kind)
    if kind == "hnsw":
        return {"M": _HNSW_M, "efConstruction": _HNSW_EF_CONSTRUCTION}
    if kind == "flat":
        return {}
    # faiss k-means wants ~39 training rows per list: fewer lists on small galleries, one at the least
    params = {"nlist": int(max(1, min(round(2 * math.sqrt(size)), size // 39)))}
    if kind == "ivfpq":
        divisors = [m for m in range(1, dim + 1) if dim % m == 0 and m <= max(1, dim // 4)]
        params["pq_m"] = divisors[-1]
        params["pq_bits"] = int(max(1, min(8, math.floor(math.log2(max(2, size // 39))))))
    return params


@dataclass
class AnnIndex:
    """A faiss structure over a gallery's unit rows. kind: one of ``KINDS`` but "flat"; params: build parameters;
    effort: the search effort in use ({"nprobe": n} or {"efSearch": n})."""

    kind: str
    params: dict
    index: object
    effort: dict = field(default_factory=dict)
    inverse: torch.Tensor | None = field(default=None, repr=False)   # (N,) fp64 inverse norms of the stored rows
    row_file: RowFile | None = field(default=None, repr=False)       # the rows, where the structure's are lossy

    @property
    def size(self) -> int:
        return int(self.index.ntotal)

    @property
    def dim(self) -> int:
        return int(self.index.d)

    def set_effort(self, effort: dict) -> None:
        """Use search effort ``effort`` ({"nprobe": n} for ivf / ivfpq, {"efSearch": n} for hnsw)."""
        key = "efSearch" if self.kind == "hnsw" else "nprobe"
        if set(effort) != {key} or int(effort[key]) < 1:
            raise ValueError(f"effort: a {self.kind} index takes {{'{key}': positive int}}, got {effort!r}")
        if self.kind == "hnsw":
            self.index.hnsw.efSearch = int(effort[key])
        else:
            _faiss().extract_index_ivf(self.index).nprobe = int(effort[key])
        self.effort = {key: int(effort[key])}

    def candidates(self, query, count: int, subset: "AnnSubset | None" = None) -> np.ndarray:
        """(Nq, count) int64 gallery rows of the structure's best ``count`` per query (-1 where it found fewer);
        subset: only its rows are searched (faiss' ID selector, at the search effort in use)."""
        if subset is None:
            _, rows = self.index.search(_unit32(query, "query"), int(count))
        else:
            _, rows = self.index.search(_unit32(query, "query"), int(count), params=self._search_params(subset))
        return rows.astype(np.int64, copy=False)

    def _search_params(self, subset: "AnnSubset"):
        faiss = _faiss()
        if self.kind == "hnsw":
            return faiss.SearchParametersHNSW(sel=subset.selector, efSearch=int(self.effort["efSearch"]))
        return faiss.SearchParametersIVF(sel=subset.selector, nprobe=int(self.effort["nprobe"]))

    def stored_rows(self, start: int, stop: int) -> np.ndarray:
        """(stop - start, D) float32: the structure's stored rows start..stop-1 as it holds them (fp16 rows of
        ``ivf`` decoded exactly, fp32 rows of ``hnsw``), or the attached row file's (:meth:`attach_rows`);
        ValueError for ``ivfpq`` without one, its codes being lossy."""
        self._check_stored()
        if self.row_file is not None:
            return self.row_file.stored_rows(start, stop)
        return self.index.reconstruct_n(int(start), int(stop - start))

    def attach_rows(self, row_file: RowFile) -> "AnnIndex":
        """Re-rank from ``row_file`` (the gallery's rows in the structure's row order, read per candidate): what an
        ``ivfpq`` structure needs to answer exactly without the gallery's rows in memory. Returns self."""
        if (row_file.size, row_file.dim) != (self.size, self.dim):
            raise ValueError(f"{row_file.path}: {row_file.size} x {row_file.dim} rows for a {self.kind} structure "
                             f"of {self.size} x {self.dim}")
        self.row_file, self.inverse = row_file, None
        return self

    def prepare_rerank(self) -> "AnnIndex":
        """Make the structure ready to re-rank from its own rows (kinds ``STORED_EXACT``): measure the stored
        rows' fp64 inverse norms once (8 bytes a row) and give an IVF structure its row-to-list map (8 bytes a
        row), so :func:`ann_search` needs no prepared gallery. Returns self."""
        self._check_stored()
        if self.kind == "ivf" and self.row_file is None:
            ivf = _faiss().extract_index_ivf(self.index)
            if ivf.direct_map.type == _faiss().DirectMap.NoMap:
                ivf.make_direct_map()
        if self.inverse is None:
            self.inverse = stored_inverse_norms(self.stored_rows, self.size)
            if self.row_file is not None:   # the whole file was read once: queries start from a cold cache
                self.row_file.drop_cache()
        return self

    def rows_of(self, rows: np.ndarray) -> np.ndarray:
        """(n, D) float32: the stored rows ``rows`` (int64 gallery rows; :meth:`prepare_rerank` first)."""
        if self.row_file is not None:
            return self.row_file.rows_of(rows)
        return self.index.reconstruct_batch(np.ascontiguousarray(rows, dtype=np.int64))

    def scored_candidates(self, unit_query: np.ndarray, count: int,
                          subset: "AnnSubset | None" = None) -> tuple[np.ndarray, np.ndarray]:
        """((Nq, count) float32 inner products of the fp32 unit query rows ``unit_query`` and the stored rows,
        (Nq, count) int64 gallery rows, -1 where the structure found fewer); subset: only its rows are searched."""
        if subset is None:
            scores, rows = self.index.search(unit_query, int(count))
        else:
            scores, rows = self.index.search(unit_query, int(count), params=self._search_params(subset))
        return scores, rows.astype(np.int64, copy=False)

    def _check_stored(self) -> None:
        if self.kind not in STORED_EXACT and self.row_file is None:
            raise ValueError(f"a {self.kind} index does not hold its rows exactly (only {STORED_EXACT} do); "
                             "re-rank it against the gallery's prepared rows or attach a row file (attach_rows)")

    def to_bytes(self) -> bytes:
        """The structure as ``faiss.serialize_index`` bytes."""
        return _faiss().serialize_index(self.index).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, kind: str, params: dict, effort: dict, source: str = "ann index") -> "AnnIndex":
        """The structure of :meth:`to_bytes`; ValueError naming ``source`` when the bytes are not a faiss index."""
        _check_kind(kind)
        faiss = _faiss()
        try:
            index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
        except RuntimeError as error:
            raise ValueError(f"{source}: not a faiss index ({str(error).splitlines()[0][:200]})") from None
        ann = cls(kind, dict(params), index)
        ann.set_effort(effort)
        return ann

    def bytes_in_memory(self) -> int:
        """What a process holds of it, bytes: the serialized structure, plus the inverse norms once measured (an
        attached row file maps nothing: its reads hold one search's candidate rows while it runs)."""
        return len(self.to_bytes()) + (0 if self.inverse is None else self.inverse.numel() * 8)


@dataclass(frozen=True)
class AnnSubset:
    """Some rows of a structure, the only ones a search may return (the rest are masked, not removed: the
    structure stays as built). rows: (n,) int64 ascending structure rows; selector: faiss' ID selector over them."""

    rows: np.ndarray
    selector: object = field(repr=False)


def ann_subset(ann: AnnIndex, rows) -> AnnSubset:
    """The subset of ``ann``'s rows ``rows`` (distinct, ascending, within 0..size-1), built once (O(size) bits)."""
    rows = np.ascontiguousarray(np.asarray(rows, dtype=np.int64))
    if rows.ndim != 1 or rows.size == 0 or np.any(np.diff(rows) <= 0) or rows[0] < 0 or rows[-1] >= ann.size:
        raise ValueError(f"subset rows: expected distinct ascending rows within 0..{ann.size - 1}, got "
                         f"{rows.size} rows")
    bits = np.zeros(ann.size, dtype=bool)
    bits[rows] = True
    bitmap = np.packbits(bits, bitorder="little")
    selector = _faiss().IDSelectorBitmap(ann.size, _faiss().swig_ptr(bitmap))
    selector.referenced_bitmap = bitmap     # the selector reads the array: keep it alive with it
    return AnnSubset(rows, selector)


def _stored_form(gallery) -> np.ndarray:
    """The rows the structure stores: as given (fp32) where every norm is within ``_UNIT_SLACK`` of 1, so that
    a unit gallery in fp16 is held exactly, else L2-normalised (inner product = cosine up to that slack)."""
    array = gallery.detach().cpu().float().numpy() if torch.is_tensor(gallery) else np.asarray(gallery, np.float32)
    if array.ndim == 2 and array.size:
        norms = np.linalg.norm(array.astype(np.float64), axis=1)
        if np.all(np.abs(norms - 1.0) <= _UNIT_SLACK):
            return np.ascontiguousarray(array, dtype=np.float32)
    return _unit32(array)


def stored_fp16_rows(gallery) -> np.ndarray:
    """(N, D) fp16: the gallery's rows as an ``ivf`` structure stores them (as given where every norm is within
    ``_UNIT_SLACK`` of 1, else L2-normalised; then rounded to fp16): what a row file holds for an ``ivfpq``
    structure, so that both re-rank over the same rows."""
    return _stored_form(gallery).astype(np.float16)


def build_ann(gallery, kind: str, params: dict | None = None, seed: int = 0) -> AnnIndex:
    """Build a ``kind`` structure over the gallery's rows (L2-normalised here); params default to
    :func:`default_params`. The IVF kinds train on a seeded sample of at most 40 rows per list."""
    _check_kind(kind)
    if kind == "flat":
        raise ValueError("kind 'flat' is the exact kernel alone; it builds no approximate structure")
    faiss = _faiss()
    rows = _stored_form(gallery)
    size, dim = rows.shape
    params = {**default_params(kind, size, dim), **(params or {})}
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, int(params["M"]), faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = int(params["efConstruction"])
    else:
        quantizer = faiss.IndexFlatIP(dim)
        if kind == "ivf":
            index = faiss.IndexIVFScalarQuantizer(quantizer, dim, int(params["nlist"]),
                                                  faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
            index.by_residual = False     # the lists hold the fp16 rows themselves, not residuals to a centre
        else:
            index = faiss.IndexIVFPQ(quantizer, dim, int(params["nlist"]), int(params["pq_m"]),
                                     int(params["pq_bits"]), faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = int(seed)
        train_rows = min(size, _TRAIN_ROWS_PER_LIST * max(int(params["nlist"]), 2 ** int(params.get("pq_bits", 0))))
        sample = np.sort(np.random.default_rng(seed).choice(size, train_rows, replace=False))
        index.train(rows[sample])
        index.own_fields = True
        quantizer.this.disown()
    index.add(rows)
    ann = AnnIndex(kind, params, index)
    ann.set_effort({"efSearch": _EF_LADDER[0]} if kind == "hnsw" else {"nprobe": 1})
    return ann


def ann_search(query, prepared: PreparedGallery | None, ann: AnnIndex, k: int = 1, subset: AnnSubset | None = None):
    """Top-k of each query row: ``ann``'s candidates re-ranked exactly (fp64 reference scores, ties by the lowest
    gallery row); rows for which the structure found fewer than k rows are searched exactly over the whole gallery.
    prepared: the gallery's rows prepared for the exact kernel, or None to re-rank from the structure's own stored
    rows (kinds ``STORED_EXACT``, or any kind with a row file attached; the answer is then exact over the rows as
    stored, and nothing but the structure and 16 bytes a row is held; :meth:`AnnIndex.prepare_rerank` once before
    searching from several threads).
    subset: search only these structure rows; the answer's indices are then rows of the subset (0 = its first),
    and ``prepared``, when given, holds exactly the subset's rows in the same order.
    Returns (indices (Nq, k) int64 tensor, fp64 cosine scores (Nq, k) tensor)."""
    if prepared is None:
        return _search_stored(query, ann, k, subset)
    if subset is not None:
        return _search_subset(query, prepared, ann, k, subset)
    if ann.size != prepared.size or ann.dim != prepared.dim:
        raise ValueError(f"ann index of {ann.size} x {ann.dim} rows does not match the gallery's "
                         f"{prepared.size} x {prepared.dim}")
    if not 1 <= k <= prepared.size:
        raise ValueError(f"k: expected 1 <= k <= gallery size ({prepared.size}), got {k}")
    query = torch.as_tensor(np.asarray(query, dtype=np.float32)) if not torch.is_tensor(query) else query.float()
    cand = ann.candidates(query, candidate_count(k, prepared.size, ann.kind))
    return _rerank_prepared(query, prepared, cand, k)


def _rerank_prepared(query: torch.Tensor, prepared: PreparedGallery, cand: np.ndarray, k: int):
    """Candidates ``cand`` (rows of ``prepared``, -1 for none) re-ranked exactly; a query with fewer than ``k``
    candidates is searched over every prepared row instead. (indices (Q, k) long, scores (Q, k) fp64)."""
    short = (cand >= 0).sum(axis=1) < k
    index = torch.empty((query.shape[0], k), dtype=torch.long)
    score = torch.empty((query.shape[0], k), dtype=torch.float64)
    if (~short).any():
        rows = torch.from_numpy(np.flatnonzero(~short))
        index[rows], score[rows] = search_candidates(query[rows], prepared, cand[~short], k)
    if short.any():
        rows = torch.from_numpy(np.flatnonzero(short))
        index[rows], score[rows] = search_prepared(query[rows], prepared, k)
    return index, score


def _search_subset(query, prepared: PreparedGallery | None, ann: AnnIndex, k: int, subset: AnnSubset):
    """:func:`ann_search` over the rows ``subset`` of the structure, re-ranked against ``prepared`` (its rows)."""
    if prepared.size != subset.rows.size or ann.dim != prepared.dim:
        raise ValueError(f"a subset search re-ranks against the subset's prepared rows: {subset.rows.size} x "
                         f"{ann.dim} expected, got {prepared.size} x {prepared.dim}")
    if not 1 <= k <= prepared.size:
        raise ValueError(f"k: expected 1 <= k <= subset size ({prepared.size}), got {k}")
    query = torch.as_tensor(np.asarray(query, dtype=np.float32)) if not torch.is_tensor(query) else query.float()
    found = ann.candidates(query, candidate_count(k, prepared.size, ann.kind), subset)
    # structure rows -> rows of the subset (every returned row is in it: the selector admits no other)
    cand = np.where(found >= 0, np.searchsorted(subset.rows, np.maximum(found, 0)), -1)
    return _rerank_prepared(query, prepared, cand, k)


def _search_stored(query, ann: AnnIndex, k: int, subset: AnnSubset | None = None):
    """:func:`ann_search` re-ranking from the structure's stored rows: only the candidates that the structure's
    own fp32 scores cannot rule out (``rerank.survivors``) are decoded and scored in fp64."""
    size = ann.size if subset is None else int(subset.rows.size)
    if not 1 <= k <= size:
        raise ValueError(f"k: expected 1 <= k <= gallery size ({size}), got {k}")
    ann.prepare_rerank()
    query = (query.detach().cpu().float() if torch.is_tensor(query)
             else torch.as_tensor(np.asarray(query, dtype=np.float32)))
    q64, unit32 = unit_queries(query)
    scores32, cand = ann.scored_candidates(unit32, candidate_count(k, size, ann.kind), subset)
    inverse = ann.inverse.numpy()
    # the bound on the structure's own scores holds for rows it stores exactly; lossy codes rule nothing out
    kept = compact(survivors(scores32, cand, inverse, ann.dim, k), cand) if ann.kind in STORED_EXACT else cand
    vectors = np.zeros((kept.shape[0], kept.shape[1], ann.dim), dtype=np.float32)
    present = kept >= 0
    vectors[present] = ann.rows_of(kept[present])
    index, score = rerank_vectors(q64, kept, vectors, inverse, k)
    short = np.flatnonzero((cand >= 0).sum(axis=1) < k)
    if short.size:
        index[short], score[short] = _exhaustive_stored(q64[short], ann, k, subset)
    if subset is not None:   # structure rows -> rows of the subset
        found = index.numpy()
        index = torch.from_numpy(np.where(found >= 0, np.searchsorted(subset.rows, np.maximum(found, 0)), -1))
    return index, score


def _exhaustive_stored(q64: np.ndarray, ann: AnnIndex, k: int, subset: AnnSubset | None = None):
    """Exact top-k over every stored row (of ``subset`` when given), block by block (rows the structure found
    fewer than k rows for); indices are structure rows."""
    parts_index, parts_score = [], []
    count, inverse = q64.shape[0], ann.inverse.numpy()
    size = ann.size if subset is None else int(subset.rows.size)
    for start in range(0, size, _EXACT_BLOCK):
        if subset is None:
            block = ann.stored_rows(start, min(size, start + _EXACT_BLOCK))
            rows = np.broadcast_to(np.arange(start, start + block.shape[0]), (count, block.shape[0]))
        else:
            taken = subset.rows[start:start + _EXACT_BLOCK]
            block = ann.rows_of(taken)
            rows = np.broadcast_to(taken, (count, taken.size))
        index, score = rerank_vectors(q64, rows, np.broadcast_to(block, (count, *block.shape)), inverse,
                                      min(k, block.shape[0]))
        parts_index.append(index)
        parts_score.append(score)
    index, score = torch.cat(parts_index, dim=1), torch.cat(parts_score, dim=1)
    # blocks ascend in rows, so a stable sort by score keeps the lowest row first among exact ties
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.gather(index, 1, order), torch.gather(score, 1, order)


def recall_of_exact(approximate_top1, exact_top1) -> float:
    """Fraction of queries whose approximate top-1 gallery row equals the exact top-1 row."""
    a, e = np.asarray(approximate_top1).reshape(-1), np.asarray(exact_top1).reshape(-1)
    if a.shape != e.shape or a.size == 0:
        raise ValueError(f"top-1 rows: expected two equal non-empty shapes, got {a.shape} and {e.shape}")
    return float(np.mean(a == e))


def effort_ladder(ann: AnnIndex) -> list[dict]:
    """The search efforts tried, smallest first: nprobe 1, 2, 4, ... nlist (IVF kinds), efSearch 16 ... 2048."""
    if ann.kind == "hnsw":
        return [{"efSearch": ef} for ef in _EF_LADDER]
    nlist = int(ann.params["nlist"])
    ladder = [2 ** i for i in range(int(math.log2(nlist)) + 1)]
    return [{"nprobe": n} for n in ladder + ([nlist] if ladder[-1] != nlist else [])]


def tune_ann(ann: AnnIndex, prepared: PreparedGallery, sample, recall: float, from_storage: bool = False) -> dict:
    """Set ``ann``'s search effort to the smallest of its ladder whose re-ranked top-1 equals the exact top-1 on
    at least ``recall`` of the query rows ``sample`` (held out: not gallery rows); the exact top-1 is
    ``prepared``'s, the re-rank reads ``prepared`` or, with ``from_storage``, the structure's stored rows
    (:func:`ann_search` with no prepared gallery). Returns the measurement
    ({"effort", "recall", "sample_size", "curve": [[effort value, recall], ...], "seconds"}); ValueError naming
    the best recall reached when no effort reaches the target."""
    if not 0.0 < float(recall) <= 1.0:
        raise ValueError(f"recall: expected a fraction in (0, 1], got {recall!r}")
    started = time.perf_counter()
    queries = torch.from_numpy(_unit32(sample, "query sample"))
    exact, _ = search_prepared(queries, prepared, 1, return_scores=False)
    curve = []
    for effort in effort_ladder(ann):
        ann.set_effort(effort)
        top1, _ = ann_search(queries, None if from_storage else prepared, ann, 1)
        reached = recall_of_exact(top1[:, 0].numpy(), exact[:, 0].numpy())
        curve.append([next(iter(effort.values())), reached])
        if reached >= recall:
            return {"effort": dict(effort), "recall": reached, "sample_size": int(queries.shape[0]),
                    "curve": curve, "seconds": time.perf_counter() - started}
    best = max(value for _, value in curve)
    raise ValueError(f"recall {recall}: the {ann.kind} index reached at most {best:.4f} of exact Recall@1 on "
                     f"{queries.shape[0]} held-out queries (efforts {[e for e, _ in curve]}); lower --recall or use "
                     f"--kind ivf / hnsw / flat")
