"""Monte Carlo check of Theorem 1 ("stationarity implies compatibility", SPEC §6; 2026 paper, Appendix A, Fig. 12).

Setting (as in the paper's proof): features of a class are uniformly distributed on a hyperspherical cap of the
unit sphere in ``R^d`` centred on the class's d-Simplex prototype. After an update the cap shrinks around the same
centre (old cap half-angle > new cap half-angle). With cosine distance ``g(a, b) = 1 - cos(a, b)`` the two
compatibility inequalities (Def. 1) hold in expectation:

* same class:      ``E[g(old_i, new_j)] <= E[g(old_i, old_j)]``
* different class: ``E[g(old_i, new_j)] >= E[g(old_i, old_j)]``   (prototypes = two d-Simplex vertices)

Different-class pairs use two vertices of the d-Simplex with ``K = d + 1`` prototypes in ``R^d``: all vertex pairs
have cosine ``-1/(K-1) = -1/d`` (assumption A1), so one pair is enough.

Besides the Monte Carlo estimates this module gives the exact expectations: for independent ``X`` uniform on a cap
around ``w1`` and ``Y`` on a cap around ``w2``, symmetry gives ``E[X] = m(alpha1) w1``, hence
``E[cos(X, Y)] = m(alpha1) m(alpha2) <w1, w2>`` with ``m(alpha) = E[cos(polar angle)]`` (``cap_mean_cosine``).

Cap angles are half-angles (polar angle from the centre to the cap's rim) in **degrees** in the public API.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "Theorem1Record",
    "cap_mean_cosine",
    "cap_polar_angles",
    "sample_cap",
    "simplex_vertex_pair",
    "theorem1_monte_carlo",
]

DEFAULT_DIMS = (3, 10, 100, 1000)
DEFAULT_OLD_CAP_DEG = 40.0
DEFAULT_NEW_CAP_DEG = 30.0
DEFAULT_SAMPLES = 30_000


def _check_dim(dim: int, name: str = "dim") -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 2:
        raise ValueError(f"{name}: expected an integer dimension >= 2, got {dim!r}")
    return int(dim)


def _check_angle_deg(angle_deg: float, name: str) -> float:
    try:
        angle = float(angle_deg)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a cap half-angle in degrees, got {angle_deg!r}") from None
    if not 0.0 < angle <= 180.0:
        raise ValueError(f"{name}: expected a cap half-angle in (0, 180] degrees, got {angle_deg!r}")
    return angle


def cap_polar_angles(dim: int, cap_angle_deg: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Polar angles (radians, shape ``(n,)``) of ``n`` points uniform on a cap of half-angle ``cap_angle_deg`` in R^dim.

    The polar angle of a uniform point on the sphere S^(dim-1) has density proportional to ``sin(theta)^(dim-2)``;
    restricted to the cap it lives on ``[0, alpha]``. Exact sampling:
    ``dim == 2``: uniform on ``[0, alpha]``; ``alpha <= 90 deg``: rejection from an exponential envelope tangent to
    the log-concave log-density (measured acceptance 66-100% for d = 3..10,000); ``alpha > 90 deg``: rejection of the polar
    angle of a uniform point on the whole sphere (acceptance >= 50%).
    """
    dim = _check_dim(dim)
    alpha = math.radians(_check_angle_deg(cap_angle_deg, "cap_angle_deg"))
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n: expected a non-negative integer number of samples, got {n!r}")
    if dim == 2:
        return rng.uniform(0.0, alpha, size=n)
    exponent = dim - 2
    accepted: list[np.ndarray] = []
    remaining = n
    if alpha <= math.pi / 2:
        # Tangent point below the mode pi/2 keeps the envelope slope positive; any point is exact (log-concavity),
        # this one keeps acceptance high when alpha is close to 90 degrees in high dimension.
        theta0 = min(alpha, math.pi / 2 - 1.0 / math.sqrt(exponent))
        slope = exponent / math.tan(theta0)
        log_sin0 = math.log(math.sin(theta0))
        mass_fraction = -math.expm1(-slope * alpha)  # envelope mass on [0, alpha] over its mass on (-inf, alpha]
        while remaining > 0:
            batch = max(64, int(remaining * 1.6))
            # inverse CDF of the envelope exp(slope * theta) truncated to [0, alpha]
            u = 1.0 - rng.random(batch)  # (0, 1]
            theta = alpha + np.log1p(-u * mass_fraction) / slope
            np.clip(theta, 0.0, alpha, out=theta)  # guards only the last ulp of rounding
            with np.errstate(divide="ignore"):
                log_ratio = exponent * (np.log(np.sin(theta)) - log_sin0) - slope * (theta - theta0)
            keep = theta[np.log(rng.random(batch)) < log_ratio]
            accepted.append(keep[:remaining])
            remaining -= len(accepted[-1])
    else:
        half = (dim - 1) / 2.0
        while remaining > 0:
            batch = max(64, int(remaining * 2.2))
            # (1 + cos theta) / 2 ~ Beta((dim-1)/2, (dim-1)/2) for a uniform point on the whole sphere
            cosine = 2.0 * rng.beta(half, half, size=batch) - 1.0
            theta = np.arccos(np.clip(cosine, -1.0, 1.0))
            keep = theta[theta <= alpha]
            accepted.append(keep[:remaining])
            remaining -= len(accepted[-1])
    return np.concatenate(accepted) if accepted else np.empty(0)


