"""Reports of a run directory (report.md, matrix.png, aa_tau.png, matrix.csv) and `compat report` / `compat compare`.

Every expected number below is worked out by hand from the small matrices defined here.
"""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from app.cli import main  # noqa: E402
from compat_core.evaluation.metrics import CompatibilityMatrix  # noqa: E402
from pipelines.reports import compare as reports_compare  # noqa: E402
from pipelines.reports import figures as reports_figures  # noqa: E402
from pipelines.reports import run_report as reports  # noqa: E402
from pipelines.results import run_files as reports_results  # noqa: E402

NAN = float("nan")

# Query model t (rows) x gallery model k (columns), fractions. Cross-tests:
#   C[1,0] = 0.60 > C[0,0] = 0.50  compatible
#   C[2,0] = 0.40 > C[0,0] = 0.50  FAILS
#   C[2,1] = 0.75 > C[1,1] = 0.70  compatible
MATRIX_3 = [[0.50, NAN, NAN], [0.60, 0.70, NAN], [0.40, 0.75, 0.80]]
# AC = 2/3 pairs; AA = (0.5+0.6+0.7+0.4+0.75+0.8)/6 = 3.75/6 = 0.625; ACA = (0.60+0.75)/3 = 0.45;
# BC = mean(0.40-0.50, 0.75-0.70) = -0.025; FC = mean(0.60-0.70, 0.75-0.80) = -0.075.
# AC_tau = [undefined, 1/1, 2/3]; AA_tau = [0.5, (0.5+0.6+0.7)/3 = 0.6, 0.625].
METRICS_3 = {"AC": 2 / 3, "AA": 0.625, "ACA": 0.45, "BC": -0.025, "FC": -0.075,
             "AC_tau": [None, 1.0, 2 / 3], "AA_tau": [0.5, 0.6, 0.625]}

# Second run: C[1,0] = 0.20 is not > C[0,0] = 0.30. AC = 0; AA = 0.9/3 = 0.3; ACA = 0;
# BC = 0.20-0.30 = -0.10; FC = 0.20-0.40 = -0.20; AA_tau = [0.3, 0.3].
MATRIX_2 = [[0.30, NAN], [0.20, 0.40]]
METRICS_2 = {"AC": 0.0, "AA": 0.3, "ACA": 0.0, "BC": -0.1, "FC": -0.2, "AC_tau": [None, 0.0], "AA_tau": [0.3, 0.3]}

LIGHT_RED = np.array([0xF7, 0xB2, 0xB2]) / 255.0


def make_run(run_dir: Path, matrix, metrics, name="toy-hoc", method="dsimplex-hoc", replacements=(3,),
             gallery="instances") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    T = len(matrix)
    record = CompatibilityMatrix(np.array(matrix, dtype=float), [f"task-{t + 1}" for t in range(T)], "recall_at_1",
                                 {"gallery": gallery, "strict": True})
    (run_dir / "matrix.json").write_text(record.to_json())
    (run_dir / "metrics.json").write_text(json.dumps({"units": "fraction", **metrics}))
    config = {"name": name, "method": {"name": method, "params": {}},
              "replacements": [{"at_task": t, "source": f"pretrain:p{t}"} for t in replacements]}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir


