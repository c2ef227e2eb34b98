"""What makes a pipeline run readable in the MLflow UI without configuring it.

- **Comparable pictures.** MLflow's compare view ("Artifacts") offers only files that every compared run has at the
  *top level* of its artifacts (folders are skipped), so a heatmap kept in ``results/`` alone reads "No common
  artifacts to display". ``matrix.png`` and ``aa_tau.png`` are therefore also logged at the top level, and as MLflow
  images under one key each (``compat_matrix``, ``compat_aa_tau``), which the charts view shows side by side.
- **Headline metrics in the run list.** The runs table shows run names but no metric column until the user picks
  one, so a finished pipeline run's name ends with its headline metrics (``AC 0.952 AA 0.657 BC 0.047 FC -0.061``);
  the metrics themselves are logged as usual.
- **The runs table first.** MLflow 3 opens on a GenAI home page; the experiments the product uses are marked as
  model-training experiments (:func:`cluster.tracking.client.ensure_experiment`) and ``compat ui`` prints the URL of
  the experiments list (or one experiment's runs) in the UI's model-training mode (:func:`ui_page_url`). Each
  experiment also holds a view (MLflow's shared view state, :data:`RESULTS_VIEW`) whose runs table has the summary
  metrics AC AA ACA BC FC as columns and whose chart view starts with them and the heatmaps; that URL opens it.
- **Parallel coordinates of the results.** MLflow's compare-runs page (select runs, "Compare") plots by default
  the (at most three, alphabetically first) params whose values differ between the runs against ONE metric: the
  first one the runs share, in the order the server lists the first run's metrics, which is the order they were
  first logged. A pipeline run therefore logs its summary metrics first, as NaN at step 0 ("not computed yet"; the
  result is the value at the last task's step, which is what the runs table and charts show), so that plot starts
  with AC. The page offers no way to choose more default metrics (AA is one click in its "Metrics" box); the
  :data:`RESULTS_VIEW` chart view therefore also holds a parallel-coordinates chart of the method against AC, AA,
  BC and FC.
- **Links to the registered model versions.** A version is created from the stage run that trained it, so the
  pipeline (parent) run's page lists none; its description (``mlflow.note.content``) links each version, and the
  tag ``registered_versions`` lists them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

HEADLINE = ("AC", "AA", "BC", "FC")
SUMMARY_METRICS = ("AC", "AA", "ACA", "BC", "FC")  # a pipeline run's headline metrics, logged as metrics
PARALLEL_PARAMS = ("method.name",)   # the parallel-coordinates chart's param axes (the config's method)
# MLflow 3's UI picks an experiment's page from this tag: the runs table and charts ("model training") rather than
# the traces overview of GenAI experiments
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
# a runs-table view stored in the experiment (MLflow's "share view" state) that shows the summary metrics as columns
RESULTS_VIEW = "compat-results"
SHARED_VIEW_TAG_PREFIX = "mlflow.sharedViewState."
COMPARABLE_IMAGES = {"matrix.png": "compat_matrix", "aa_tau.png": "compat_aa_tau"}
NAME_SEPARATOR = " | "
MODEL_TRAINING_VIEW = "workflowType=machine_learning"  # the UI's mode of model training (GenAI is its default)


def experiment_ui_tags() -> dict[str, str]:
    """Tags of an experiment the product uses: a model-training experiment, with the view :data:`RESULTS_VIEW`
    whose runs table has the summary metrics (AC, AA, ACA, BC, FC) as columns and whose chart view starts with a
    "Results" section: a bar chart per summary metric, the heatmaps' image grid and a parallel-coordinates chart of
    the method against AC, AA, BC and FC (MLflow adds the other metrics'
    charts after it)."""
    section = "compat-results"
    charts = [{"uuid": f"compat-{name}", "type": "BAR", "metricSectionId": section, "metricKey": name,
               "dataAccessKey": name, "isGenerated": False, "deleted": False} for name in SUMMARY_METRICS]
    charts.append({"uuid": "compat-heatmaps", "type": "IMAGE", "metricSectionId": section,
                   "imageKeys": list(COMPARABLE_IMAGES.values()), "step": 0, "showRunParams": False,
                   "isGenerated": False, "deleted": False})
    charts.append({"uuid": "compat-parallel", "type": "PARALLEL", "metricSectionId": section,
                   "selectedParams": list(PARALLEL_PARAMS), "selectedMetrics": list(HEADLINE), "showAllRuns": False,
                   "isGenerated": False, "deleted": False})
    view = {"selectedColumns": [f"metrics.`{name}`" for name in SUMMARY_METRICS],
            "compareRunSections": [{"uuid": section, "name": "Results", "display": True, "isReordered": False}],
            "compareRunCharts": charts}
    return {EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND, f"{SHARED_VIEW_TAG_PREFIX}{RESULTS_VIEW}": json.dumps(view)}


def summary_placeholders() -> dict[str, float]:
    """The summary metrics as NaN, logged at step 0 when a pipeline run starts so that they are its first metrics
    (the compare-runs page plots the first metric the compared runs share); the result overwrites them at the last
    task's step."""
    return {name: float("nan") for name in SUMMARY_METRICS}


