"""Theorem 1 Monte Carlo (SPEC §6): cap sampler correctness, closed forms, the inequalities, and `compat theory`."""
from __future__ import annotations

import math

import numpy as np
import pytest

from app.cli import main
from compat_core.evaluation.theory import (
    cap_mean_cosine,
    cap_polar_angles,
    sample_cap,
    simplex_vertex_pair,
    theorem1_monte_carlo,
)

# --- exact mean cosine against hand-derived closed forms ------------------------------------------------------------

@pytest.mark.parametrize("angle_deg", [5.0, 30.0, 90.0, 135.0])
def test_cap_mean_cosine_closed_forms(angle_deg):
    a = math.radians(angle_deg)
    # d = 3 (Archimedes): cos(theta) is uniform on [cos a, 1], so the mean is (1 + cos a) / 2
    assert cap_mean_cosine(3, angle_deg) == pytest.approx((1 + math.cos(a)) / 2, rel=1e-9)
    # d = 4: density sin^2; int_0^a cos sin^2 = sin^3 a / 3, int_0^a sin^2 = a/2 - sin(2a)/4
    expected_4 = (math.sin(a) ** 3 / 3) / (a / 2 - math.sin(2 * a) / 4)
    assert cap_mean_cosine(4, angle_deg) == pytest.approx(expected_4, rel=1e-9)
    # d = 5: density sin^3; int_0^a cos sin^3 = sin^4 a / 4, int_0^a sin^3 = 2/3 - cos a + cos^3 a / 3
    expected_5 = (math.sin(a) ** 4 / 4) / (2 / 3 - math.cos(a) + math.cos(a) ** 3 / 3)
    assert cap_mean_cosine(5, angle_deg) == pytest.approx(expected_5, rel=1e-9)


@pytest.mark.parametrize("dim, angle_deg", [(7, 10.0), (100, 89.9), (1000, 40.0), (5000, 89.0), (10_000, 1.0)])
def test_cap_mean_cosine_against_the_hypergeometric_form(dim, angle_deg):
    # For a < 90 deg, int_0^a sin^n = sin^(n+1)(a) cos(a) / (n+1) * 2F1((n+2)/2, 1; (n+3)/2; sin^2 a) (the
    # incomplete-beta series), so with n = d - 2: m = 1 / (cos(a) * 2F1(d/2, 1; (d+1)/2; sin^2 a)).
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    a = mpmath.radians(angle_deg)
    expected = 1 / (mpmath.cos(a) * mpmath.hyp2f1(mpmath.mpf(dim) / 2, 1, mpmath.mpf(dim + 1) / 2, mpmath.sin(a) ** 2))
    assert cap_mean_cosine(dim, angle_deg) == pytest.approx(float(expected), rel=1e-10)


def test_cap_mean_cosine_limits():
    assert cap_mean_cosine(50, 180.0) == pytest.approx(0.0, abs=1e-12)  # whole sphere
    # high d concentrates the cap's mass at its rim: the mean cosine tends to cos(a) from above
    assert math.cos(math.radians(40)) < cap_mean_cosine(5000, 40.0) < math.cos(math.radians(40)) + 1e-3
    # does not underflow for a tiny cap in high dimension (sin(1 deg)^9998 is far below the float64 range)
    assert math.cos(math.radians(1.0)) < cap_mean_cosine(10_000, 1.0) < 1.0


# --- sampler correctness --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [2, 3, 10, 100])
@pytest.mark.parametrize("angle_deg", [20.0, 60.0, 89.9, 120.0])
def test_sampled_points_lie_on_the_cap_with_the_right_mean_cosine(dim, angle_deg):
    rng = np.random.default_rng(dim * 1000 + int(angle_deg))
    center = rng.standard_normal(dim)
    center /= np.linalg.norm(center)
    n = 20_000
    points = sample_cap(center, angle_deg, n, rng)
    assert points.shape == (n, dim)
    np.testing.assert_allclose(np.linalg.norm(points, axis=1), 1.0, atol=1e-12)
    cosines = points @ center
    # every sample inside the cap (fraction inside = 1)
    assert np.all(cosines >= math.cos(math.radians(angle_deg)) - 1e-12)
    standard_error = cosines.std(ddof=1) / math.sqrt(n)
    assert abs(cosines.mean() - cap_mean_cosine(dim, angle_deg)) < 5 * standard_error
    # the component orthogonal to the centre averages to zero (no preferred tangent direction)
    orthogonal = points - np.outer(cosines, center)
    # the mean of n i.i.d. zero-mean vectors has squared norm about E||o||^2 / n; allow 3 times that norm
    typical_norm_of_mean = math.sqrt(np.mean(np.sum(orthogonal**2, axis=1)) / n)
    assert np.linalg.norm(orthogonal.mean(axis=0)) < 3 * typical_norm_of_mean


