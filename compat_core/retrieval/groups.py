"""Groups of gallery rows for the pruned exact search (``compat_core.retrieval.pruned``): by class or by
spherical k-means, each with a centre direction, a proven bound on its members' angle to it and the member nearest
it; the fp32 unit rows they are measured on, and the error of an fp32 or half-precision product of such rows.
Any split is a valid grouping (the bounds are measured afterwards); only the speed of the search depends on it."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from compat_core.hardware.calibration import fastest_matmul
from compat_core.retrieval.int8 import SLACK, U32, gamma

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
_COSINE_BLOCK = 256           # gallery rows per block of member-to-centre cosines
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


@dataclass
class Groups:
    """The gallery split into groups: members of group c are ``order[starts[c]:starts[c + 1]]`` (ascending),
    ``group_at`` (Ng,) the group of each position of ``order``; ``directions`` (2C, D) fp32: the centres m32_c
    (unit up to ``centre_dev`` = a bound on | ||m32|| - 1 |; the reference centre is m32 / ||m32||), then the unit
    row of each group's member nearest its centre (for the lower bound), so that one product gives both;
    ``angles`` (C,) fp64 upper bounds on each member's angle to its reference centre (radians); ``unit32``
    (Ng, D) the gallery's fp32 unit rows (``_unit32``), in gallery order; ``half``: the format of the bounds'
    product (the calibrated faster float product; None: fp32)."""

    order: torch.Tensor
    starts: list[int]
    directions: torch.Tensor
    angles: torch.Tensor
    centre_dev: float
    unit32: torch.Tensor
    group_at: torch.Tensor
    half: torch.dtype | None = None               # the bounds' product in this half format (None: fp32)
    directions_half: torch.Tensor | None = None   # (D, 2C) ``directions`` rounded to ``half``, contiguous

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


def _kmeans_count(size: int) -> int:
    """Number of k-means groups of a ``size``-row gallery: about size / 32, at most ``_MAX_GROUPS``."""
    return int(min(_MAX_GROUPS, max(1, size // (2 * _MIN_GROUP))))


def _sample_positions(size: int, count: int, device: torch.device) -> torch.Tensor:
    """``count`` distinct gallery rows, seeded (the same gallery size always gets the same sample)."""
    generator = torch.Generator().manual_seed(_KMEANS_SEED)
    return torch.randperm(size, generator=generator)[:count].to(device)


def kmeans_centres(sample: torch.Tensor, groups: int, iterations: int = _KMEANS_ITERATIONS) -> torch.Tensor:
    """Spherical k-means centres (groups, D) of the unit rows ``sample`` (n, D), in ``sample``'s dtype (seeded by
    the sample's order: its first rows start the centres)."""
    dtype, device = sample.dtype, sample.device
    centres = sample[:groups].clone()
    columns = torch.arange(sample.shape[0], device=device)
    for _ in range(iterations):
        assign = (sample @ centres.t()).argmax(dim=1)
        # the groups' sums as one product with their (C, n) membership matrix (index_add_ measured ~10x slower)
        membership = torch.zeros((groups, sample.shape[0]), dtype=dtype, device=device)
        membership[assign, columns] = 1.0
        sums = membership @ sample
        norms = torch.linalg.vector_norm(sums.float(), dim=1, keepdim=True)
        centres = torch.where(norms > 0, sums.float() / norms.clamp(min=1e-30), centres.float()).to(dtype)
    return centres


