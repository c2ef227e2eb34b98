"""app.printing.print_results: the matrix as fractions with '-' above the diagonal, then the five headline metrics."""
from __future__ import annotations

import io
import json

from app.printing import print_results


def test_matrix_and_metrics_are_printed_as_fractions():
    stream = io.StringIO()
    matrix = {"metric": "recall_at_1", "values": [[0.5, None], [0.6, 0.7]]}
    # C[1,0] = 0.6 > C[0,0] = 0.5: AC = 1; AA = (0.5 + 0.6 + 0.7) / 3 = 0.6; the extra key is not printed
    metrics = {"AC": 1.0, "AA": 0.6, "ACA": 0.6, "BC": 0.1, "FC": -0.1, "AA_tau": [0.5, 0.6]}
    print_results(matrix, metrics, stream)
    lines = stream.getvalue().splitlines()
    assert lines[0] == ("compatibility matrix (recall_at_1, fractions; rows = query model, columns = gallery "
                        "model):")
    assert lines[1] == "             1      2"
    assert lines[2] == "     1   0.500      -"
    assert lines[3] == "     2   0.600  0.700"
    assert lines[4].startswith("metrics (fractions): ")
    assert json.loads(lines[4][len("metrics (fractions): "):]) == {"AC": 1.0, "AA": 0.6, "ACA": 0.6, "BC": 0.1,
                                                                   "FC": -0.1}


def test_undefined_metrics_print_as_null():
    stream = io.StringIO()
    print_results({"metric": "map", "values": [[0.42]]}, {"AA": 0.42}, stream)
    assert stream.getvalue().splitlines()[-1] == ('metrics (fractions): {"AC": null, "AA": 0.42, "ACA": null, '
                                                  '"BC": null, "FC": null}')
