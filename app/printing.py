"""Printing shared by the commands that end with a run's results: the compatibility matrix and its metrics."""
from __future__ import annotations

import json
import sys


def print_results(matrix: dict, metrics: dict, stream=None) -> None:
    """Print the matrix (fractions, '-' above the diagonal) and the scalar metrics."""
    stream = stream or sys.stdout
    values = matrix["values"]
    print(f"compatibility matrix ({matrix['metric']}, fractions; rows = query model, columns = gallery model):",
          file=stream)
    print("        " + " ".join(f"{j + 1:>6}" for j in range(len(values))), file=stream)
    for i, row in enumerate(values):
        cells = " ".join("     -" if v is None else f"{v:6.3f}" for v in row)
        print(f"  {i + 1:>4}  {cells}", file=stream)
    scalars = {k: metrics.get(k) for k in ("AC", "AA", "ACA", "BC", "FC")}
    print("metrics (fractions): " + json.dumps(scalars), file=stream)


__all__ = ["print_results"]