def assign_to_centres(unit32: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """(n,) int64: each unit row's nearest centre (the product in ``centres``' dtype), or ``len(centres)`` for
    rows far from every centre (outliers of the clusters: in a cluster's group one of them would widen the
    group's cap for every query, in their own group only their few rows are searched by the queries that need
    them)."""
    nearest = (unit32.to(centres.dtype) @ centres.t()).max(dim=1)
    assign = nearest.indices
    cosine = nearest.values.float()
    median = cosine.median()
    spread = (cosine - median).abs().median()
    outliers = cosine < median - _OUTLIER_SPREADS * spread - _OUTLIER_MARGIN
    if bool(outliers.any()):
        assign = torch.where(outliers, torch.full_like(assign, centres.shape[0]), assign)
    return assign


def kmeans_assignment(unit32: torch.Tensor, groups: int, iterations: int = _KMEANS_ITERATIONS,
                      dtype: torch.dtype = torch.float32) -> np.ndarray:
    """Spherical k-means of unit fp32 rows (n, D) into ``groups`` groups (seeded, deterministic): centres fitted on
    a sample of at most ``_KMEANS_SAMPLE_PER_GROUP`` rows per group, then every row assigned to its nearest centre,
    the products in ``dtype``. Only the speed of the pruned search depends on its quality, never its result (any
    assignment is a valid grouping: the bounds are measured afterwards), so a half-precision product will do."""
    pick = _sample_positions(unit32.shape[0], groups * _KMEANS_SAMPLE_PER_GROUP, unit32.device)
    centres = kmeans_centres(unit32[pick].to(dtype), groups, iterations)
    return assign_to_centres(unit32, centres).cpu().numpy()


def _grouping_dtype(device: torch.device) -> torch.dtype:
    """The float product calibrated fastest on ``device`` (bf16, fp16 or fp32) for the k-means products."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(fastest_matmul(device, exclude=("int8",)),
                                                               torch.float32)


def _group_sums(unit32: torch.Tensor, assign: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """(groups, D) fp32 sums of each group's rows, as one product with the (C, n) membership matrix: a matrix
    product runs near the machine's peak, index_add_ measured ~5x slower; in the fastest float product, since any
    unit vector is a valid centre."""
    membership = torch.zeros((groups, unit32.shape[0]), dtype=dtype, device=unit32.device)
    membership[assign, torch.arange(unit32.shape[0], device=unit32.device)] = 1.0
    return (membership @ unit32.to(dtype)).float()


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
        assign = kmeans_assignment(unit32, _kmeans_count(gallery.shape[0]), dtype=dtype)
    sizes = np.bincount(assign)
    present = np.nonzero(sizes)[0]
    remap = np.full(sizes.shape[0], -1)
    remap[present] = np.arange(present.shape[0])
    assign_t = torch.as_tensor(remap[assign], device=gallery.device)
    order = torch.sort(assign_t, stable=True).indices            # by group, ascending gallery index inside
    sizes = sizes[present]
    starts = [0] + np.cumsum(sizes).tolist()
    groups = len(sizes)
    sums = _group_sums(unit32, assign_t, groups, dtype)
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
    # each row with its own centre (any order: gamma_D), in blocks whose gathered centres stay in cache (measured
    # 2.2x faster than one gather of the whole gallery's)
    cosines = torch.empty(gallery.shape[0], dtype=torch.float32, device=gallery.device)
    for start in range(0, gallery.shape[0], _COSINE_BLOCK):
        part = slice(start, start + _COSINE_BLOCK)
        cosines[part] = (unit32[part] * centres32[assign_t[part]]).sum(dim=1)
    low = torch.full((groups,), math.inf, dtype=torch.float32, device=gallery.device)
    low = low.scatter_reduce(0, assign_t, cosines, reduce="amin").double() - e_c
    # a smaller cosine is a larger (safer) angle; arccos is accurate to an ulp or two of its result
    angles = torch.arccos(low.clamp(-1.0, 1.0)) * (1.0 + 1e-12) + 1e-15
    nearest = _nearest_members(cosines, assign_t, groups)
    group_at = torch.repeat_interleave(torch.arange(groups, device=gallery.device),
                                       torch.as_tensor(sizes, device=gallery.device))
    directions = torch.cat([centres32, unit32[nearest]]).contiguous()
    half = dtype if dtype in UNIT_ROUNDOFF else None
    # (D, 2C) contiguous: a transposed view halves the speed of AMX half products
    directions_half = directions.to(half).t().contiguous() if half is not None else None
    return Groups(order, starts, directions, angles, centre_dev, unit32, group_at, half, directions_half)


def _nearest_members(cosines: torch.Tensor, assign: torch.Tensor, groups: int) -> torch.Tensor:
    """(groups,) the row of each group with the largest cosine to its centre (the lowest index among equal ones;
    ``groups``: the row count for a group without rows)."""
    best = torch.full((groups,), -math.inf, dtype=cosines.dtype, device=cosines.device)
    best = best.scatter_reduce(0, assign, cosines, reduce="amax")
    is_best = cosines == best[assign]
    nearest = torch.full((groups,), cosines.shape[0], dtype=torch.long, device=cosines.device)
    return nearest.scatter_reduce(0, assign[is_best], torch.nonzero(is_best).squeeze(1), reduce="amin")


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


def _checked_unit32(rows: torch.Tensor, pick: torch.Tensor, name: str) -> torch.Tensor:
    """``_unit32`` of the rows ``pick`` of ``rows``; a bad row is named by its index in ``rows``."""
    try:
        return _unit32(rows[pick], name)
    except ValueError:
        bad = ~torch.isfinite(torch.linalg.vector_norm(rows[pick].double(), dim=1))
        bad |= torch.linalg.vector_norm(rows[pick].double(), dim=1) == 0
        raise ValueError(f"{name}: row {int(pick[torch.nonzero(bad)[0, 0]])} has zero or non-finite norm; cosine "
                         f"similarity is undefined") from None


def product_error(dim: int, dev_x: float, dev_y: float, unit: float = 0.0) -> float:
    """Bound on |S - x.y| for fp32 rows x32, y32 within ``dev_x``, ``dev_y`` of the unit vectors x, y, where S is
    their product in fp32 (``unit`` 0) or as copies rounded to a half format of unit roundoff ``unit`` (bf16
    2^-8, fp16 2^-11; subnormal fp16 components add at most 2^-24 sqrt(D) absolutely), accumulated in fp32 and
    rounded to that format: input deviation of both sides, gamma_D accumulation and the output rounding."""
    tiny = math.sqrt(dim) * 2.0 ** -24 if unit else 0.0
    dev_x = unit * (1.0 + dev_x) + dev_x + tiny                  # ||x_h - x||
    dev_y = unit * (1.0 + dev_y) + dev_y + tiny
    norms = (1.0 + dev_x) * (1.0 + dev_y)                          # >= ||x_h|| ||y_h||
    g = gamma(dim, U32)
    # |S - x.y| <= |S - z| + |z - x_h.y_h| + ||x_h - x|| ||y_h|| + ||x|| ||y_h - y||, z the fp32 accumulation
    output = unit * norms * (1.0 + g) + (2.0 ** -24 if unit else 0.0)
    return (output + g * norms + dev_x * (1.0 + dev_y) + dev_y) * SLACK