def _ks_statistic(samples: np.ndarray, cdf) -> float:
    ordered = np.sort(samples)
    n = len(ordered)
    values = cdf(ordered)
    return float(max(np.max(np.arange(1, n + 1) / n - values), np.max(values - np.arange(n) / n)))


@pytest.mark.parametrize("angle_deg", [25.0, 150.0])
def test_polar_angle_distribution_in_3d_is_uniform_in_cosine(angle_deg):
    # d = 3: the exact CDF of the polar angle on the cap is (1 - cos theta) / (1 - cos a)
    n = 20_000
    theta = cap_polar_angles(3, angle_deg, n, np.random.default_rng(7))
    a = math.radians(angle_deg)
    statistic = _ks_statistic(theta, lambda x: (1 - np.cos(x)) / (1 - math.cos(a)))
    assert statistic < 1.95 / math.sqrt(n)  # Kolmogorov 0.1% critical value


@pytest.mark.parametrize("dim, angle_deg", [(10, 40.0), (200, 85.0), (200, 95.0)])
def test_polar_angle_distribution_matches_the_numerical_cdf(dim, angle_deg):
    # reference CDF: cumulative trapezoid of the density sin^(d-2) on a fine grid (log-scaled against underflow)
    a = math.radians(angle_deg)
    grid = np.linspace(0.0, a, 200_001)
    with np.errstate(divide="ignore"):
        log_density = (dim - 2) * np.log(np.sin(grid))
    density = np.exp(log_density - log_density.max())
    cumulative = np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2)])
    cumulative /= cumulative[-1]
    n = 20_000
    theta = cap_polar_angles(dim, angle_deg, n, np.random.default_rng(dim))
    statistic = _ks_statistic(theta, lambda x: np.interp(x, grid, cumulative))
    assert statistic < 1.95 / math.sqrt(n)


def test_sampler_is_seeded():
    first = sample_cap(np.array([0.0, 0.0, 1.0, 0.0]), 30.0, 100, np.random.default_rng(11))
    second = sample_cap(np.array([0.0, 0.0, 1.0, 0.0]), 30.0, 100, np.random.default_rng(11))
    np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("dim", [2, 3, 10, 1000])
def test_simplex_vertex_pair_has_the_d_simplex_cosine(dim):
    pair = simplex_vertex_pair(dim)
    np.testing.assert_allclose(np.linalg.norm(pair, axis=1), 1.0, atol=1e-15)
    # K = d + 1 prototypes: pairwise cosine -1/(K-1) = -1/d
    assert pair[0] @ pair[1] == pytest.approx(-1.0 / dim, abs=1e-15)


def test_simplex_vertex_pair_matches_a_hand_built_tetrahedron():
    # regular tetrahedron (d = 3, K = 4): vertices (1,1,1), (1,-1,-1), ... / sqrt(3); pairwise cosine -1/3
    tetrahedron = np.array([[1, 1, 1], [1, -1, -1], [-1, 1, -1], [-1, -1, 1]]) / math.sqrt(3)
    assert tetrahedron[0] @ tetrahedron[1] == pytest.approx(simplex_vertex_pair(3)[0] @ simplex_vertex_pair(3)[1])


# --- Theorem 1 ------------------------------------------------------------------------------------------------------

