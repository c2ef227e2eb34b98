"""Pruned exact top-1 search: the exact kernel (``compat_core.retrieval``) run only on the gallery groups that can
hold a query's answer, with proven bounds deciding which.

Used by ``retrieval.nearest_neighbours`` (k = 1, "auto"; spherical k-means groups) and ``retrieval.recall_at_k``
(k = 1, "auto"; the gallery's classes as groups).

Why it is exact. The gallery is split into groups (by class when labels are given, else by spherical k-means
fitted on a sample in the calibrated float product, with the rows far from every centre in one outlier group:
any split is valid, only the speed depends on it).
Each group c has a centre direction m_c = m32 / ||m32|| (m32 the stored fp32 direction; any unit vector is a valid
centre) and an angle a_c >= the largest angle between m_c and any member's unit vector (every member's cosine to
m_c bounded from below by its fp32 evaluation minus input rounding and gamma_D, then arccos rounded outwards). For unit vectors q, g the angle
obeys the triangle inequality on the sphere, angle(q, g) >= angle(q, m_c) - angle(m_c, g), so
    q.g <= cos(max(0, angle(q, m_c) - a_c)) =: U_c(q)    for every member g of c
(the cap of angular radius a_c around m_c holds the group; the bound is the largest cosine any point of the cap can
have with q). angle(q, m_c) is bounded from below through an fp32 product t = q32 . m32 with
|t - q.m_c| <= E_t (input rounding of both sides and gamma_D accumulation), i.e. angle >= arccos(min(1, t + E_t)).

A lower bound L(q) on the query's best reference score comes from one member per group (the one nearest its
centre) scored in fp32, in the same product as the centre scores: L = max_j fl32(q.g_j) - E_32 (the same
input-rounding + gamma_D bound). A group with U_c(q) < L(q) holds no item that can reach the best score, so it is
skipped; every other group of the query is searched by the exact kernel, which returns that group's top-1 by fp64 score with the lowest index among ties
(members keep ascending gallery order inside a group). The winners of a query's groups are merged by (fp64 score
descending, gallery index ascending). The fp64 scores are the kernel's per-pair evaluation (the same
elementwise product and sum for every pair), so a pair scores bit for bit the same whichever group call computes
it, and exact ties across groups go to the lowest gallery index, as in one call over the whole gallery. A margin
of 1e-12 on U covers the fp64 evaluation of the reference scores themselves (|error| <= gamma_D(fp64) ~ 1e-13).

When it pays ("auto"): on a probe of the first queries the bounds above give the share of the gallery each query
would search (``plan``); where that share (plus a per-group overhead) is clearly below the whole gallery, both
searches are timed on the first queries and the rest runs the way measured faster. The products are not all of the
cost: per query, the kernel also normalises, bounds, selects and re-scores, and a group call has a fixed cost, so
on CPUs with fast half-precision products a small share of the gallery need not be faster. No CPU flag enters:
the decision is a count over the data at hand, then a measurement.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from compat_core.calibration import fastest_matmul
from compat_core.retrieval_int8 import SLACK, U32, gamma
from compat_core.torch_settings import one_thread, run_chunks

# probe size for the decision, and the share of the gallery (per query, averaged) above which pruning is not used
_PROBE_QUERIES = 512
_MAX_SEARCHED_SHARE = 0.45
# each group call costs about as much as scanning this many gallery rows per query of the call (set-up of the
# group's candidate stage, query gathering and the merge): measured order of magnitude, used only in the estimate
_GROUP_OVERHEAD_ROWS = 8
# below this many query-gallery pairs the plain kernel is fast enough that planning is not worth it
_MIN_PAIRS = 1 << 24
_KMEANS_ITERATIONS = 6
_KMEANS_SEED = 20261125
_MIN_GROUP = 16               # k-means groups: about twice this many members (fewer groups, wider caps: on
                              # d-Simplex-like rows of 100 classes, Ng / 64 groups left 57 % of a 5,000-row
                              # gallery to search per query, Ng / 32 left 4 %)
_KMEANS_SAMPLE_PER_GROUP = 16  # k-means centres are fitted on a sample of this many rows per group
# a row whose cosine to its nearest centre is this many median deviations (plus the margin) below the median row's
# joins the outlier group (only the speed depends on it)
_OUTLIER_SPREADS = 6.0
_OUTLIER_MARGIN = 0.05
_MAX_GROUPS = 256
_FP64_MARGIN = 1e-12


@dataclass
class Groups:
    """The gallery split into groups: members of group c are ``order[starts[c]:starts[c + 1]]`` (ascending),
    ``directions`` (2C, D) fp32: the centres m32_c (unit up to ``centre_dev`` = a bound on | ||m32|| - 1 |; the
    reference centre is m32 / ||m32||), then the unit row of each group's member nearest its centre (for the
    lower bound), so that one product gives both; ``angles`` (C,) fp64 upper bounds on each member's angle to
    its reference centre (radians)."""

    order: torch.Tensor
    starts: list[int]
    directions: torch.Tensor
    angles: torch.Tensor
    centre_dev: float

    @property
    def count(self) -> int:
        return len(self.starts) - 1

    @property
    def centres(self) -> torch.Tensor:
        return self.directions[:self.count]

    def sizes(self) -> torch.Tensor:
        return torch.tensor(np.diff(self.starts), dtype=torch.float64)

    def members(self, group: int) -> torch.Tensor:
        return self.order[self.starts[group]:self.starts[group + 1]]


def _assignment_from_labels(labels: np.ndarray) -> np.ndarray:
    _, inverse = np.unique(labels, return_inverse=True)
    return inverse.reshape(-1)


def kmeans_assignment(unit32: torch.Tensor, groups: int, iterations: int = _KMEANS_ITERATIONS,
                      seed: int = _KMEANS_SEED, dtype: torch.dtype = torch.float32) -> np.ndarray:
    """Spherical k-means of unit fp32 rows (n, D) into ``groups`` groups (seeded, deterministic): centres fitted on
    a sample of at most ``_KMEANS_SAMPLE_PER_GROUP`` rows per group, then every row assigned to its nearest centre,
    the products in ``dtype``. Only the speed of the pruned search depends on its quality, never its result (any
    assignment is a valid grouping: the bounds are measured afterwards), so a half-precision product will do."""
    count = unit32.shape[0]
    generator = torch.Generator().manual_seed(seed)
    shuffled = torch.randperm(count, generator=generator).to(unit32.device)
    sample = unit32[shuffled[:groups * _KMEANS_SAMPLE_PER_GROUP]].to(dtype)
    centres = sample[:groups].clone()
    columns = torch.arange(sample.shape[0], device=unit32.device)
    for _ in range(iterations):
        assign = (sample @ centres.t()).argmax(dim=1)
        # the groups' sums as one product with their (C, n) membership matrix (index_add_ measured ~10x slower)
        membership = torch.zeros((groups, sample.shape[0]), dtype=dtype, device=unit32.device)
        membership[assign, columns] = 1.0
        sums = membership @ sample
        norms = torch.linalg.vector_norm(sums.float(), dim=1, keepdim=True)
        centres = torch.where(norms > 0, sums.float() / norms.clamp(min=1e-30), centres.float()).to(dtype)
    nearest = (unit32.to(dtype) @ centres.t()).max(dim=1)
    assign = nearest.indices
    # rows far from every centre (outliers of the clusters) form one group of their own: in a cluster's group
    # one of them would widen the group's cap for every query, in their own group only their few rows are
    # searched by the queries that need them
    cosine = nearest.values.float()
    median = cosine.median()
    spread = (cosine - median).abs().median()
    outliers = cosine < median - _OUTLIER_SPREADS * spread - _OUTLIER_MARGIN
    if bool(outliers.any()):
        assign = torch.where(outliers, torch.full_like(assign, groups), assign)
    return assign.cpu().numpy()


def _grouping_dtype(device: torch.device) -> torch.dtype:
    """The float product calibrated fastest on ``device`` (bf16, fp16 or fp32) for the k-means products."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(fastest_matmul(device, exclude=("int8",)),
                                                               torch.float32)


