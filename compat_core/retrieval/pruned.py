"""Pruned exact top-1 search: only the gallery groups that can hold a query's answer are scored, with proven
bounds deciding which.

Used by ``retrieval.nearest_neighbours`` (k = 1, "auto"; spherical k-means groups) and ``retrieval.recall_at_k``
(k = 1, "auto"; the gallery's classes as groups).

Why it is exact. The gallery is split into groups (by class when labels are given, else by spherical k-means
fitted on a sample in the calibrated float product, with the rows far from every centre in one outlier group:
any split is valid, only the speed depends on it).
Each group c has a centre direction m_c = m32 / ||m32|| (m32 the stored fp32 direction; any unit vector is a valid
centre) and an angle a_c >= the largest angle between m_c and any member's unit vector (every member's cosine to
m_c bounded from below by its fp32 evaluation minus input rounding and gamma_D, then arccos rounded outwards). For
unit vectors q, g the angle obeys the triangle inequality on the sphere, angle(q, g) >= angle(q, m_c) -
angle(m_c, g), so
    q.g <= cos(max(0, angle(q, m_c) - a_c)) =: U_c(q)    for every member g of c
(the cap of angular radius a_c around m_c holds the group; the bound is the largest cosine any point of the cap can
have with q). angle(q, m_c) is bounded from below through an fp32 product t = q32 . m32 with
|t - q.m_c| <= E_t (input rounding of both sides and gamma_D accumulation), i.e. angle >= arccos(min(1, t + E_t)).

A lower bound L(q) on the query's best reference score comes from one member per group (the one nearest its
centre) scored in fp32, in the same product as the centre scores: L = max_j fl32(q.g_j) - E_32 (the same
input-rounding + gamma_D bound). A group with U_c(q) < L(q) holds no item that can reach the best score, so it is
skipped; the group holding the answer, and every group holding an item tied with it, has U_c >= the best score
>= L and is searched. A margin of 1e-12 on U covers the fp64 evaluation of the reference scores (~1e-13).

The search of the needed groups (``_search_block``). Queries are sorted by the group of their largest upper bound,
and each block of sorted queries scores the union of the groups its queries need in one fp32 product (a superset
of each query's groups: scoring more items never changes the answer). With S_j the fp32 score of a scored item and
v the largest, |S_j - q.g_j| <= E_32, so every item that can be the top-1 or tie with it has S_j >= v - 2 E_32;
a query with one such candidate is answered by it (every other item scores strictly less), the others score their
candidates in fp64 (the same elementwise product and sum for every pair, so identical rows tie bit for bit) and
take the largest, the lowest gallery index among equal scores.

When it pays ("auto"). A cost model from counts and the calibration, no timing (a timing taken while the machine
is busy could decide either way): before any pass over the whole gallery, groups are fitted on a sample of gallery
rows and their caps measured on the sample (an optimistic estimate: a sample's caps are no wider than the whole
group's); a probe of queries gives the share of the gallery the bounds would leave (``estimate``). Pruning runs
only where its work (the bounds against 2C directions in the grouping's product, the scored share in fp32) is
clearly below the whole-gallery kernel's (every row in the calibrated fastest product, plus its per-item work;
``worth_pruning``). The estimate runs twice where needed: a cheaper one first (half the sample, one k-means step)
declines where even a third of its share would not pay, which ends the decision on unclustered rows (4.5 ms of one
core at 5,000 x 1023 gallery rows, against 10 ms for the full estimate; measured on a 2-core Xeon, the
whole-gallery kernel taking ~0.2 s there). Once the bounds of every query are known, the same model is checked
again with the exact counts, and the whole-gallery kernel takes over if it fails.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from compat_core.hardware.calibration import fastest_matmul, gemm_rates
from compat_core.hardware.torch_settings import ieee_fp32, one_thread, run_chunks
from compat_core.retrieval.groups import (
    UNIT_ROUNDOFF,
    Groups,
    _assignment_from_labels,
    _checked_unit32,
    _group_sums,
    _grouping_dtype,
    _kmeans_count,
    _nearest_members,
    _sample_positions,
    _unit32,
    assign_to_centres,
    group_gallery,
    kmeans_centres,
    product_error,
    unit_deviation,
)
from compat_core.retrieval.int8 import SLACK
from compat_core.retrieval.row_reduction import aligned_rows, same_shape_blocks

__all__ = ["Groups", "group_gallery", "bounds", "needed", "needed_groups", "estimate", "worth_pruning", "Report",
           "search_top1", "PRUNE_MODES"]

# below this many query-gallery pairs the plain kernel is fast enough that planning is not worth it
_MIN_PAIRS = 1 << 24
# the estimate behind "auto" (``estimate``) fits and measures groups on a sample of this many rows per group (class
# or k-means group), k-means in this many steps: measured 0.018 s of one core on 5,000 x 1023 gallery rows (16
# rows and 6 steps, the grouping's own: 0.07 s, ~14 % of the whole-gallery kernel's time on two cores)
_ESTIMATE_SAMPLE_PER_GROUP = 4
_ESTIMATE_ITERATIONS = 3
# a first, cheaper estimate (half the sample, one k-means step, half the probe: ~45 % of the cost) declines
# where even a share this many times below its own would not pay. Its centres are coarser, so on clustered rows
# it reads a larger share than the full estimate (d-Simplex-like rows: 0.154 against 0.047 at 20k x 5k x 1023,
# 0.060 against 0.009 at 50k x 10k), and on unclustered rows a smaller one (a smaller sample measures narrower
# caps: 0.53-0.82 against 0.82-0.99); 3 leaves the declines of both sides ~1.7x clear of the cost model's
# threshold (a searched share of ~0.09-0.11 of the gallery with this machine's calibration)
_EARLY_SAMPLE_PER_GROUP = 2
_EARLY_ITERATIONS = 1
_EARLY_PROBE_QUERIES = 128
_EARLY_FACTOR = 3.0
_FP64_MARGIN = 1e-12         # covers the fp64 evaluation of the reference scores (|error| <= gamma_D(fp64))
_THRESHOLD_MARGIN = 1e-6     # covers the fp32 evaluation of the skip threshold (``needed``)
_PROBE_QUERIES = 256          # queries whose bounds estimate the searched share
# cost model, in fp32 products of one query with one gallery row (only the speed depends on these; measured on the
# benchmark's d-Simplex-like and random rows, 20k x 5k x 1023, on one core): a sorted block of queries scores the
# union of its queries' groups, about this many times the items one query needs (2.4 measured)
_UNION_FACTOR = 3.0
_QUERY_OVERHEAD_ROWS = 400    # per query: normalising, thresholds, sorting, gathers, the fp64 finish
_WHOLE_PER_ITEM = 0.4         # the whole-gallery kernel's work per gallery item beyond its candidate product
                              # (selection, block maxima, re-scoring; measured ~0.5)
_PRUNE_GAIN = 1.5             # pruning runs where its estimated work is this many times below the whole kernel's
_BOUND_CHUNK = 2048           # query rows per bound block (fp32 (n, D) rows, (n, 2C) scores)
_SEARCH_BLOCK = 256           # sorted query rows per candidate product
_PAIR_BLOCK = 1 << 20         # fp64 elements per gathered block of candidate pairs
PRUNE_MODES = ("auto", "always", "never")


def bounds(q32: torch.Tensor, groups: Groups):
    """(t (n, C), e_t, lower (n,) fp64) for fp32 unit query rows ``q32`` (n, D) from ``_unit32``: the centre scores
    t with |t - q.m_c| <= e_t, and the lower bound L(q) on the best reference score from each group's member
    nearest its centre (module docstring). One product, in ``groups.half`` when set (the calibrated faster
    float product; its rounding is in the error terms), else in fp32."""
    dim = q32.shape[1]
    dev_q = unit_deviation(dim)                  # ||q32 - q||, q the fp64 unit row
    if groups.half is None:
        unit, scores = 0.0, (q32 @ groups.directions.t()).float()
    else:
        unit, scores = UNIT_ROUNDOFF[groups.half], (q32.to(groups.half) @ groups.directions_half).float()
    e_t = product_error(dim, dev_q, groups.centre_dev, unit)
    lower = scores[:, groups.count:].max(dim=1).values.double() - product_error(dim, dev_q, unit_deviation(dim), unit)
    return scores[:, :groups.count], e_t, lower


def needed(t: torch.Tensor, e_t: float, lower: torch.Tensor, groups: Groups) -> torch.Tensor:
    """(n, C) bool: the groups a query must search, from ``bounds``. A member g of group c reaching the best score
    has angle(q, g) <= lambda = arccos(L), so angle(q, m_c) <= a_c + lambda and, where a_c + lambda < pi,
    q.m_c >= cos(a_c + lambda) = cos a_c L - sin a_c sqrt(1 - L^2): a group with t + e_t below that holds no such
    member. Evaluated in fp32 as one product of (n, 2) by (2, C), its rounding (< 1e-6 on values within [-1, 1])
    inside the margin; lambda is rounded up (a larger angle, a smaller threshold); rows and groups with
    a_c + lambda near pi or above are always searched."""
    lam = torch.arccos((lower - _FP64_MARGIN).clamp(-1.0, 1.0)) * (1.0 + 1e-12) + 1e-15
    per_query = torch.stack([torch.cos(lam), -torch.sin(lam)], dim=1).float()
    per_group = torch.stack([torch.cos(groups.angles), torch.sin(groups.angles)]).float()
    threshold = per_query @ per_group
    need = t >= threshold.sub_(e_t + _THRESHOLD_MARGIN)
    wrap = math.pi - _THRESHOLD_MARGIN
    if float(lam.max()) + float(groups.angles.max()) >= wrap:
        need |= (lam.unsqueeze(1) + groups.angles.unsqueeze(0)) >= wrap
    return need


@dataclass
class Estimate:
    """What a sample of the gallery and a probe of queries say about pruning: the share of the gallery searched
    per query and the groups searched per query (both optimistic: caps measured on a sample are no wider than the
    whole group's), and the group count."""

    share: float
    groups_per_query: float
    groups: int


def estimate(query: torch.Tensor, gallery: torch.Tensor, labels=None, per_group: int = _ESTIMATE_SAMPLE_PER_GROUP,
             iterations: int = _ESTIMATE_ITERATIONS, probe: int = _PROBE_QUERIES) -> Estimate:
    """The searched share of the gallery, estimated without a pass over it: groups (k-means centres fitted in
    ``iterations`` steps on a sample of ``per_group`` rows per group, or the classes of ``labels``) with their caps
    and nearest members measured on that sample, and the bounds (without error terms: an estimate) of ``probe``
    queries spread over the query rows. A small sample measures narrower caps than the whole
    groups have, so the estimate errs towards pruning; the exact counts are checked later (``_pruned``)."""
    size, device = gallery.shape[0], gallery.device
    dtype = _grouping_dtype(device)
    if labels is None:
        count = _kmeans_count(size)
        pick = _sample_positions(size, count * per_group, device)
        sample = _checked_unit32(gallery, pick, "gallery")
        centres = kmeans_centres(sample.to(dtype), count, iterations)
        assign = assign_to_centres(sample, centres)
        groups = count + 1
        scale = torch.full((groups,), size / sample.shape[0], dtype=torch.float64)
        sizes = torch.bincount(assign.cpu(), minlength=groups).double() * scale
    else:
        codes = torch.as_tensor(_assignment_from_labels(np.asarray(labels)))
        groups = int(codes.max()) + 1
        sizes = torch.bincount(codes, minlength=groups).double()
        pick = _sample_positions(size, per_group * groups, device)
        sample = _checked_unit32(gallery, pick, "gallery")
        assign = codes.to(device)[pick]
    sums = _group_sums(sample, assign, groups, dtype)
    directions = sums / torch.linalg.vector_norm(sums, dim=1, keepdim=True).clamp(min=1e-30)
    cosines = (sample * directions[assign]).sum(dim=1)
    low = torch.full((groups,), math.inf, dtype=torch.float32, device=device)
    low = low.scatter_reduce(0, assign, cosines, reduce="amin")
    # groups without a sampled row (small classes): no cap, always searched
    angles = torch.where(torch.isfinite(low), torch.arccos(low.clamp(-1.0, 1.0)), torch.full_like(low, math.pi))
    nearest = _nearest_members(cosines, assign, groups)
    present = nearest < sample.shape[0]
    probe_rows = torch.linspace(0, query.shape[0] - 1, min(query.shape[0], probe)).round().long()
    probe = _checked_unit32(query, probe_rows.to(device), "query")
    scores = probe @ torch.cat([directions, sample[nearest[present]]]).t()
    phi = torch.arccos(scores[:, :groups].clamp(-1.0, 1.0))
    upper = torch.cos((phi - angles.unsqueeze(0)).clamp(min=0.0))
    lower = scores[:, groups:].max(dim=1).values
    need = (upper >= lower.unsqueeze(1)).double().cpu()
    return Estimate(float((need @ sizes).mean()) / size, float(need[:, sizes > 0].sum(dim=1).mean()),
                    int((sizes > 0).sum()))


def worth_pruning(share: float, groups: int, size: int, device: torch.device) -> bool:
    """Whether a pruned search that scores ``share`` of the ``size``-row gallery per query against ``groups``
    groups costs clearly less than the whole-gallery kernel. Work per query in fp32 products of one query with
    one gallery row: pruned, the bounds (2 x ``groups`` directions in the grouping's product) plus the union of a
    sorted block's groups plus a fixed part; whole, every gallery row in the calibrated fastest product
    (``compat_core.hardware.calibration``) plus its per-item work. A count and a calibration, no timing, so the load of the
    machine at the moment of the call does not decide it."""
    rates = gemm_rates(device)

    def speedup(name: str) -> float:                  # a product's rate over fp32's (1 without a calibration)
        return max(1.0, rates[name] / rates["fp32"]) if rates and rates.get("fp32") and name in rates else 1.0
    whole = size * (1.0 / speedup(fastest_matmul(device)) + _WHOLE_PER_ITEM)
    bounds_speedup = speedup({torch.bfloat16: "bf16", torch.float16: "fp16"}.get(_grouping_dtype(device), "fp32"))
    pruned = 2.0 * groups / bounds_speedup + _UNION_FACTOR * share * size + _QUERY_OVERHEAD_ROWS
    return pruned * _PRUNE_GAIN <= whole


@dataclass
class Report:
    """What a search did: ``pruned`` (False: the whole gallery in one kernel call), the groups and gallery items
    searched per query (means), the number of groups, and the estimate behind the decision."""

    pruned: bool
    groups: int
    groups_per_query: float
    items_per_query: float
    estimated_share: float


def search_top1(query: torch.Tensor, gallery: torch.Tensor, search, labels=None, prune: str = "auto",
                want_scores: bool = False):
    """Exact top-1 gallery row of every query row (cosine; lowest index among exact ties), scoring only the
    gallery groups whose bound reaches the query's best lower bound.

    ``search(query_rows, gallery, want_scores, whole=True)``: the exact kernel over the whole gallery, returning
    (indices (n, 1), fp64 scores (n, 1) or None without ``want_scores``), run where pruning does not pay.
    ``labels`` (Ng,): group by class; None: spherical k-means groups. ``prune``: "auto", "always" or "never" (one
    kernel call over the whole gallery). "auto" prunes where ``estimate`` and ``worth_pruning`` say it pays, and
    checks the model again with the exact counts once every query's bounds are known. Returns (indices (Nq,)
    int64, fp64 cosine scores (Nq,) or None without ``want_scores``, ``Report``)."""
    if prune not in PRUNE_MODES:
        raise ValueError(f"prune: expected one of {PRUNE_MODES}, got {prune!r}")
    size = gallery.shape[0]

    def whole_search(report: Report):
        index, score = search(query, gallery, want_scores, True)
        return index[:, 0], None if score is None else score[:, 0], report

    if prune == "never" or (prune == "auto" and query.shape[0] * size < _MIN_PAIRS):
        return whole_search(Report(False, 1, 1.0, float(size), 1.0))
    with torch.inference_mode(), ieee_fp32():
        guess = None
        if prune == "auto":
            prune_pays, guess = _decide(query, gallery, labels)
            if not prune_pays:
                return whole_search(Report(False, guess.groups, float(guess.groups), float(size), guess.share))
        groups, q32 = _grouped_and_normalised(query, gallery, labels)
        share = 1.0 if guess is None else guess.share
        if groups.count < 2:
            return whole_search(Report(False, groups.count, 1.0, float(size), share))
        found = _pruned(query, gallery, groups, share, want_scores, check=prune == "auto", q32=q32)
        if found is None:
            return whole_search(Report(False, groups.count, float(groups.count), float(size), share))
        return found


def _decide(query: torch.Tensor, gallery: torch.Tensor, labels) -> tuple[bool, Estimate]:
    """(whether "auto" prunes, the estimate that decided): a cheap first estimate declines where even a third of
    its share would not pay (unclustered rows end there, ~45 % of the full estimate's cost); otherwise the full
    estimate and the cost model decide (``estimate``, ``worth_pruning``). Many small operations: on one thread,
    none waits for a descheduled worker."""
    size, device = gallery.shape[0], gallery.device

    def pays(found: Estimate, factor: float = 1.0) -> bool:
        return found.groups >= 2 and worth_pruning(found.share / factor, found.groups, size, device)
    with one_thread():
        early = estimate(query, gallery, labels, _EARLY_SAMPLE_PER_GROUP, _EARLY_ITERATIONS, _EARLY_PROBE_QUERIES)
        if not pays(early, _EARLY_FACTOR):
            return False, early
        guess = estimate(query, gallery, labels)
    return pays(guess), guess


def needed_groups(query: torch.Tensor, groups: Groups) -> torch.Tensor:
    """(Nq, C) bool: the groups each query row must search (``bounds`` and ``needed``)."""
    return _query_bounds(query, groups)[1]


def _grouped_and_normalised(query: torch.Tensor, gallery: torch.Tensor, labels):
    """(``group_gallery(gallery, labels)``, the queries' ``_unit32`` rows): the grouping (many small operations,
    on one thread: none waits for a descheduled worker) and the queries' normalisation (blocks of
    ``_BOUND_CHUNK`` rows) as independent pieces of work side by side (``run_chunks``)."""
    count = query.shape[0]
    q32 = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    grouped = []

    def piece(start: int, stop: int) -> None:
        if start < 0:
            with one_thread():
                grouped.append(group_gallery(gallery, labels))
        else:
            q32[start:stop] = _unit32(query[start:stop], "query", start)
    run_chunks(piece, [(-1, -1)] + [(start, min(count, start + _BOUND_CHUNK))
                                    for start in range(0, count, _BOUND_CHUNK)], query.device)
    return grouped[0], q32


def _query_bounds(query: torch.Tensor, groups: Groups, q32: torch.Tensor | None = None):
    """(fp32 unit rows (Nq, D), the groups each must search (Nq, C) bool, its nearest group (Nq,) by centre
    score) of every query row, in blocks of ``_BOUND_CHUNK`` rows as independent pieces of work (``run_chunks``).
    ``q32``: the unit rows, already computed."""
    count, dim = query.shape
    device = query.device
    given = q32 is not None
    q32 = q32 if given else torch.empty((count, dim), dtype=torch.float32, device=device)
    need = torch.empty((count, groups.count), dtype=torch.bool, device=device)
    nearest = torch.empty(count, dtype=torch.long, device=device)

    def block(start: int, stop: int) -> None:
        if given:
            rows = q32[start:stop]
        else:
            rows = _unit32(query[start:stop], "query", start)
            q32[start:stop] = rows
        t, e_t, lower = bounds(rows, groups)
        need[start:stop] = needed(t, e_t, lower, groups)
        nearest[start:stop] = t.argmax(dim=1)
    run_chunks(block, [(start, min(count, start + _BOUND_CHUNK)) for start in range(0, count, _BOUND_CHUNK)],
               device)
    return q32, need, nearest


def _pruned(query: torch.Tensor, gallery: torch.Tensor, groups: Groups, share: float, want_scores: bool, check: bool,
            q32: torch.Tensor | None = None):
    """``search_top1`` with pruning: the bounds of every query (blocks of ``_BOUND_CHUNK`` rows as independent
    pieces of work, ``run_chunks``), then blocks of ``_SEARCH_BLOCK`` queries sorted by their nearest group
    (``_search_block``). ``check``: return None (the caller searches the whole gallery) when the exact counts fail
    ``worth_pruning``. ``q32``: the queries' unit rows, already computed."""
    count, dim = query.shape
    device = query.device
    q32, need, nearest = _query_bounds(query, groups, q32)
    sizes = groups.sizes().to(device)
    report = Report(True, groups.count, float(need.sum(dim=1).double().mean()),
                    float((need.double() @ sizes).mean()), share)
    size = groups.unit32.shape[0]
    if check and not worth_pruning(report.items_per_query / size, groups.count, size, device):
        return None
    # queries with the same nearest group need about the same groups: sorted, a block's union stays small
    order = torch.sort(nearest, stable=True).indices
    index = torch.full((count,), -1, dtype=torch.long, device=device)
    score = torch.full((count,), math.nan, dtype=torch.float64, device=device) if want_scores else None
    error = product_error(dim, unit_deviation(dim), unit_deviation(dim))
    run_chunks(lambda start, stop: _search_block(order[start:stop], query, gallery, q32, need, groups, error, index,
                                                    score),
               [(start, min(count, start + _SEARCH_BLOCK)) for start in range(0, count, _SEARCH_BLOCK)], device)
    return index, score, report


def _search_block(rows: torch.Tensor, query: torch.Tensor, gallery: torch.Tensor, q32: torch.Tensor,
                  need: torch.Tensor, groups: Groups, error: float, index: torch.Tensor,
                  score: torch.Tensor | None) -> None:
    """Exact top-1 of the query rows ``rows`` (writes ``index`` and ``score`` there): one fp32 product against the
    members of every group some of them need, the candidates within 2 ``error`` of each row's best fp32 score,
    and the fp64 finish where a row has several (or scores are asked for)."""
    wanted = need[rows].any(dim=0)
    members = groups.order[torch.nonzero(wanted[groups.group_at]).squeeze(1)]
    s32 = q32[rows] @ groups.unit32[members].t()
    best = s32.max(dim=1)
    # every item that can be the top-1 or tie with it in fp64: S >= v - 2E (the fp64 reference scores' own
    # rounding in the margin), compared in fp32 against the largest fp32 value at or below the limit
    limit = best.values.double() - 2.0 * error * SLACK - _FP64_MARGIN
    limit32 = limit.float()
    below = torch.nextafter(limit32, torch.full_like(limit32, -math.inf))
    limit32 = torch.where(limit32.double() > limit, below, limit32)
    candidate = s32 >= limit32.unsqueeze(1)
    single = candidate.sum(dim=1) == 1
    if score is None and bool(single.any()):
        index[rows[single]] = members[best.indices[single]]
        rows, candidate = rows[~single], candidate[~single]
    if rows.numel() == 0:
        return
    pair_row, pair_column = torch.nonzero(candidate, as_tuple=True)
    queries64 = _fp64_rows(query[rows])
    scores64 = torch.empty(pair_row.numel(), dtype=torch.float64, device=query.device)
    step = max(1, _PAIR_BLOCK // query.shape[1])
    for start in same_shape_blocks(pair_row.numel(), step, query.device):
        part = slice(start, start + step)
        # the same elementwise product and sum for every pair (blocks of one shape, aligned rows): identical rows
        # score bit for bit alike
        scores64[part] = aligned_rows(_fp64_rows(gallery[members[pair_column[part]]])
                                      * queries64[pair_row[part]]).sum(dim=1)
    top = torch.full((rows.numel(),), -math.inf, dtype=torch.float64, device=query.device)
    top = top.scatter_reduce(0, pair_row, scores64, reduce="amax")
    at_top = scores64 == top[pair_row]
    winner = torch.full((rows.numel(),), groups.unit32.shape[0], dtype=torch.long, device=query.device)
    winner = winner.scatter_reduce(0, pair_row[at_top], members[pair_column[at_top]], reduce="amin")
    index[rows] = winner
    if score is not None:
        score[rows] = top


def _fp64_rows(rows: torch.Tensor) -> torch.Tensor:
    """fp64 unit rows, as the whole-gallery kernel forms them: rows / their fp64 norm (one rounding each)."""
    return rows.double() * (1.0 / torch.linalg.vector_norm(aligned_rows(rows), dim=1,
                                                           dtype=torch.float64)).unsqueeze(1)