def test_inequalities_hold_for_default_angles_across_dimensions():
    records = theorem1_monte_carlo(dims=[3, 10, 100], old_cap_deg=40.0, new_cap_deg=30.0, samples=20_000, seed=0)
    assert [(r.case, r.dim) for r in records] == [
        ("same_class", 3), ("different_class", 3), ("same_class", 10), ("different_class", 10),
        ("same_class", 100), ("different_class", 100),
    ]
    for record in records:
        assert record.holds and record.holds_exact, record
        # Monte Carlo means agree with the closed form 1 - m_old m_new <w_i, w_j> within 5 standard errors
        assert abs(record.old_new - record.exact_old_new) < 5 * record.old_new_se, record
        assert abs(record.old_old - record.exact_old_old) < 5 * record.old_old_se, record
        # and the inequality is resolved, not a coin flip
        assert abs(record.old_new - record.old_old) > 4 * record.difference_se, record


def test_exact_expectations_by_hand_in_3d():
    # d = 3, old cap 60 deg: m_old = (1 + cos 60)/2 = 0.75; new cap 0+ (a point): m_new -> 1 (use 1e-6 deg)
    # same class: E[d(old,new)] = 1 - 0.75 * 1 = 0.25, E[d(old,old)] = 1 - 0.75^2 = 0.4375
    # different class (cos -1/3): 1 + 0.75/3 = 1.25 and 1 + 0.5625/3 = 1.1875
    same, different = theorem1_monte_carlo(dims=[3], old_cap_deg=60.0, new_cap_deg=1e-6, samples=2, seed=0)
    assert same.exact_old_new == pytest.approx(0.25, abs=1e-9)
    assert same.exact_old_old == pytest.approx(0.4375, abs=1e-12)
    assert different.exact_old_new == pytest.approx(1.25, abs=1e-9)
    assert different.exact_old_old == pytest.approx(1.1875, abs=1e-12)


def test_growing_caps_violate_both_inequalities():
    # the theorem assumes the cap shrinks; a growing cap must be reported as a violation
    records = theorem1_monte_carlo(dims=[3, 10], old_cap_deg=30.0, new_cap_deg=40.0, samples=5_000, seed=1)
    assert not any(record.holds for record in records)
    assert not any(record.holds_exact for record in records)


def test_monte_carlo_is_seeded_and_independent_of_the_grid():
    alone = theorem1_monte_carlo(dims=[10], samples=1_000, seed=5)
    in_grid = theorem1_monte_carlo(dims=[3, 10], samples=1_000, seed=5)
    assert alone == [r for r in in_grid if r.dim == 10]
    other_seed = theorem1_monte_carlo(dims=[10], samples=1_000, seed=6)
    assert alone[0].old_new != other_seed[0].old_new


def test_grid_over_angles_and_samples():
    records = theorem1_monte_carlo(dims=[3], old_cap_deg=[40.0, 50.0], new_cap_deg=[20.0], samples=[500, 1_000])
    settings = [(r.old_cap_deg, r.new_cap_deg, r.samples) for r in records if r.case == "same_class"]
    assert settings == [(40.0, 20.0, 500), (40.0, 20.0, 1_000), (50.0, 20.0, 500), (50.0, 20.0, 1_000)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dims": [1]}, "dims"),
        ({"old_cap_deg": 0.0}, "old_cap_deg"),
        ({"new_cap_deg": 200.0}, "new_cap_deg"),
        ({"samples": 1}, "samples"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        theorem1_monte_carlo(**{"dims": [3], "samples": 10, **kwargs})


# --- CLI ------------------------------------------------------------------------------------------------------------

def test_cli_prints_both_tables_and_returns_zero(capsys, tmp_path):
    png = tmp_path / "theory.png"
    code = main(["theory", "--dims", "3", "10", "--samples", "3000", "--seed", "2", "--png", str(png)])
    output = capsys.readouterr().out
    assert code == 0
    assert "Same class" in output and "Different classes" in output
    assert "E[d(old,new)]" in output and "E[d(old,old)]" in output
    assert output.count(" yes") == 4 and " NO" not in output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_returns_one_when_an_inequality_fails(capsys):
    code = main(["theory", "--dims", "3", "--old-angle", "30", "--new-angle", "40", "--samples", "2000"])
    output = capsys.readouterr().out
    assert code == 1
    assert "VIOLATED" in output


def test_cli_reports_invalid_options_with_exit_code_two(capsys):
    code = main(["theory", "--dims", "1", "--samples", "100"])
    assert code == 2
    assert "dims: expected an integer dimension >= 2" in capsys.readouterr().err
