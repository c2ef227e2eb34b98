"""`compat report`'s upgrade section: the gate verdict at each replacement without and with each adapter, and the
backfilling plot. Expected numbers are worked out by hand from the toy matrix of test_reports."""
from __future__ import annotations

import json

from test_reports import MATRIX_3, METRICS_3, make_run  # same folder: pytest puts it on sys.path

from app.cli import main


def _record(task_0based: int) -> dict:
    curve = {"fraction": [0.0, 0.5, 1.0], "recall_at_1": [0.72, 0.76, 0.80], "map": [0.5, 0.55, 0.6]}
    verdict = lambda cross: {"compatible": cross > 0.70, "cross": cross, "self_old": 0.70,  # noqa: E731
                             "margin": cross - 0.70, "self_new": 0.80, "strict": True}
    return {"task": task_0based, "baseline": {"recall_at_1": {"self_old": 0.70, "cross": 0.75, "self_new": 0.80},
                                               "map": {"self_old": 0.5, "cross": 0.45, "self_new": 0.6}},
            "adapters": {"procrustes": {"verdict": verdict(0.78)}, "fct": {"verdict": verdict(0.65)}},
            "backfill": {"start": "fct", "random": curve, "uncertainty": curve}}


def test_report_shows_gate_verdict_per_replacement_with_and_without_adapters(tmp_path, capsys):
    # replacement at task 3 (1-based): cross C[2,1] = 0.75 vs the replaced model's self-test C[1,1] = 0.70 -> pass,
    # margin +5.00 pp; re-indexing C[2,2] = 0.80
    run_dir = make_run(tmp_path / "run", MATRIX_3, METRICS_3)
    (run_dir / "adapters.json").write_text(json.dumps([_record(2)]))
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "| 3 | none | 75.00 | 70.00 | 80.00 | +5.00 | pass |" in out
    assert "| 3 | procrustes | 78.00 | 70.00 | 80.00 | +8.00 | pass |" in out
    assert "| 3 | fct | 65.00 | 70.00 | 80.00 | -5.00 | refuse |" in out
    report = (run_dir / "report.md").read_text()
    assert "## Upgrade gate at replacements" in report and "![Partial backfilling](backfill.png)" in report
    assert "50%: 76.0 / 76.0" in report
    assert (run_dir / "backfill.png").stat().st_size > 0


def test_report_without_adapters_still_shows_the_gate_verdict(tmp_path, capsys):
    run_dir = make_run(tmp_path / "run", MATRIX_3, METRICS_3, replacements=(2,))
    assert main(["report", str(run_dir)]) == 0
    # replacement at task 2: C[1,0] = 0.60 vs C[0,0] = 0.50 -> pass, +10.00 pp; re-indexing C[1,1] = 0.70
    assert "| 2 | none | 60.00 | 50.00 | 70.00 | +10.00 | pass |" in capsys.readouterr().out
    assert not (run_dir / "backfill.png").exists()