def _unit_tangents(center: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, d) unit vectors uniform on the great sphere orthogonal to the unit vector ``center``."""
    gaussian = rng.standard_normal((n, center.shape[0]))
    gaussian -= np.outer(gaussian @ center, center)
    gaussian /= np.linalg.norm(gaussian, axis=1, keepdims=True)
    return gaussian


def _points(center: np.ndarray, theta: np.ndarray, tangents: np.ndarray) -> np.ndarray:
    return np.cos(theta)[:, None] * center[None, :] + np.sin(theta)[:, None] * tangents


def sample_cap(center: np.ndarray, cap_angle_deg: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``(n, d)`` float64 unit vectors uniform on the cap of half-angle ``cap_angle_deg`` around ``center`` (d,).

    ``center`` is normalised internally; it must be non-zero with ``d >= 2``.
    """
    center = np.asarray(center, dtype=np.float64)
    if center.ndim != 1:
        raise ValueError(f"center: expected a 1-D vector (d,), got shape {center.shape}")
    _check_dim(center.shape[0], "center dimension")
    norm = float(np.linalg.norm(center))
    if not math.isfinite(norm) or norm == 0.0:
        raise ValueError("center: expected a finite non-zero vector")
    center = center / norm
    theta = cap_polar_angles(center.shape[0], cap_angle_deg, n, rng)
    return _points(center, theta, _unit_tangents(center, n, rng))


def cap_mean_cosine(dim: int, cap_angle_deg: float, nodes: int = 20_001) -> float:
    """Exact ``E[cos(polar angle)]`` for a point uniform on a cap of half-angle ``cap_angle_deg`` in R^dim.

    ``m = int_0^a cos(t) sin(t)^(d-2) dt / int_0^a sin(t)^(d-2) dt``. The numerator is ``sin(a)^(d-1)/(d-1)``; the
    denominator is integrated with composite Simpson on ``nodes`` points over the window where the density is
    within ``exp(-60)`` of its maximum (the rest is negligible because the density is log-concave), in scaled form
    so that nothing underflows at large d. Relative accuracy is about 1e-10.
    """
    dim = _check_dim(dim)
    alpha = math.radians(_check_angle_deg(cap_angle_deg, "cap_angle_deg"))
    if dim == 2:
        return math.sin(alpha) / alpha
    if nodes < 3 or nodes % 2 == 0:
        raise ValueError(f"nodes: expected an odd number >= 3 for Simpson's rule, got {nodes}")
    exponent = dim - 2

    def log_density(theta: float) -> float:
        sine = math.sin(theta)
        return exponent * math.log(sine) if sine > 0.0 else -math.inf

    # In high dimension the mass sits in a sliver of width ~1/d next to the mode (the rim for caps below 90 deg);
    # integrating only where it lives keeps Simpson's grid fine enough there.
    mode = min(alpha, math.pi / 2)
    scale = log_density(mode)
    cutoff = scale - 60.0

    def window_edge(inside: float, outside: float) -> float:
        # log-concavity: the density is monotone between the mode and either end, so bisection finds the edge
        if log_density(outside) >= cutoff:
            return outside
        for _ in range(200):
            middle = 0.5 * (inside + outside)
            if log_density(middle) >= cutoff:
                inside = middle
            else:
                outside = middle
        return outside

    low, high = window_edge(mode, 0.0), window_edge(mode, alpha)
    theta = np.linspace(low, high, nodes)
    with np.errstate(divide="ignore"):
        scaled_density = np.exp(exponent * np.log(np.sin(theta)) - scale)
    weights = np.ones(nodes)
    weights[1:-1:2] = 4.0
    weights[2:-1:2] = 2.0
    denominator = ((high - low) / (nodes - 1) / 3.0) * float(np.sum(weights * scaled_density))
    sin_alpha = math.sin(alpha)
    # a cap of 180 degrees is the whole sphere: the numerator sin(pi)^(d-1) / (d-1) is 0 up to rounding
    numerator = math.exp((dim - 1) * math.log(sin_alpha) - scale) / (dim - 1) if sin_alpha > 1e-12 else 0.0
    return numerator / denominator


