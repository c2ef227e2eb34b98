"""End to end: a search logged to a real `mlflow server`, its UI driven by headless Chromium (Debian's package).

The experiment's runs table must show the search's parent run with its trials nested under it and the objective as a
column. A screenshot is written to the test's tmp folder and copied to tests/.artifacts/ for people to look at.
"""
from __future__ import annotations

import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
# flags that work as root on a closed network (see the shared ENVIRONMENT notes)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
sys.path.insert(0, str(ROOT / "tests" / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402
from local_services import wait_for_ui  # noqa: E402


def _require_chromium() -> None:
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is not installed (/usr/bin/chromium); the setup command installs it with "
                    "`apt-get install -y chromium`")


@contextmanager
def browser_page(url: str, profile: Path, viewport: dict):
    """Headless Chromium on ``url``; ``profile`` is a fresh, empty folder (Playwright passes it to Chromium as
    --user-data-dir). The browser is closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS, viewport=viewport)
        try:
            page = browser.new_page()
            page.goto(url, wait_until="load")
            yield page
        finally:
            browser.close()


def runs_page(tracking_uri: str, experiment_id: str, profile: Path, viewport: dict):
    """Headless Chromium on the runs table of an experiment (see :func:`browser_page`)."""
    return browser_page(f"{tracking_uri}/#/experiments/{experiment_id}/runs", profile, viewport)


def keep_screenshot(screenshot: Path) -> Path:
    """Copy a screenshot to tests/.artifacts/ (git-ignored) for people to look at; returns the copy's path."""
    stable = ROOT / "tests" / ".artifacts" / screenshot.name
    stable.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(screenshot, stable)
    return stable


def test_mlflow_ui_shows_trials_nested_with_the_objective(ray_local, mlflow_server, tmp_path):
    _require_chromium()
    from mlflow import MlflowClient

    from cluster.tune.runner import run_search
    from cluster.tune.spec import SearchSpec
    from pipelines.config.load import config_to_dict, validate_config

    tiny.register()
    base = config_to_dict(validate_config(tiny.scenario("dsimplex-hoc", {"lam": 0.1, "rho": 10.0})))
    base["tasks"]["spec"] = "2+2"
    base["replacements"] = []
    spec = SearchSpec(name="ui-search", base_config=base, objective="AA", samples=2, concurrent=2,
                      scheduler="none", storage=str(tmp_path / "searches"), resources={"cpu": 0.5, "gpu": 0.0},
                      plugins=[f"{ROOT / 'tests' / 'pipelines' / 'tiny_scenario_helpers.py'}:register"],
                      space={"parameters": {"method.params.lam": {"type": "categorical", "values": [0.0, 1.0]}}},
                      tracking_uri=mlflow_server.tracking_uri, mlflow_experiment="ui-search-experiment")
    outcome = run_search(spec)
    assert outcome.complete and len(outcome.trials) == 2
    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    experiment_id = client.get_experiment_by_name("ui-search-experiment").experiment_id
    trial_runs = {run.info.run_name: run for run in client.search_runs([experiment_id], "tags.run_role = 'trial'")}
    assert len(trial_runs) == 2

    screenshot = tmp_path / "mlflow-ui-search.png"
    viewport = {"width": 1920, "height": 900}
    with runs_page(mlflow_server.tracking_uri, experiment_id, tmp_path / "profile", viewport) as page:
        parent_row = page.get_by_role("row").filter(has_text=spec.name)
        parent_row.wait_for(timeout=60_000)
        # before expanding, the table lists only the parent (trials are nested under it)
        for name in trial_runs:
            assert page.get_by_role("row").filter(has_text=name).count() == 0
        page.get_by_role("button", name="Columns").click()
        page.get_by_text("objective", exact=True).first.click()  # the metric's entry in the Columns menu
        page.keyboard.press("Escape")
        parent_row.locator("button").first.click()  # the expander in front of the parent's name
        header = page.locator('[role="columnheader"][col-id="metrics.`objective`"]')
        header.wait_for(timeout=30_000)
        for name in trial_runs:
            page.get_by_role("row").filter(has_text=name).first.wait_for(timeout=30_000)
        _close_side_panel(page)  # MLflow 3's assistant panel would hide the objective column in the picture
        header.scroll_into_view_if_needed()
        page.screenshot(path=str(screenshot), full_page=True)
        for name, run in trial_runs.items():
            # ag-grid renders the pinned name column and the scrolling columns as separate rows sharing row-index
            index = page.get_by_role("row").filter(has_text=name).first.get_attribute("row-index")
            cell = page.locator(f'[role="row"][row-index="{index}"] [role="gridcell"][col-id="metrics.`objective`"]')
            shown = float(cell.first.inner_text().strip())
            value = run.data.metrics["objective"]
            assert shown == pytest.approx(value, abs=5e-3), f"{name}: UI shows {shown}, MLflow has {value}"
    stable = keep_screenshot(screenshot)
    print(f"MLflow UI screenshot: {stable}")
    assert screenshot.stat().st_size > 10_000


def _close_side_panel(page) -> None:
    """Close the "MLflow Assistant" side panel when this MLflow version opens it (the screenshot is for people)."""
    panel = page.get_by_text("MLflow Assistant", exact=False)
    if panel.count() == 0:
        return
    heading = panel.first.locator("xpath=ancestor::div[.//button][1]")
    buttons = heading.get_by_role("button")
    if buttons.count():
        buttons.last.click()  # the close (x) button ends the panel's header row
        page.wait_for_timeout(300)


@pytest.fixture(scope="module")
def compared_runs(mlflow_server, tmp_path_factory):
    """Both demo scenarios (shrunk: tiny data, 2 tasks, 1 epoch) run by `compat run --experiment` into one
    experiment: (experiment id, {run id: scenario}, {scenario: metrics.json})."""
    import json

    import torch
    import yaml
    from mlflow import MlflowClient

    from app.cli import main

    tiny.register()
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("ui-compare")
    experiment = "ui-demo-compare"
    metrics = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
        for method in ("er", "dsimplex-hoc"):  # the demo's two scenarios, shrunk like the other tiny tests
            document = tiny.scenario(method, output=str(folder / method))
            document["name"] = f"demo-{method}"
            document.pop("pretrain")
            document["replacements"] = []
            document["tasks"]["spec"] = "2+2"
            config = folder / f"{method}.yaml"
            config.write_text(yaml.safe_dump(document))
            assert main(["run", str(config), "--tracking-uri", mlflow_server.tracking_uri, "--experiment",
                         experiment, "--no-progress"]) == 0
            metrics[f"demo-{method}"] = json.loads((folder / method / "metrics.json").read_text())
    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    parents = client.search_runs([experiment_id], "tags.run_role = 'pipeline'")
    run_scenario = {run.info.run_id: run.data.tags["scenario"] for run in parents}
    assert sorted(run_scenario.values()) == ["demo-dsimplex-hoc", "demo-er"]
    return experiment_id, run_scenario, metrics


def _open_compare_view(page) -> list[str]:
    """Select both demo runs in the runs table and open MLflow's compare-runs page; the runs' table colours."""
    colours = []
    for scenario in ("demo-er", "demo-dsimplex-hoc"):
        row = page.get_by_role("row").filter(has_text=f"{scenario}-").first
        row.wait_for(timeout=60_000)
        colours += re.findall(r"#[0-9a-f]{6}", row.inner_text())
        row.get_by_role("checkbox").first.check(force=True)  # ag-grid's row selection box
    page.get_by_role("button", name="Compare").first.click()
    page.locator('a[title="Plot chart"]').first.wait_for(timeout=60_000)
    _close_side_panel(page)
    return colours


def test_mlflow_ui_compares_the_er_and_dsimplex_hoc_runs_of_one_experiment(mlflow_server, compared_runs, tmp_path):
    """Both demo runs are selected in the runs table and MLflow's compare view opened; the
    AC and AA it shows for each run equal that run's metrics.json (the page rounds to 3 decimals)."""
    _require_chromium()
    experiment_id, run_scenario, metrics = compared_runs
    assert metrics["demo-er"]["AA"] != metrics["demo-dsimplex-hoc"]["AA"]  # so a swapped column would be caught

    screenshot = tmp_path / "mlflow-ui-compare-demo-runs.png"
    heatmap_shot = tmp_path / "mlflow-ui-compare-heatmaps.png"
    viewport = {"width": 1600, "height": 1000}
    with runs_page(mlflow_server.tracking_uri, experiment_id, tmp_path / "profile", viewport) as page:
        colours = _open_compare_view(page)
        # each run shows its chart colour; MLflow picks it by hashing the run id into a palette of 29, so two runs
        # share one about once in 29 searches (seen in CI: both '#f2be88') - distinctness is not MLflow's promise
        assert len(colours) == 2
        shown = page.evaluate(_READ_COMPARE_VIEW)
        # for the picture: fold the long Parameters section so run names and metrics are on one screen
        page.get_by_text("Parameters", exact=True).first.click()
        page.locator('a[title="Plot chart"]', has_text="FC").first.scroll_into_view_if_needed()
        page.screenshot(path=str(screenshot))
        # the compare view's Artifacts section offers the heatmap (a top-level file of both runs) and shows it for
        # each run side by side
        before = len(page.evaluate(_LOADED_PICTURES))  # large pictures on the page before the heatmap is chosen
        entry = page.get_by_text("matrix.png", exact=True).first
        entry.scroll_into_view_if_needed()
        entry.click()
        # MLflow fetches each run's file and shows it from a blob: URL, one image per run column
        try:
            page.wait_for_function(f"{_LOADED_PICTURES}.length >= {before + 2}", timeout=90_000)
        except Exception:
            page.screenshot(path=str(heatmap_shot), full_page=True)
            print(f"compare view when the heatmaps did not show: {keep_screenshot(heatmap_shot)}")
            raise
        sources = page.evaluate(_LOADED_PICTURES)[before:]
        page.evaluate("[...document.querySelectorAll('img')].filter(img => img.naturalWidth > 100)[0]"
                      ".scrollIntoView()")
        page.screenshot(path=str(heatmap_shot))
    assert sorted(shown["runs"]) == sorted(run_scenario)
    for column, run_id in enumerate(shown["runs"]):
        expected = metrics[run_scenario[run_id]]
        for name in ("AC", "AA"):
            value = float(shown["metrics"][name][column])
            assert value == pytest.approx(expected[name], abs=5e-4), f"{run_scenario[run_id]} {name}: UI {value}"
    assert len(sources) == 2, sources  # two heatmaps, one per compared run
    stable = keep_screenshot(screenshot)
    print(f"MLflow compare view screenshots: {stable}, {keep_screenshot(heatmap_shot)}")


def test_parallel_coordinates_of_two_pipeline_runs_show_the_summary_metrics(mlflow_server, compared_runs, tmp_path):
    """The compare-runs page's parallel-coordinates plot of the two demo runs starts with AC as its metric axis
    (MLflow plots the first metric the runs share; a pipeline run logs its summary metrics first) and no task/*
    metric; AA is one choice in its Metrics box away. The experiment's results view (what `compat ui` opens) has a
    parallel-coordinates chart of the method against AC, AA, BC and FC for the runs shown."""
    _require_chromium()
    from cluster.tracking.ui import ui_page_url

    experiment_id, run_scenario, metrics = compared_runs
    # axis titles: plotly's parcoords on the compare-runs page, MLflow's own (d3) one in the charts view
    titles_js = ("(() => [...document.querySelectorAll('.parcoords .y-axis .axis-heading .axis-title, "
                 ".parcoords .dimension .axis .label')].map(t => t.textContent.trim()))()")
    compare_shot, chart_shot = tmp_path / "mlflow-ui-compare-parallel.png", tmp_path / "mlflow-ui-results-parallel.png"
    viewport = {"width": 1600, "height": 1000}
    with runs_page(mlflow_server.tracking_uri, experiment_id, tmp_path / "profile", viewport) as page:
        _open_compare_view(page)
        plot = page.locator(".pcp-plot")
        plot.first.scroll_into_view_if_needed()
        page.wait_for_function(f"{titles_js}.length > 0", timeout=60_000)
        default_axes = page.evaluate(titles_js)
        # the panel's Metrics box: AA added by hand (MLflow offers no way to preselect a second metric)
        metrics_box = page.locator(".pcp-plot").first.locator("xpath=preceding::*[normalize-space(text())="
                                                                "'Metrics:']/following::*[@role='combobox'][1]")
        metrics_box.first.click()
        page.get_by_title("AA", exact=True).last.click()   # the list's visible item (the role=option one is not)
        page.keyboard.press("Escape")
        page.wait_for_function(f"{titles_js}.includes('AA')", timeout=30_000)
        page.locator(".pcp-plot").first.scroll_into_view_if_needed()
        page.screenshot(path=str(compare_shot))
        ticks = page.evaluate("(() => [...document.querySelectorAll('.parcoords .y-axis')].map(axis => "
                              "[axis.querySelector('.axis-title')?.textContent.trim(), [...axis.querySelectorAll("
                              "'.tick text')].map(t => t.textContent.trim())]))()")
        page.goto(f"{ui_page_url(mlflow_server.tracking_uri, experiment_id)}&compareRunsMode=CHART", wait_until="load")
        page.get_by_text("Results", exact=True).first.wait_for(timeout=60_000)
        _close_side_panel(page)
        chart = page.get_by_text("Parallel Coordinates", exact=False)   # the card's title (its plot comes later)
        try:
            page.get_by_text("Image grid", exact=True).first.wait_for(timeout=60_000)
            page.mouse.move(900, 700)   # over the charts: the view adds a card to the page once it is scrolled to
            for _ in range(20):
                if chart.count():
                    break
                page.mouse.wheel(0, 400)
                page.wait_for_timeout(500)
            chart.first.scroll_into_view_if_needed()
            page.wait_for_function(f"{titles_js}.length >= 5", timeout=60_000)
        except Exception:
            page.screenshot(path=str(chart_shot), full_page=True)
            print(f"results view when the parallel chart did not show: {keep_screenshot(chart_shot)}")
            raise
        chart_axes = page.evaluate(titles_js)
        page.locator(".parcoords").first.scroll_into_view_if_needed()
        page.screenshot(path=str(chart_shot))
    metric_axes = [title for title in default_axes if title in metrics["demo-er"] or title.startswith("task/")]
    assert metric_axes == ["AC"], default_axes
    # the AC axis covers the two runs' AC values (its ticks' range; the tiny runs' AC may be equal, even 0)
    ac_ticks = [float(t.replace("\u2212", "-")) for title, texts in ticks if title == "AC" for t in texts if t]
    low, high = sorted(metrics[name]["AC"] for name in metrics)
    assert ac_ticks and min(ac_ticks) <= low + 1e-4 and high - 1e-4 <= max(ac_ticks), (ac_ticks, low, high)
    assert {"method.name", "AC", "AA", "BC", "FC"} <= set(chart_axes), chart_axes
    print(f"MLflow parallel-coordinates screenshots: {keep_screenshot(compare_shot)}, {keep_screenshot(chart_shot)}")


# sources of the pictures the page shows, loaded and large (heatmaps; icons and avatars are smaller than 100 px)
_LOADED_PICTURES = ("(() => [...document.querySelectorAll('img')].filter(img => img.complete && img.naturalWidth > "
                    "100).map(img => img.src))()")

# The compare view's header row holds the run ids (column order); its metrics section is two virtualised grids side
# by side, metric names (links titled "Plot chart") and values, aligned by their cells' pixel offsets.
_READ_COMPARE_VIEW = """() => {
  const runs = [...document.querySelectorAll('th.data-value a[href*="/runs/"]')].map(a => a.textContent.trim());
  const links = [...document.querySelectorAll('a[title="Plot chart"]')];
  const grids = [...document.querySelectorAll('.ReactVirtualized__Grid')];
  const valueGrid = grids[grids.indexOf(links[0].closest('.ReactVirtualized__Grid')) + 1];
  const rows = {};
  for (const cell of valueGrid.querySelectorAll('.ReactVirtualized__Grid__innerScrollContainer > div')) {
    const column = Math.round(parseFloat(cell.style.left) / parseFloat(cell.style.width));
    (rows[cell.style.top] = rows[cell.style.top] || [])[column] = cell.textContent.trim();
  }
  const metrics = {};
  for (const link of links) metrics[link.textContent.trim()] = rows[link.parentElement.style.top];
  return {runs, metrics};
}"""


@contextmanager
def compat_ui(tracking_uri: str, experiment: str):
    """`compat ui --experiment NAME` over ``tracking_uri`` on a free loopback port; yields the URL it prints once the
    server answers. The server is stopped on exit."""
    import os
    import signal
    import subprocess

    from cluster.ray.local_head import free_port

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "app.cli", "ui", "--port", str(port), "--tracking-uri",
                                tracking_uri, "--experiment", experiment],
                               env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        first_line = process.stdout.readline()
        found = re.match(r"MLflow UI: (\S+)", first_line)
        assert found, first_line
        wait_for_ui(process, port, 120)
        yield found.group(1)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def test_compat_ui_opens_on_the_runs_with_their_summary_metrics_and_heatmap(tmp_path, monkeypatch):
    """A tiny run tracked into a SQLite store; the URL `compat ui --experiment` prints opens the runs table in
    model-training mode with AC AA ACA BC FC as columns (values as metrics.json has them), its chart view starts
    with the heatmaps' image grid, and the run's artifact view shows its heatmap."""
    _require_chromium()
    import json

    import torch
    import yaml
    from mlflow import MlflowClient

    from app.cli import main

    tiny.register()
    torch.set_num_threads(1)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracking_uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    document = tiny.scenario("dsimplex-hoc", output=str(tmp_path / "run"))
    document["name"] = "ui-open"
    document.pop("pretrain")
    document["replacements"] = []
    document["tasks"]["spec"] = "2+2"
    config = tmp_path / "ui-open.yaml"
    config.write_text(yaml.safe_dump(document))
    assert main(["run", str(config), "--tracking-uri", tracking_uri, "--experiment", "ui-open", "--no-progress"]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    client = MlflowClient(tracking_uri)
    experiment_id = client.get_experiment_by_name("ui-open").experiment_id
    run_id = client.search_runs([experiment_id], "tags.run_role = 'pipeline'")[0].info.run_id

    screenshot, heatmap_shot = tmp_path / "mlflow-ui-runs-table.png", tmp_path / "mlflow-ui-run-heatmap.png"
    with compat_ui(tracking_uri, "ui-open") as url:
        assert f"#/experiments/{experiment_id}/runs?" in url and "workflowType=machine_learning" in url
        with browser_page(url, tmp_path / "profile", {"width": 1600, "height": 900}) as page:
            shown = {}
            for name in ("AC", "AA", "ACA", "BC", "FC"):  # columns of the view the URL opens, none chosen by hand
                page.locator(f'[role="columnheader"][col-id="metrics.`{name}`"]').wait_for(timeout=60_000)
            row = page.get_by_role("row").filter(has_text="ui-open-").first
            index = row.get_attribute("row-index")
            for name in ("AC", "AA"):
                cell = page.locator(f'[role="row"][row-index="{index}"] [role="gridcell"][col-id="metrics.`{name}`"]')
                shown[name] = float(cell.first.inner_text().strip())
            assert page.get_by_text("Model training").count() and page.get_by_text("Traces 0").count() == 0
            _close_side_panel(page)
            page.screenshot(path=str(screenshot))
            # the same view's chart mode starts with the summary metrics and the heatmaps' image grid
            page.goto(f"{url}&compareRunsMode=CHART")
            page.get_by_text("Results", exact=True).first.wait_for(timeout=60_000)
            page.wait_for_function(f"{_LOADED_PICTURES}.some(src => src.includes('compat_matrix'))", timeout=60_000)
            charts_shot = tmp_path / "mlflow-ui-results-charts.png"
            page.screenshot(path=str(charts_shot))
            page.goto(f"{url.split('/#/')[0]}/#/experiments/{experiment_id}/runs/{run_id}/artifacts/matrix.png")
            # the artifact view shows a file from a blob: URL (the charts' pictures come from get-artifact)
            page.wait_for_function(f"{_LOADED_PICTURES}.some(src => src.startsWith('blob:'))", timeout=60_000)
            heatmaps = [src for src in page.evaluate(_LOADED_PICTURES) if src.startswith("blob:")]
            page.screenshot(path=str(heatmap_shot))
    for name, value in shown.items():
        assert value == pytest.approx(metrics[name], abs=5e-4), f"{name}: UI {value}, metrics.json {metrics[name]}"
    assert heatmaps, "the artifact view shows no heatmap"
    print(f"MLflow UI screenshots: {keep_screenshot(screenshot)}, {keep_screenshot(charts_shot)}, "
          f"{keep_screenshot(heatmap_shot)}")