def ui_page_url(base: str, experiment_id: str | None = None) -> str:
    """URL of the MLflow UI at ``base`` on the experiments list, or on the runs table of ``experiment_id`` in the
    view :data:`RESULTS_VIEW`, in the UI's model-training mode."""
    if experiment_id is None:
        return f"{base.rstrip('/')}/#/experiments?{MODEL_TRAINING_VIEW}"
    return (f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={RESULTS_VIEW}&"
            f"{MODEL_TRAINING_VIEW}")


def log_comparable_images(client: Any, run_id: str, folder: str | os.PathLike) -> list[str]:
    """Log the result pictures found in ``folder`` at the artifact root and as MLflow images; returns their names."""
    from PIL import Image

    logged = []
    for name, key in COMPARABLE_IMAGES.items():
        path = Path(folder, name)
        if not path.is_file():
            continue
        client.log_artifact(run_id, str(path))
        with Image.open(path) as image:
            client.log_image(run_id, image.convert("RGB"), key=key, step=0)
        logged.append(name)
    return logged


def headline_text(metrics: dict) -> str:
    """``AC 0.952 AA 0.657 BC 0.047 FC -0.061`` (fractions, 3 decimals) from a metrics.json document."""
    return " ".join(f"{name} {metrics[name]:.3f}" for name in HEADLINE if isinstance(metrics.get(name), (int, float)))


def show_headline_in_name(client: Any, run_id: str, metrics: dict) -> str:
    """Rename the run ``<name> | AC ... FC ...`` (the part after the separator is replaced on a re-run)."""
    run = client.get_run(run_id)
    base = (run.info.run_name or run_id).split(NAME_SEPARATOR)[0]
    text = headline_text(metrics)
    name = f"{base}{NAME_SEPARATOR}{text}" if text else base
    client.set_tag(run_id, "mlflow.runName", name)
    return name


def link_model_versions(client: Any, run_id: str, model_name: str | None, pipeline_id: str | None) -> list[str]:
    """Describe the run with links to the model versions this pipeline registered; returns ``['NAME/V', ...]``."""
    if not model_name or not pipeline_id or "'" in model_name:
        return []
    versions = [v for v in client.search_model_versions(f"name = '{model_name}'", max_results=1000)
                if (v.tags or {}).get("pipeline_id") == pipeline_id]
    if not versions:
        return []

    def label(version: Any) -> str:
        tags = version.tags or {}
        if tags.get("task_1based"):
            return f"task {tags['task_1based']}"
        return f"third-party ({tags.get('stage_kind', 'model')})"

    versions.sort(key=lambda v: int(v.version))
    lines = [f"Registered model versions of this run (`{model_name}`):", ""]
    lines += [f"- [{model_name} v{v.version}](#/models/{model_name}/versions/{v.version}): {label(v)}"
              for v in versions]
    listed = [f"{model_name}/{v.version}" for v in versions]
    client.set_tag(run_id, "mlflow.note.content", "\n".join(lines))
    client.set_tag(run_id, "registered_versions", ",".join(listed))
    return listed


__all__ = ["COMPARABLE_IMAGES", "EXPERIMENT_KIND_TAG", "HEADLINE", "MODEL_TRAINING_KIND", "PARALLEL_PARAMS",
           "RESULTS_VIEW", "SUMMARY_METRICS", "experiment_ui_tags", "headline_text", "link_model_versions",
           "log_comparable_images", "summary_placeholders",
           "show_headline_in_name", "ui_page_url"]