def simplex_vertex_pair(dim: int) -> np.ndarray:
    """Two vertices ``(2, dim)`` of the d-Simplex with ``K = dim + 1`` unit prototypes: cosine exactly ``-1/dim``.

    Any pair of d-Simplex vertices has this cosine, so by rotation invariance this pair stands for all of them.
    """
    dim = _check_dim(dim)
    pair = np.zeros((2, dim))
    pair[0, 0] = 1.0
    pair[1, 0] = -1.0 / dim
    pair[1, 1] = math.sqrt(1.0 - 1.0 / dim**2)
    return pair


@dataclass(frozen=True)
class Theorem1Record:
    """One Monte Carlo estimate (distances are cosine distances ``1 - cos`` in ``[0, 2]``).

    case: ``"same_class"`` (inequality ``old_new <= old_old``) or ``"different_class"`` (``old_new >= old_old``).
    old_new / old_old: Monte Carlo means of ``g(old_i, new_j)`` and ``g(old_i, old_j)`` over ``samples`` pairs.
    old_new_se / old_old_se: standard errors of those two means.
    difference_se: standard error of the mean difference ``old_new - old_old`` (antithetic pairs are the i.i.d. unit).
    exact_old_new / exact_old_old: closed-form expectations (see module docstring).
    holds: the inequality holds for the Monte Carlo means; holds_exact: for the exact expectations.
    """

    case: str
    dim: int
    old_cap_deg: float
    new_cap_deg: float
    samples: int
    seed: int
    old_new: float
    old_old: float
    old_new_se: float
    old_old_se: float
    difference_se: float
    exact_old_new: float
    exact_old_old: float
    holds: bool
    holds_exact: bool

    def as_dict(self) -> dict:
        """Plain dict (JSON-ready)."""
        return asdict(self)


def _as_list(value, name: str) -> list:
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name}: expected a number or a list of numbers, got {value!r}")
    if isinstance(value, Iterable):
        values = list(value)
        if not values:
            raise ValueError(f"{name}: expected at least one value")
        return values
    return [value]


def _inequality_holds(case: str, old_new: float, old_old: float) -> bool:
    # Def. 1 uses non-strict inequalities
    return old_new <= old_old if case == "same_class" else old_new >= old_old


def _standard_error(total: float, total_of_squares: float, count: int) -> float:
    """Standard error of a mean from running sums (sample variance with Bessel's correction)."""
    mean = total / count
    variance = max(total_of_squares / count - mean * mean, 0.0) * count / (count - 1)
    return math.sqrt(variance / count)


