"""Which grid points a search budget smaller than the grid tries, and how much of the space that covers.

A search whose parameters are all unconditional categoricals is a finite grid. Enumerating it in order (what a
brute-force sampler does) spends a small budget in one corner: 4 trials of a 6 x 6 lambda x rho grid all tried the
same lambda. A budget of n < grid size is instead spread out (seeded): every parameter's values are used as evenly
as possible (each value ``floor(n/k)`` or ``ceil(n/k)`` times), combined in a seeded random order, with no point
twice. The points are enqueued as the search's first trials.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

MAX_TRIES = 200


def is_grid(space: Any) -> bool:
    """True when every parameter is an unconditional categorical (the space is a finite grid)."""
    parameters = list(getattr(space, "parameters", []))
    return bool(parameters) and all(p.type == "categorical" and not p.when for p in parameters)


def grid_size(space: Any) -> int | None:
    """Number of grid points, None when the space is not a finite grid."""
    return math.prod(len(p.values) for p in space.parameters) if is_grid(space) else None


def spread_points(space: Any, samples: int, seed: int) -> list[dict[str, Any]]:
    """``samples`` distinct grid points with every parameter's values used evenly (see the module doc); [] when
    the space is not a grid or the budget covers the whole grid (then every point is tried anyway)."""
    size = grid_size(space)
    if size is None or samples >= size or samples < 1:
        return []
    rng = np.random.default_rng(seed)
    best: list[tuple] = []
    for _ in range(MAX_TRIES):
        columns = []
        for parameter in space.parameters:
            values = list(parameter.values)
            order = rng.permutation(len(values))
            column = [values[order[i % len(values)]] for i in range(samples)]
            columns.append([column[i] for i in rng.permutation(samples)])
        points = list(dict.fromkeys(zip(*columns)))  # distinct, first occurrence kept
        if len(points) > len(best):
            best = points
        if len(best) == samples:
            break
    if len(best) < samples:  # fill with unused grid points, seeded (only for budgets close to the grid size)
        import itertools

        unused = [p for p in itertools.product(*(p.values for p in space.parameters)) if p not in set(best)]
        for index in rng.permutation(len(unused))[:samples - len(best)]:
            best.append(unused[index])
    keys = [p.key for p in space.parameters]
    return [dict(zip(keys, point)) for point in best]


def coverage_text(space: Any, samples: int, points: list[dict[str, Any]] | None = None) -> str:
    """One line saying how much of the space ``samples`` trials cover (points: the spread design, if any)."""
    size = grid_size(space)
    if size is None:
        kinds = ", ".join(f"{p.key} ({p.type}{', conditional' if p.when else ''})" for p in space.parameters)
        return (f"search space: {kinds}; not a finite grid, so {samples} trials are proposed by seeded TPE "
                f"(coverage is not enumerable)")
    if samples >= size:
        return f"search space: {size} grid points; {samples} trials try every point"
    points = points if points is not None else spread_points(space, samples, 0)
    per_key = ", ".join(f"{p.key} {len({point[p.key] for point in points})}/{len(p.values)} values"
                        for p in space.parameters)
    return (f"search space: {size} grid points; {samples} trials cover {samples}/{size} = {samples / size:.0%} of "
            f"them, spread out (seeded): {per_key}")


__all__ = ["coverage_text", "grid_size", "is_grid", "spread_points"]