def group_gallery(gallery: torch.Tensor, labels=None) -> Groups:
    """Groups of ``gallery`` (Ng, D) rows: one per distinct label of ``labels`` (Ng,), or spherical k-means groups
    (about Ng / 32, at most 256) without labels; centres, angles and the members nearest each centre.

    All in fp32 passes with proven error bounds (an fp64 pass over the gallery cost ~10x more). The reference
    centre of a group is m = m32 / ||m32|| for the stored fp32 direction m32 (any unit vector is a valid centre:
    the angle is measured against it), and a member's cosine to it is bounded from below by its fp32 evaluation
    minus the input rounding of both sides and gamma_D."""
    unit32 = _unit32(gallery, "gallery")
    dim = gallery.shape[1]
    dtype = _grouping_dtype(gallery.device)
    if labels is not None:
        assign = _assignment_from_labels(np.asarray(labels))
    else:
        count = int(min(_MAX_GROUPS, max(1, gallery.shape[0] // (2 * _MIN_GROUP))))
        assign = kmeans_assignment(unit32, count, dtype=dtype)
    sizes = np.bincount(assign)
    present = np.nonzero(sizes)[0]
    remap = np.full(sizes.shape[0], -1)
    remap[present] = np.arange(present.shape[0])
    assign_t = torch.as_tensor(remap[assign], device=gallery.device)
    order = torch.sort(assign_t, stable=True).indices            # by group, ascending gallery index inside
    sizes = sizes[present]
    starts = [0] + np.cumsum(sizes).tolist()
    groups = len(sizes)
    # class sums as one product with the (C, Ng) membership matrix: a matrix product runs near the machine's
    # peak, index_add_ measured ~5x slower; in the fastest float product, since any unit vector is a valid centre
    membership = torch.zeros((groups, gallery.shape[0]), dtype=dtype, device=gallery.device)
    membership[assign_t, torch.arange(gallery.shape[0], device=gallery.device)] = 1.0
    sums = (membership @ unit32.to(dtype)).float()
    del membership
    norms = torch.linalg.vector_norm(sums, dim=1, keepdim=True)
    # a group whose unit rows sum to ~0 has no mean direction: its first member is taken as the centre
    first = order[torch.as_tensor(starts[:-1], device=gallery.device)]
    centres32 = torch.where(norms > 1e-3, sums / norms.clamp(min=1e-30), unit32[first]).contiguous()
    # ||m32 - m|| = | ||m32|| - 1 | (fp64 norm of a few rows, ~1e-16 relative)
    centre_dev = float((torch.linalg.vector_norm(centres32.double(), dim=1) - 1.0).abs().max()) + 1e-15
    g = gamma(dim, U32)
    dev_g = unit_deviation(dim)
    norm_m = 1.0 + centre_dev
    # |fl(g32 . m32) - g.m| <= ||g32 - g|| ||m32|| + ||g|| ||m32 - m|| + gamma_D ||g32|| ||m32||
    e_c = (dev_g * norm_m + centre_dev + g * (1.0 + dev_g) * norm_m) * SLACK
    cosines = (unit32 * centres32[assign_t]).sum(dim=1)          # each row with its own centre; any order: gamma_D
    low = torch.full((groups,), math.inf, dtype=torch.float32, device=gallery.device)
    low = low.scatter_reduce(0, assign_t, cosines, reduce="amin").double() - e_c
    # a smaller cosine is a larger (safer) angle; arccos is accurate to an ulp or two of its result
    angles = torch.arccos(low.clamp(-1.0, 1.0)) * (1.0 + 1e-12) + 1e-15
    # each group's member nearest its centre (largest cosine; the lowest index among equal ones)
    best = torch.full((groups,), -math.inf, dtype=torch.float32, device=gallery.device)
    best = best.scatter_reduce(0, assign_t, cosines, reduce="amax")
    is_best = cosines == best[assign_t]
    nearest = torch.full((groups,), gallery.shape[0], dtype=torch.long, device=gallery.device)
    nearest = nearest.scatter_reduce(0, assign_t[is_best], torch.nonzero(is_best).squeeze(1), reduce="amin")
    return Groups(order, starts, torch.cat([centres32, unit32[nearest]]).contiguous(), angles, centre_dev)


def unit_deviation(dim: int) -> float:
    """Bound on ||x32 - x|| for ``_unit32``'s fp32 unit row x32 of a row whose fp64 unit row is x: the fp32 norm
    errs by <= gamma_D / 2 + u relative, its inverse and the product round once more each."""
    return (0.5 * gamma(dim, U32) + 4.0 * U32) * SLACK * (1.0 + 1e-6)


def _unit32(rows: torch.Tensor, name: str = "query", offset: int = 0) -> torch.Tensor:
    """fp32 unit rows from an fp32 norm pass (within ``unit_deviation`` of the fp64 unit rows; an fp64 pass cost
    ~5x more); rows whose fp32 norm is not in [2^-60, 2^60] (where squares under- or overflow) are normalised in
    fp64; rows without a direction are refused, naming ``name`` and the row (``offset``: index of the first row)."""
    rows = rows.float()
    norms = torch.linalg.vector_norm(rows, dim=1)
    doubtful = ~((norms >= 2.0 ** -60) & (norms <= 2.0 ** 60))
    if bool(doubtful.any()):
        norms64 = torch.linalg.vector_norm(rows.double(), dim=1)
        bad = ~(norms64 > 0) | ~torch.isfinite(norms64)
        if bool(bad.any()):
            first = offset + int(torch.nonzero(bad)[0, 0])
            raise ValueError(f"{name}: row {first} has zero or non-finite norm; cosine similarity is undefined")
        return (rows.double() / norms64[:, None]).float()
    return rows * (1.0 / norms)[:, None]


def bounds(q32: torch.Tensor, groups: Groups):
    """(upper (n, C), lower (n,)) fp64 for fp32 unit query rows ``q32`` (n, D) from ``_unit32``: U_c(q) for every
    group and the lower bound L(q) from each group's member nearest its centre (module docstring)."""
    dim = q32.shape[1]
    g = gamma(dim, U32)
    dev_q = unit_deviation(dim)                  # ||q32 - q||, q the fp64 unit row; ||q32|| <= 1 + dev_q
    norm_q = 1.0 + dev_q
    # |t - q.m| <= ||q32 - q|| ||m32|| + ||q|| ||m32 - m|| + gamma_D ||q32|| ||m32||
    norm_m = 1.0 + groups.centre_dev
    e_t = (dev_q * norm_m + groups.centre_dev + g * norm_q * norm_m) * SLACK
    scores = q32 @ groups.directions.t()                  # centres, then nearest members: one product
    t = scores[:, :groups.count].double()
    phi = torch.arccos((t + e_t).clamp(-1.0, 1.0)) * (1.0 - 1e-12)
    upper = torch.cos((phi - groups.angles.unsqueeze(0)).clamp(min=0.0)) + _FP64_MARGIN
    # the same bound for an fp32 score of two fp32 unit rows (both within dev_q of their references)
    e_32 = (2.0 * dev_q * norm_q + g * norm_q * norm_q) * SLACK
    lower = scores[:, groups.count:].max(dim=1).values.double() - e_32
    return upper, lower


def needed(upper: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    """(n, C) bool: the groups a query must search (upper bound reaching its lower bound, margins included)."""
    return upper >= (lower - _FP64_MARGIN).unsqueeze(1)


@dataclass
class Plan:
    """The decision for one search: ``prune`` and the probe's estimated share of the gallery searched per query."""

    prune: bool
    share: float
    groups_per_query: float


def plan(query: torch.Tensor, groups: Groups, gallery_size: int) -> Plan:
    """Decide from the bounds of a probe of queries (the first ``_PROBE_QUERIES``) whether pruning pays: the
    searched share of the gallery plus a per-group overhead must stay under ``_MAX_SEARCHED_SHARE``."""
    probe = _unit32(query[:_PROBE_QUERIES])
    upper, lower = bounds(probe, groups)
    need = needed(upper, lower)
    sizes = groups.sizes().to(need.device)
    share = float((need.double() * sizes).sum(dim=1).mean()) / gallery_size
    per_query = float(need.double().sum(dim=1).mean())
    # each group call costs roughly _GROUP_OVERHEAD_ROWS rows per query it serves
    cost = share + per_query * _GROUP_OVERHEAD_ROWS / gallery_size
    return Plan(cost <= _MAX_SEARCHED_SHARE, share, per_query)


@dataclass
class Report:
    """What a search did: ``pruned`` (False: the whole gallery in one kernel call), the groups and gallery items
    searched per query (means), the number of groups, and the probe's estimate behind the decision."""

    pruned: bool
    groups: int
    groups_per_query: float
    items_per_query: float
    estimated_share: float


_TRIAL_QUERIES = 2048         # "auto": queries timed both ways before the rest runs the faster way
_TRIAL_QUERIES_PER_GROUP = 32  # ... or this many per group, up to a quarter of the queries
_TRIAL_GAIN = 1.1             # pruning must measure this much faster than the whole-gallery search
_BOUND_CHUNK = 2048            # query rows per bound block (fp32 (n, D) rows, (n, 2C) scores)
PRUNE_MODES = ("auto", "always", "never")


def search_top1(query: torch.Tensor, gallery: torch.Tensor, search, labels=None, prune: str = "auto",
                want_scores: bool = False):
    """Exact top-1 gallery row of every query row (cosine; lowest index among exact ties), searching only the
    gallery groups whose bound reaches the query's best lower bound.

    ``search(query_rows, gallery_rows, want_scores, whole=False)``: the exact kernel, returning (indices (n, 1),
    fp64 scores (n, 1) or None without ``want_scores``); ``whole``: the call searches the whole gallery.
    ``labels`` (Ng,): group by class; None: spherical k-means groups. ``prune``: "auto", "always" or "never" (one
    kernel call over the whole gallery). "auto" first estimates from the bounds of a probe of queries
    (``plan``); where that promises a gain it times both searches on the first queries (``_TRIAL_QUERIES``, or
    ``_TRIAL_QUERIES_PER_GROUP`` per group up to a quarter of the queries; their answers are kept: both are
    exact) and runs the rest the faster way, pruning only when it measured at least ``_TRIAL_GAIN`` times
    faster. Returns (indices (Nq,) int64, fp64 cosine scores (Nq,) or None without ``want_scores``,
    ``Report``)."""
    if prune not in PRUNE_MODES:
        raise ValueError(f"prune: expected one of {PRUNE_MODES}, got {prune!r}")
    size = gallery.shape[0]

    def whole_search(rows: torch.Tensor):
        index, score = search(rows, gallery, want_scores, True)
        return index[:, 0], None if score is None else score[:, 0]

    whole = Report(False, 1, 1.0, float(size), 1.0)
    if prune == "never" or (prune == "auto" and query.shape[0] * size < _MIN_PAIRS):
        return (*whole_search(query), whole)
    with torch.inference_mode():
        # many small operations: on one thread they wait for no descheduled worker (on a loaded 2-core machine
        # measured 0.24 s against 0.96-1.8 s on two threads for 5,000 x 1023 rows)
        with one_thread():
            groups = group_gallery(gallery, labels)
            if groups.count >= 2:
                decision = plan(query, groups, size)
        if groups.count < 2:
            return (*whole_search(query), whole)
        declined = Report(False, groups.count, float(groups.count), float(size), decision.share)
        if prune == "auto" and not decision.prune:
            return (*whole_search(query), declined)
        if prune == "always" or query.shape[0] < 2 * _TRIAL_QUERIES:
            return _pruned(query, gallery, groups, search, decision.share, want_scores)
        # each group call has a fixed cost, so a trial of few queries per group favours the whole gallery: the
        # trial grows with the group count (up to a quarter of the queries); its halves run whole, pruned,
        # pruned, whole, so that a change of the machine's load during the trial weighs on both alike
        size_trial = max(_TRIAL_QUERIES, min(query.shape[0] // 4, _TRIAL_QUERIES_PER_GROUP * groups.count))
        half = size_trial // 2
        seconds = {"whole": 0.0, "pruned": 0.0}
        first = []
        for way, start, stop in (("whole", 0, half), ("pruned", 0, half), ("pruned", half, size_trial),
                                 ("whole", half, size_trial)):
            started = time.perf_counter()
            if way == "whole":
                first.append(whole_search(query[start:stop]))
            else:
                _pruned(query[start:stop], gallery, groups, search, decision.share, want_scores)
            seconds[way] += time.perf_counter() - started
        first = _joined(*first)
        whole_s, pruned_s = seconds["whole"], seconds["pruned"]
        rest = query[size_trial:]
        if pruned_s * _TRIAL_GAIN > whole_s:
            return (*_joined(first, whole_search(rest)), declined)
        index, score, report = _pruned(rest, gallery, groups, search, decision.share, want_scores)
        return (*_joined(first, (index, score)), report)


def _joined(first, second):
    """(indices, scores or None) of two consecutive query blocks, concatenated."""
    scores = None if first[1] is None else torch.cat([first[1], second[1]])
    return torch.cat([first[0], second[0]]), scores


def needed_groups(query: torch.Tensor, groups: Groups) -> torch.Tensor:
    """(Nq, C) bool: the groups each query row must search (its bounds, in blocks of ``_BOUND_CHUNK`` rows, as
    independent pieces of work: ``run_chunks``)."""
    need = torch.empty((query.shape[0], groups.count), dtype=torch.bool, device=query.device)

    def block(start: int, stop: int) -> None:
        need[start:stop] = needed(*bounds(_unit32(query[start:stop], "query", start), groups))
    run_chunks(block, [(start, min(query.shape[0], start + _BOUND_CHUNK))
                       for start in range(0, query.shape[0], _BOUND_CHUNK)], query.device)
    return need


def _pruned(query: torch.Tensor, gallery: torch.Tensor, groups: Groups, search, share: float,
            want_scores: bool = False):
    """``search_top1`` with pruning: bounds of every query, then the kernel on each group for the queries that
    must search it (groups as independent pieces of work, ``run_chunks``), then the merge."""
    need = needed_groups(query, groups)
    # a query that searches one group is answered by that group's top-1 (no merge, so no fp64 score needed: the
    # kernel's cheapest mode) unless scores are asked for; queries that search several take the fp64 scores to
    # merge
    several = (need.sum(dim=1) > 1) | want_scores
    found: list = [None] * groups.count

    def search_group(group: int) -> None:
        members = groups.members(group)
        parts = []
        for merged in (False, True):
            rows = torch.nonzero(need[:, group] & (several if merged else ~several)).squeeze(1)
            if rows.numel():
                index, score = search(query[rows], gallery[members], merged)
                value = score[:, 0] if merged else torch.full((rows.numel(),), math.inf, dtype=torch.float64,
                                                              device=rows.device)
                parts.append((rows, members[index[:, 0]], value))
        found[group] = parts

    # largest pieces first, each searched on one thread: no barrier between them
    largest_first = sorted(range(groups.count), key=lambda group: -int(need[:, group].sum()) * (
        groups.starts[group + 1] - groups.starts[group]))
    run_chunks(lambda position, _: search_group(largest_first[position]),
               [(position, position + 1) for position in range(groups.count)], gallery.device)
    best_score = torch.full((query.shape[0],), -math.inf, dtype=torch.float64, device=gallery.device)
    best_index = torch.full((query.shape[0],), -1, dtype=torch.long, device=gallery.device)
    # the merge is order-independent (fp64 score, then lowest index); single-group queries carry +inf
    for rows, index, value in (part for parts in found if parts for part in parts):
        current, current_index = best_score[rows], best_index[rows]
        better = (value > current) | ((value == current) & (index < current_index))
        best_score[rows[better]] = value[better]
        best_index[rows[better]] = index[better]
    sizes = groups.sizes().to(need.device)
    report = Report(True, groups.count, float(need.double().sum(dim=1).mean()),
                    float((need.double() * sizes).sum(dim=1).mean()), share)
    return best_index, best_score if want_scores else None, report