def _one_configuration(
    dim: int, old_deg: float, new_deg: float, samples: int, seed: int, chunk: int
) -> list[Theorem1Record]:
    # Seed from the configuration itself so a record does not depend on what else is in the grid.
    rng = np.random.default_rng([seed, dim, round(old_deg * 1e6), round(new_deg * 1e6), samples])
    w_a, w_b = simplex_vertex_pair(dim)
    # per case: sum(on), sum(oo), sum(on^2), sum(oo^2), sum((on-oo)^2) over the i.i.d. draws
    sums = {case: np.zeros(5) for case in ("same_class", "different_class")}
    for start in range(0, samples, chunk):
        n = min(chunk, samples - start)
        old_i = sample_cap(w_a, old_deg, n, rng)
        for case, center in (("same_class", w_a), ("different_class", w_b)):
            # Variance reduction, both unbiased because every point below is exactly uniform on its cap:
            # new_j and old_j share their tangent direction v (common random numbers), and each is also used with
            # the antithetic direction -v, which cancels the old_i . v term that dominates the noise in high d.
            tangents = _unit_tangents(center, n, rng)
            theta_new = cap_polar_angles(dim, new_deg, n, rng)
            theta_old = cap_polar_angles(dim, old_deg, n, rng)
            distance_new = 0.5 * sum(
                1.0 - np.einsum("ij,ij->i", old_i, _points(center, theta_new, sign * tangents)) for sign in (1, -1)
            )
            distance_old = 0.5 * sum(
                1.0 - np.einsum("ij,ij->i", old_i, _points(center, theta_old, sign * tangents)) for sign in (1, -1)
            )
            difference = distance_new - distance_old
            sums[case] += (
                distance_new.sum(), distance_old.sum(), float(distance_new @ distance_new),
                float(distance_old @ distance_old), float(difference @ difference),
            )
    m_old = cap_mean_cosine(dim, old_deg)
    m_new = cap_mean_cosine(dim, new_deg)
    records = []
    for case, center_cosine in (("same_class", 1.0), ("different_class", float(w_a @ w_b))):
        sum_new, sum_old, sum_sq_new, sum_sq_old, sum_sq_difference = sums[case]
        old_new, old_old = sum_new / samples, sum_old / samples
        exact_old_new = 1.0 - m_old * m_new * center_cosine
        exact_old_old = 1.0 - m_old * m_old * center_cosine
        records.append(
            Theorem1Record(
                case=case, dim=dim, old_cap_deg=old_deg, new_cap_deg=new_deg, samples=samples, seed=seed,
                old_new=float(old_new), old_old=float(old_old),
                old_new_se=_standard_error(sum_new, sum_sq_new, samples),
                old_old_se=_standard_error(sum_old, sum_sq_old, samples),
                difference_se=_standard_error(sum_new - sum_old, sum_sq_difference, samples),
                exact_old_new=exact_old_new, exact_old_old=exact_old_old,
                holds=_inequality_holds(case, old_new, old_old),
                holds_exact=_inequality_holds(case, exact_old_new, exact_old_old),
            )
        )
    return records


def theorem1_monte_carlo(
    dims: Sequence[int] = DEFAULT_DIMS,
    old_cap_deg: float | Sequence[float] = DEFAULT_OLD_CAP_DEG,
    new_cap_deg: float | Sequence[float] = DEFAULT_NEW_CAP_DEG,
    samples: int | Sequence[int] = DEFAULT_SAMPLES,
    seed: int = 0,
    chunk: int = 4096,
) -> list[Theorem1Record]:
    """Monte Carlo estimates of the Theorem 1 expected cosine distances over a grid of settings.

    dims: representation dimensions d (>= 2); cap angles: half-angles in degrees (old = before the update, new =
    after; the theorem assumes new <= old, other values are allowed and then the inequalities are expected to fail);
    samples: Monte Carlo draws per setting (each is one old point against an antithetic pair of targets).
    Scalars or sequences; the grid is their Cartesian product, ordered dims-major. Returns two records per setting
    (same class first). Seeded: identical inputs give identical output, and each setting's numbers do not depend on
    the rest of the grid. ``chunk`` bounds memory (a few chunk x d float64 arrays). Defaults run in ~3-5 s.
    """
    dim_list = [_check_dim(d, "dims") for d in _as_list(dims, "dims")]
    old_list = [_check_angle_deg(a, "old_cap_deg") for a in _as_list(old_cap_deg, "old_cap_deg")]
    new_list = [_check_angle_deg(a, "new_cap_deg") for a in _as_list(new_cap_deg, "new_cap_deg")]
    sample_list = _as_list(samples, "samples")
    for count in sample_list:
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 2:
            raise ValueError(f"samples: expected integers >= 2, got {count!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk: expected a positive integer, got {chunk!r}")
    records: list[Theorem1Record] = []
    for dim in dim_list:
        for old_deg in old_list:
            for new_deg in new_list:
                for count in sample_list:
                    records.extend(_one_configuration(dim, old_deg, new_deg, int(count), int(seed), int(chunk)))
    return records
