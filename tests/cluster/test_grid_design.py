"""A search budget smaller than the grid is spread over it (seeded), and `compat tune` says how much it covers;
a missing space file fails before Ray starts."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from cluster.tune.grid import coverage_text, grid_size, spread_points
from cluster.tune.search_space import load_space, parse_space

ROOT = Path(__file__).resolve().parents[2]
DEMO_SPACE = ROOT / "configs" / "spaces" / "demo.yaml"


def test_small_budget_covers_distinct_values_of_every_parameter():
    space = load_space(DEMO_SPACE)  # 6 lambdas x 6 rhos
    assert grid_size(space) == 36
    points = spread_points(space, 4, seed=0)
    assert len(points) == 4 and len({tuple(p.values()) for p in points}) == 4
    for key in ("method.params.lam", "method.params.rho"):
        assert len({p[key] for p in points}) == 4  # four different values of each, not one corner
    assert points == spread_points(space, 4, seed=0)  # seeded
    assert points != spread_points(space, 4, seed=1)
    text = coverage_text(space, 4, points)
    assert "4/36 = 11%" in text and "method.params.lam 4/6 values" in text


@pytest.mark.parametrize("samples", [7, 12, 20, 35])
def test_budget_uses_each_value_evenly_and_no_point_twice(samples):
    space = load_space(DEMO_SPACE)
    points = spread_points(space, samples, seed=3)
    assert len({tuple(p.values()) for p in points}) == samples
    for key in ("method.params.lam", "method.params.rho"):
        counts = Counter(p[key] for p in points)
        if samples <= 30:  # a balanced design exists and is found: each value floor or ceil of samples/6 times
            assert set(counts.values()) <= {samples // 6, -(-samples // 6)}, counts


def test_full_budget_and_non_grid_spaces_need_no_design():
    space = load_space(DEMO_SPACE)
    assert spread_points(space, 36, seed=0) == [] and "try every point" in coverage_text(space, 40)
    mixed = parse_space({"parameters": {"training.optimizer.lr": {"type": "loguniform", "low": 1e-3, "high": 1e-1}}})
    assert grid_size(mixed) is None and spread_points(mixed, 4, 0) == []
    assert "not a finite grid" in coverage_text(mixed, 4)


def test_tune_with_a_missing_space_fails_before_ray_starts(tmp_path, capsys, monkeypatch):
    import ray

    from app.cli import main

    # an earlier test of this process may have left the session's Ray up: what counts is that this call starts none
    initialized_before, connects = ray.is_initialized(), []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: connects.append(kwargs))
    assert main(["tune", str(ROOT / "configs" / "demo-dsimplex-hoc.yaml"), "--space", str(tmp_path / "no.yaml"),
                 "--storage", str(tmp_path / "tune")]) == 2
    assert "no.yaml: no such file" in capsys.readouterr().err
    assert connects == [] and ray.is_initialized() == initialized_before
    assert not (tmp_path / "tune").exists()