@pytest.fixture(scope="module")
def reported_run(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """The 3x3 run with its reports written once (rendering PNGs is the slow part)."""
    run_dir = make_run(tmp_path_factory.mktemp("runs") / "toy", MATRIX_3, METRICS_3)
    return run_dir, reports.write_reports(run_dir)


def test_write_reports_writes_every_file(reported_run):
    run_dir, paths = reported_run
    assert set(paths) == {"report", "matrix_png", "aa_tau_png", "matrix_csv"}
    assert {path.name for path in paths.values()} == {"report.md", "matrix.png", "aa_tau.png", "matrix.csv"}
    for path in paths.values():
        assert path.parent == run_dir and path.stat().st_size > 0


def test_report_md_has_the_hand_computed_numbers(reported_run):
    text = (reported_run[0] / "report.md").read_text()
    assert "# Compatibility report: toy-hoc" in text
    assert "- method: `dsimplex-hoc`" in text
    assert "1 of 3 cross-tests fail it" in text
    assert "- replacements at tasks (1-based): 3" in text
    # summary: AC fraction, AA/ACA percent, BC/FC percentage points
    assert "| AC | 0.6667 | fraction of model pairs" in text
    assert "| AA | 62.50 | percent" in text
    assert "| ACA | 45.00 | percent" in text
    assert "| BC | -2.50 | percentage points" in text
    assert "| FC | -7.50 | percentage points" in text
    # matrix in percent, failing cross-test marked, self-tests bold, replacement task tagged
    assert "| query \\ gallery | 1 | 2 | 3 (R) |" in text
    assert "| 1 | **50.00** | - | - |" in text
    assert "| 2 | 60.00 | **70.00** | - |" in text
    assert "| 3 (R) | 40.00 ✗ | 75.00 | **80.00** |" in text
    # per-task table
    assert "| 1 | n/a | 50.00 | 50.00 |  |" in text
    assert "| 2 | 1.0000 | 60.00 | 70.00 |  |" in text
    assert "| 3 | 0.6667 | 62.50 | 80.00 | replacement: `pretrain:p3` |" in text
    assert "- gallery: `instances`" in text
    assert "![Compatibility matrix](matrix.png)" in text and "(aa_tau.png)" in text
    assert "Warning" not in text


def test_matrix_csv_round_trips(reported_run):
    text = (reported_run[0] / "matrix.csv").read_text()
    record = CompatibilityMatrix.from_csv(text, metric="recall_at_1")
    np.testing.assert_array_equal(record.values, np.array(MATRIX_3))
    assert record.model_ids == ["task-1", "task-2", "task-3"]


def _pixel(image: np.ndarray, fig, ax, x: float, y: float) -> np.ndarray:
    """RGB of the PNG pixel under data point (x, y); PNG rows count from the top, display y from the bottom."""
    column, row_from_bottom = ax.transData.transform((x, y))
    return image[int(round(image.shape[0] - row_from_bottom)), int(round(column)), :3]


def test_matrix_png_shades_the_failing_cell_light_red(reported_run):
    run_dir, paths = reported_run
    image = mpimg.imread(paths["matrix_png"])
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert 400 <= image.shape[0] <= 2500 and 400 <= image.shape[1] <= 2500
    fig, ax = reports_figures.matrix_figure(reports_results.load_run(run_dir))
    fig.canvas.draw()  # lay out exactly as savefig did, so the data->pixel transform matches the file
    assert (image.shape[1], image.shape[0]) == tuple(int(v) for v in fig.canvas.get_width_height())
    # sample 0.3 of a cell below each centre, clear of the annotated number
    failing = _pixel(image, fig, ax, 0, 2 + 0.3)      # C[2,0]
    compatible = _pixel(image, fig, ax, 1, 2 + 0.3)   # C[2,1]
    self_test = _pixel(image, fig, ax, 2, 2 + 0.3)    # C[2,2]
    undefined = _pixel(image, fig, ax, 2, 0 + 0.3)    # above the diagonal
    np.testing.assert_allclose(failing, LIGHT_RED, atol=2 / 255)
    assert compatible[2] > compatible[0] + 0.2, f"compatible cross-test should be blue, got {compatible}"
    assert self_test[2] > self_test[0] + 0.2
    np.testing.assert_allclose(undefined, [1.0, 1.0, 1.0], atol=1 / 255)
    # replacement at task 3 (1-based) -> tick 2 (0-based) in colour and bold on both axes
    for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        assert [label.get_text() for label in labels] == ["1", "2", "3▸"]
        assert labels[2].get_color() == reports_figures.REPLACEMENT_COLOR and labels[2].get_fontweight() == "bold"
        assert labels[0].get_color() != reports_figures.REPLACEMENT_COLOR
    assert ax.get_xlabel() == "gallery model (task k)" and ax.get_ylabel() == "query model (task t)"
    assert "dsimplex-hoc" in ax.get_title() and "Recall@1" in ax.get_title() and "instances" in ax.get_title()
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_aa_tau_figure_plots_the_curves_and_replacements(reported_run):
    run_dir, paths = reported_run
    image = mpimg.imread(paths["aa_tau_png"])
    assert image.ndim == 3 and 300 <= image.shape[0] <= 2000 and 500 <= image.shape[1] <= 2500
    fig, (top, bottom) = reports_figures.aa_tau_figure(reports_results.load_run(run_dir))
    lines = {line.get_label(): line for line in top.get_lines()}
    np.testing.assert_allclose(lines["AA_tau"].get_ydata(), [50.0, 60.0, 62.5])
    np.testing.assert_allclose(lines["self-test of model t"].get_ydata(), [50.0, 70.0, 80.0])
    ac_line = next(line for line in bottom.get_lines() if line.get_label() == "AC_tau")
    np.testing.assert_allclose(ac_line.get_ydata(), [NAN, 1.0, 2 / 3])
    replacement_x = [line.get_xdata()[0] for line in top.get_lines() if line.get_linestyle() == "--"
                     and line.get_color() == reports_figures.REPLACEMENT_COLOR]
    assert replacement_x == [3]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_stale_metrics_json_is_reported_not_hidden(tmp_path):
    stale = dict(METRICS_3, AC=0.9)
    results = reports_results.load_run(make_run(tmp_path / "stale", MATRIX_3, stale))
    assert len(results.warnings) == 1 and "AC = 0.9" in results.warnings[0]
    text = reports.render_report_markdown(results)
    assert "**Warning**" in text and "| AC | 0.9000 |" in text


def test_single_task_run_shows_undefined_pair_metrics(tmp_path):
    metrics = {"AC": None, "AA": 0.42, "ACA": None, "BC": None, "FC": None, "AC_tau": [None], "AA_tau": [0.42]}
    results = reports_results.load_run(make_run(tmp_path / "one", [[0.42]], metrics, replacements=()))
    text = reports.render_report_markdown(results)
    assert "| AC | n/a |" in text and "| AA | 42.00 |" in text and "| FC | n/a |" in text
    assert "- replacements at tasks (1-based): none" in text
    assert results.warnings == []


@pytest.mark.parametrize("missing", ["config.yaml", "matrix.json", "metrics.json"])
def test_missing_file_is_named(tmp_path, missing):
    run_dir = make_run(tmp_path / "run", MATRIX_3, METRICS_3)
    (run_dir / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        reports_results.load_run(run_dir)


def test_malformed_metrics_name_the_key(tmp_path):
    without_aca = {key: value for key, value in METRICS_3.items() if key != "ACA"}
    with pytest.raises(KeyError, match="'ACA'"):
        reports_results.load_run(make_run(tmp_path / "a", MATRIX_3, without_aca))
    with pytest.raises(ValueError, match=r"AA: expected a fraction .*not percent"):
        reports_results.load_run(make_run(tmp_path / "b", MATRIX_3, dict(METRICS_3, AA=62.5)))
    with pytest.raises(ValueError, match=r"AA_tau must be a list of 3 values"):
        reports_results.load_run(make_run(tmp_path / "c", MATRIX_3, dict(METRICS_3, AA_tau=[0.5, 0.6])))
    with pytest.raises(ValueError, match=r"replacements\[0\]\.at_task .* 1\.\.3"):
        reports_results.load_run(make_run(tmp_path / "d", MATRIX_3, METRICS_3, replacements=(4,)))
    run_dir = make_run(tmp_path / "e", MATRIX_3, METRICS_3)
    (run_dir / "matrix.json").write_text(json.dumps({"format": "compat-matrix/1", "metric": "recall_at_1"}))
    with pytest.raises(ValueError, match=r"matrix\.json: compatibility matrix: missing key 'model_ids'"):
        reports_results.load_run(run_dir)
    run_dir = make_run(tmp_path / "f", MATRIX_3, METRICS_3)
    (run_dir / "config.yaml").write_text("name: x\nmethod: {params: {}}\n")
    with pytest.raises(ValueError, match=r"config\.yaml: method\.name"):
        reports_results.load_run(run_dir)


def test_non_strict_criterion_counts_ties_as_compatible(tmp_path):
    """C[1,0] = C[0,0] = 0.5: a tie fails the strict criterion (>) and passes the non-strict one (>=)."""
    tie = [[0.5, NAN], [0.5, 0.6]]
    strict_metrics = {"AC": 0.0, "AA": 1.6 / 3, "ACA": 0.0, "BC": 0.0, "FC": -0.1,
                      "AC_tau": [None, 0.0], "AA_tau": [0.5, 1.6 / 3]}
    strict = reports_results.load_run(make_run(tmp_path / "strict", tie, strict_metrics, replacements=()))
    assert strict.failing.tolist() == [[False, False], [True, False]] and strict.warnings == []
    lenient_dir = make_run(tmp_path / "lenient", tie, dict(strict_metrics, AC=1.0, ACA=0.5, AC_tau=[None, 1.0]),
                           replacements=())
    record = CompatibilityMatrix(np.array(tie), ["a", "b"], "recall_at_1", {"gallery": "instances", "strict": False})
    (lenient_dir / "matrix.json").write_text(record.to_json())
    lenient = reports_results.load_run(lenient_dir)
    assert not lenient.failing.any() and lenient.warnings == []
    text = reports.render_report_markdown(lenient)
    assert "C[t,k] >= C[k,k] (non-strict); 0 of 1 cross-tests fail it" in text and "| ACA | 50.00 |" in text


def test_report_command_prints_summary_and_writes_files(tmp_path, capsys):
    run_dir = make_run(tmp_path / "run", MATRIX_3, METRICS_3)
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "toy-hoc: method dsimplex-hoc, 3 tasks, Recall@1, gallery instances, replacements at tasks 3" in out
    assert "| AC | 0.6667 |" in out and "| AA | 62.50 |" in out and "| BC | -2.50 |" in out
    for name in ("report.md", "matrix.png", "aa_tau.png", "matrix.csv"):
        assert (run_dir / name).is_file()


def test_report_command_on_unfinished_run_names_the_missing_file(tmp_path, capsys):
    run_dir = make_run(tmp_path / "run", MATRIX_3, METRICS_3)
    (run_dir / "metrics.json").unlink()
    assert main(["report", str(run_dir)]) == 2
    captured = capsys.readouterr()
    assert "metrics.json: missing" in captured.err and "not a finished run directory" in captured.err
    assert not (run_dir / "report.md").exists()


def test_compare_table_csv_and_plot(tmp_path, capsys):
    first = make_run(tmp_path / "hoc", MATRIX_3, METRICS_3)
    second = make_run(tmp_path / "er", MATRIX_2, METRICS_2, name="toy-er", method="er", replacements=(2,))
    output = tmp_path / "out"
    assert main(["compare", str(first), str(second), "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    hoc_row = "| toy-hoc | dsimplex-hoc | 3 | 0.6667 | 62.50 | 45.00 | -2.50 | -7.50 | recall_at_1 / instances |"
    er_row = "| toy-er | er | 2 | 0.0000 | 30.00 | 0.00 | -10.00 | -20.00 | recall_at_1 / instances |"
    assert hoc_row in printed and er_row in printed
    markdown = (output / "compare.md").read_text()
    assert hoc_row in markdown and er_row in markdown and "![AA_tau and final metrics](compare.png)" in markdown

    rows = list(csv.DictReader(io.StringIO((output / "compare.csv").read_text())))
    assert [row["run"] for row in rows] == ["toy-hoc", "toy-er"]
    assert [row["T"] for row in rows] == ["3", "2"]
    assert float(rows[0]["AC"]) == 2 / 3 and float(rows[0]["ACA"]) == 0.45 and float(rows[0]["FC"]) == -0.075
    assert float(rows[1]["AA"]) == 0.3 and float(rows[1]["BC"]) == -0.1
    assert rows[0]["replacement_tasks"] == "3" and rows[1]["replacement_tasks"] == "2"

    image = mpimg.imread(output / "compare.png")
    assert image.ndim == 3 and 300 <= image.shape[0] <= 2000 and 600 <= image.shape[1] <= 3000


def test_compare_figure_has_every_run(tmp_path):
    summaries = reports_compare.load_runs([make_run(tmp_path / "hoc", MATRIX_3, METRICS_3),
                                   make_run(tmp_path / "er", MATRIX_2, METRICS_2, name="toy-er", method="er",
                                            replacements=())])
    fig, (curves, bars) = reports_compare.compare_figure(summaries)
    by_label = {line.get_label(): line for line in curves.get_lines()}
    np.testing.assert_allclose(by_label["toy-hoc"].get_ydata(), [50.0, 60.0, 62.5])
    np.testing.assert_allclose(by_label["toy-er"].get_ydata(), [30.0, 30.0])
    # bars: groups AC, AA, ACA for each run, in percent
    heights = sorted(round(patch.get_height(), 6) for patch in bars.patches)
    assert heights == sorted([round(100 * 2 / 3, 6), 62.5, 45.0, 0.0, 30.0, 0.0])
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_compare_legend_names_the_ring_only_where_a_replacement_is_drawn(tmp_path):
    import matplotlib.pyplot as plt

    def legend_labels(replacements):
        runs = reports_compare.load_runs([make_run(tmp_path / f"r{len(replacements)}", MATRIX_2, METRICS_2,
                                                   replacements=replacements)])
        fig, (curves, _) = reports_compare.compare_figure(runs)
        labels = [text.get_text() for text in curves.get_legend().get_texts()]
        plt.close(fig)
        return labels

    assert "replacement enters (ring)" not in legend_labels(())
    assert "replacement enters (ring)" in legend_labels((2,))


def test_eval_variant_folder_uses_the_run_config(tmp_path):
    """`compat eval` writes RUN/eval-<variant>/{matrix,metrics}.json without a config.yaml of its own."""
    run_dir = make_run(tmp_path / "run", MATRIX_3, METRICS_3)
    variant = tmp_path / "run" / "eval-recall_at_1-class_means-fine"
    make_run(variant, MATRIX_3, METRICS_3, name="ignored", replacements=(2,), gallery="class_means")
    (variant / "config.yaml").unlink()
    results = reports_results.load_run(variant)
    assert results.name == "toy-hoc/eval-recall_at_1-class_means-fine"
    assert results.gallery == "class_means" and results.replacement_tasks == [3]  # replacements: the run's config
    assert results.run_dir == variant and results.warnings == []
    assert main(["report", str(run_dir / "missing-variant")]) == 2


def test_compare_disambiguates_runs_with_the_same_name(tmp_path):
    a = make_run(tmp_path / "a", MATRIX_3, METRICS_3)
    b = make_run(tmp_path / "b", MATRIX_2, METRICS_2, replacements=())
    labels = [s.label for s in reports_compare.load_runs([a, b])]
    assert labels == [f"toy-hoc ({a})", f"toy-hoc ({b})"]


def test_compare_accepts_a_registered_source(tmp_path, monkeypatch):
    """A search experiment directory (several runs per input) plugs in through RUN_SOURCES."""
    trials = [make_run(tmp_path / "search" / f"trial_{i}", MATRIX_2, METRICS_2, name=f"trial-{i}", replacements=())
              for i in (0, 1)]
    (tmp_path / "search" / "experiment_state.json").write_text("{}")
    source = reports_compare.RunSource(
        description="test search directory",
        matches=lambda path: (path / "experiment_state.json").is_file(),
        load=lambda path: [reports_results.load_run(trial) for trial in sorted(path.glob("trial_*"))],
    )
    monkeypatch.setitem(reports_compare.RUN_SOURCES._entries, "test-search", source)
    summaries = reports_compare.load_runs([tmp_path / "search", make_run(tmp_path / "single", MATRIX_3, METRICS_3)])
    assert [s.name for s in summaries] == ["trial-0", "trial-1", "toy-hoc"]
    assert summaries[0].source == str(trials[0]) and math.isclose(summaries[2].headline["AC"], 2 / 3)


def test_compare_command_errors(tmp_path, capsys):
    good = make_run(tmp_path / "good", MATRIX_3, METRICS_3)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", str(good), str(empty), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "compat compare: error:" in err and "config.yaml: missing" in err
    assert not (tmp_path / "out" / "compare.md").exists()
    with pytest.raises(SystemExit) as exit_info:  # argparse: at least one RUN_DIR
        main(["compare"])
    assert exit_info.value.code == 2


def test_compare_default_output_is_a_folder_next_to_the_runs_not_the_current_directory(tmp_path, capsys,
                                                                                       monkeypatch):
    runs = tmp_path / "runs"
    first = make_run(runs / "hoc", MATRIX_3, METRICS_3)
    second = make_run(runs / "er", MATRIX_2, METRICS_2, name="toy-er", method="er", replacements=(2,))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["compare", str(first), str(second)]) == 0
    assert list(elsewhere.iterdir()) == []
    folder = runs / "compare-hoc-er"
    assert (folder / "compare.md").is_file() and (folder / "compare.png").is_file()
    assert f"wrote: {folder / 'compare.md'}" in capsys.readouterr().out
