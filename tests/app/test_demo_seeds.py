"""`compat demo --seeds`: one demo per seed, each evaluated on the validation and the test pool, and the metrics of
both methods as mean and spread over the seeds (hand-worked values; a shrunk demo end to end)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from app.cli import main
from app.commands.demo import parse_seeds, seed_passes
from pipelines.reports.seed_spread import format_table, spread, summarise

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from demo_shrink import SHRINK  # noqa: E402  (the shrunk demo of tests/cluster/test_demo.py)


def test_parse_seeds_and_refuse_bad_lists():
    assert parse_seeds("0,1,2") == [0, 1, 2] and parse_seeds(" 7 , 3") == [7, 3]
    with pytest.raises(ValueError, match=r"--seeds: expected comma-separated integers >= 0 .* got '-1'"):
        parse_seeds("0,-1")
    with pytest.raises(ValueError, match="seed 1 is listed twice"):
        parse_seeds("1,1")


def test_spread_and_table_hand_worked():
    # 0.25, 0.5, 0.75: mean 0.5, sample variance (0.0625 + 0 + 0.0625) / 2 = 0.0625, std 0.25
    assert spread([0.25, 0.5, 0.75]) == {"mean": 0.5, "std": 0.25, "min": 0.25, "max": 0.75, "n": 3}
    assert spread([0.4]) == {"mean": 0.4, "std": 0.0, "min": 0.4, "max": 0.4, "n": 1}
    records = [{"seed": seed, "pool": pool, "method": "er",
                "metrics": {"AC": ac, "AA": 0.5, "ACA": None, "BC": -0.1 * seed, "FC": 0.0}}
               for pool in ("validation", "test") for seed, ac in ((0, 0.25), (1, 0.5), (2, 0.75))]
    rows = summarise(records)
    assert [(row["pool"], row["method"], row["seeds"]) for row in rows] == [("validation", "er", [0, 1, 2]),
                                                                          ("test", "er", [0, 1, 2])]
    assert rows[0]["AC"]["mean"] == 0.5 and rows[0]["AC"]["std"] == 0.25
    assert rows[0]["AC"]["per_seed"] == [0.25, 0.5, 0.75]
    assert rows[0]["ACA"] == {"per_seed": [None, None, None]}  # no value, no spread
    assert math.isclose(rows[1]["BC"]["std"], 0.1) and rows[1]["BC"]["min"] == -0.2
    table = format_table(rows).splitlines()
    assert table[0] == "| pool | method | seeds | AC | AA | ACA | BC | FC |"
    assert table[2] == ("| validation | er | 0,1,2 | 0.500 ± 0.250 (0.250 to 0.750) | 0.500 ± 0.000 (0.500 to 0.500) | - | "
                        "-0.100 ± 0.100 (-0.200 to -0.000) | 0.000 ± 0.000 (0.000 to 0.000) |")


def test_passes_test_first_then_validation_beside_it():
    passes = seed_passes([3, 1], ["training.epochs=2"], "runs/demo/")
    assert [(seed, pool, output) for seed, pool, _, output in passes] == [
        (3, "test", "runs/demo/seed-3"), (3, "validation", "runs/demo/seed-3/validation"),
        (1, "test", "runs/demo/seed-1"), (1, "validation", "runs/demo/seed-1/validation")]
    assert passes[0][2] == ["training.epochs=2", "seed=3"]
    assert passes[1][2] == ["training.epochs=2", "seed=3", "evaluation.query_set.split=val-query",
                            "evaluation.gallery_set.split=val-gallery",
                            "output.shared_store=runs/demo/seed-3/third-party"]


@pytest.mark.timeout(900)
def test_demo_seeds_runs_each_seed_on_both_pools_and_writes_the_spread(tmp_path, capsys):
    output = tmp_path / "demo"
    sets = [argument for value in SHRINK for argument in ("--set", value)]
    assert main(["demo", "--seeds", "0,1", "--output", str(output), "--executor", "local", "--jobs", "1",
                 "--tracking-uri", "none", "--no-progress", *sets]) == 0
    printed = capsys.readouterr().out
    assert printed.count("#### seed 0, validation pool (queries val-query, gallery val-gallery) ####") == 1
    assert printed.count("#### seed 1, test pool (queries test-query, gallery test-gallery) ####") == 1
    # the criteria judge the test pool only: once per seed's test pass, once on the means
    assert printed.count("demo criteria (README): ") == 2
    assert "demo criteria (README) on the test pool's means over the seeds: " in printed
    # the validation pass trains nothing: the test pass's models are copied (same keys), only the validation
    # pool's extractions, entries and rows run (3 tasks: 6 extractions, 6 entries, 3 rows)
    lines = [line for line in printed.splitlines() if line.startswith("== ")]
    assert len(lines) == 8  # 2 seeds x 2 pools x 2 methods
    for line in lines[2:4] + lines[6:8]:
        assert "/validation/" in line and "15 stages run, 4 already done" in line, line
    for seed in (0, 1):
        for method in ("er", "dsimplex-hoc"):
            test_dir, val_dir = output / f"seed-{seed}" / method, output / f"seed-{seed}" / "validation" / method
            trained = sorted(path.name for path in (test_dir / "manifests").iterdir()
                             if path.name.startswith(("pretrain-", "finetune-", "replace-")))
            assert len(trained) == 4 and all((val_dir / "manifests" / name).is_file() for name in trained)
            assert "split: val-query" in (val_dir / "config.yaml").read_text()
            assert "split: test-query" in (test_dir / "config.yaml").read_text()

    document = json.loads((output / "seeds.json").read_text())
    assert [(run["seed"], run["pool"], run["method"]) for run in document["runs"]] == [
        (seed, pool, method) for seed in (0, 1) for pool in ("test", "validation") for method in ("er", "dsimplex-hoc")]
    for run in document["runs"]:  # each record is its run folder's metrics
        stored = json.loads((Path(run["run_dir"]) / "metrics.json").read_text())
        assert run["metrics"]["AC"] == stored["AC"] and run["metrics"]["AA"] == stored["AA"], run
    # the spread recomputed from the per-run records
    for row in document["rows"]:
        values = [run["metrics"]["AA"] for run in document["runs"]
                  if (run["pool"], run["method"]) == (row["pool"], row["method"])]
        mean = sum(values) / 2
        assert math.isclose(row["AA"]["mean"], mean)
        assert math.isclose(row["AA"]["std"], math.sqrt(sum((v - mean) ** 2 for v in values)))
        assert row["AA"]["min"] == min(values) and row["AA"]["max"] == max(values)
    table = (output / "seeds.md").read_text()
    assert table.count("| validation |") == 2 and table.count("| test |") == 2 and table in printed + "\n"
