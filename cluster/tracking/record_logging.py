"""What each committed stage record and a complete run's results log to MLflow: training curves, model artifacts
and registered versions, feature-extraction speed, adapter cross-tests and backfilling curves, matrix rows, and the
run's summary metrics and result files. :class:`StageRecordLogging` is the part of the MLflow tracker that does it."""
from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from cluster.model_registry.versions import (
    LATEST_ALIAS,
    MODEL_ARTIFACT_PATH,
    ensure_registered_model,
    find_version,
    move_scenario_aliases,
    register_version,
    task_alias,
    write_model_folder,
)
from cluster.model_registry.model_cache import content_tags
from cluster.tracking.client import log_metrics
from cluster.tracking.run_identity import scoped_alias
from cluster.tracking.ui import link_model_versions, log_comparable_images, show_headline_in_name
from compat_core import io as cio
from pipelines.graph.stage_kind import StageKind
from pipelines.records.stage_records import AdaptersRecord, CommittedStage, FeatureRecord, ModelRecord, RowRecord
from pipelines.results.assemble import MATRIX_FILE, METRICS_FILE, RunResult
from pipelines.store.run_store import sha256_bytes

log = logging.getLogger(__name__)

VERSION_IDENTITY_TAGS = ("pipeline_id", "run_folder", "run_name", "config_hash", "overrides_digest", "code_version",
                         "scenario_aliases")


class StageRecordLogging:
    """Mixin of :class:`cluster.tracking.tracker.MlflowTracker`: logs records to the tracker's ``client`` for its ``graph``,
    ``store``, ``parent_run_id``, ``model_name``, ``pipeline_id`` and ``register_models``, and the stage runs it
    keeps open in ``_open``, its identity (``_base_tags``, ``run_name``, ``scenario_aliases``)."""

    def _on_train_record(self, record: Any, stage_key: str | None) -> None:
        run_id = self._run_for_train_record(record, stage_key)
        if run_id is None:
            log.warning("training record of task %s not logged: no single open training stage to attribute it to",
                        getattr(record, "task", None))
            return
        values = {"train/loss": record.loss, "train/lr": record.lr, "train/images_per_s": record.images_per_s,
                  "train/epoch": record.epoch}
        values.update({f"train/loss/{name}": value for name, value in (record.loss_parts or {}).items()})
        values.update({f"train/{name}": value for name, value in (getattr(record, "metrics", None) or {}).items()})
        log_metrics(self.client, run_id, values, step=int(record.step))

    def _run_for_train_record(self, record: Any, stage_key: str | None) -> str | None:
        if stage_key is not None:
            opened = self._open.get(stage_key)
            return opened.run_id if opened else None
        training = [o for o in self._open.values() if StageKind(o.stage.kind).trains]
        if len(training) > 1:
            training = [o for o in training if o.stage.task == getattr(record, "task", None)]
        return training[0].run_id if len(training) == 1 else None

    def _log_record(self, stage: Any, run_id: str, committed: CommittedStage) -> None:
        record = committed.record
        if isinstance(record, ModelRecord):
            self._log_model(stage, run_id, committed, record)
            if record.weights is not None:  # the external weights the stage started from: what loaded, ignored
                self.client.log_dict(run_id, record.weights.to_json(), "weights/load_report.json")
                self.client.set_tag(run_id, "weights_sha256", str(record.weights.sha256))
                self.client.set_tag(run_id, "weights_loaded", f"{record.weights.loaded}/{record.weights.target_keys}")
            values = {f"task/{name}": value for name, value in record.training.task_metrics().items()}
            if stage.task is not None and values:
                log_metrics(self.client, self.parent_run_id, values, step=int(stage.task) + 1)  # 1-based task
        elif isinstance(record, FeatureRecord):
            log_metrics(self.client, run_id, {"extract/images_per_s": record.images_per_second,
                                              "extract/seconds": record.seconds,
                                              "extract/rows": record.layout.rows}, step=0)
        elif isinstance(record, AdaptersRecord):
            self._log_adapters(stage, run_id, committed, record)
        elif isinstance(record, RowRecord):
            row = record.row
            entries = {entry_metric_key(row, column): value for column, value in enumerate(record.values)}
            # on the row's own stage run only; the parent gets the whole matrix once, as a table and a figure
            log_metrics(self.client, run_id, entries, step=row + 1)

    def _log_model(self, stage: Any, run_id: str, committed: CommittedStage, record: ModelRecord) -> None:
        manifest = committed.blob_table  # what read_blob verifies the uploaded blobs against
        missing = [name for name in ("model.safetensors", "config.json") if name not in committed.blobs]
        if missing:
            raise ValueError(f"stage {stage.label}: model record without {', '.join(missing)} in its manifest "
                             f"(blobs: {sorted(committed.blobs)})")
        with tempfile.TemporaryDirectory(prefix="compat-mlflow-model-") as folder:
            model_folder = write_model_folder(Path(folder, MODEL_ARTIFACT_PATH),
                                              self.store.read_blob(stage.key, "config.json", manifest),
                                              self.store.read_blob(stage.key, "model.safetensors", manifest))
            self.client.log_artifacts(run_id, str(model_folder), MODEL_ARTIFACT_PATH)
        sha256 = committed.blobs["model.safetensors"]["sha256"]
        self.client.set_tag(run_id, "model_sha256", sha256)
        if not self.register_models:
            return
        files = {name: committed.blobs[name]["sha256"] for name in ("config.json", "model.safetensors")}
        tags = {"stage_kind": stage.kind, "line": record.line, "sha256": sha256, **content_tags(files),
                **self._identity_of_versions()}
        aliases: list[str] = []
        if stage.kind == StageKind.PRETRAIN:
            aliases.append(f"pretrain-{stage.name}")
        else:
            task = int(stage.task)
            tags.update(task_0based=task, task_1based=task + 1)
            aliases.append(task_alias(task))
            if task > 0:
                parent = find_version(self.client, self.model_name, self.graph.model_stages[task - 1],
                                      self.pipeline_id)
                if parent is not None:
                    tags["parent_version"] = parent.version
            source = record.source
            if source:
                tags["external_source"] = source
                if source.startswith("pretrain:") and source[len("pretrain:"):] in self.graph.pretrain_stages:
                    origin = find_version(self.client, self.model_name,
                                          self.graph.pretrain_stages[source[len("pretrain:"):]], self.pipeline_id)
                    if origin is not None:
                        tags["source_version"] = origin.version
            if task >= self._latest_task:  # this run's newest task model, even when an older run went further
                self._latest_task = task
                aliases.append(LATEST_ALIAS)
        version = register_version(self.client, self.model_name, run_id, stage.key, tags, self._run_aliases(aliases))
        self.client.set_tag(run_id, "registered_model", self.model_name)
        self.client.set_tag(run_id, "model_version", version.version)

    def _log_adapters(self, stage: Any, run_id: str, committed: CommittedStage, record: AdaptersRecord) -> None:
        """Adapter stage: cross-tests with/without each adapter, backfilling curves (step = percent
        re-embedded), adapter files as artifacts, each registered in ``<model>-adapters`` (alias KIND-task-N)."""
        manifest = committed.blob_table  # what read_blob verifies the uploaded blobs against
        task = int(record.task)
        values = {f"adapt/{name}/{part}": value for name, tests in record.baseline.items()
                  for part, value in tests.to_json().items()}
        values["adapt/baseline/compatible"] = float(record.verdict.compatible)
        for kind, result in record.adapters.items():
            values.update({f"adapt/{kind}/cross_recall_at_1": result.cross_recall_at_1,
                           f"adapt/{kind}/cross_map": result.cross_map, f"adapt/{kind}/fit_loss": result.fit_loss,
                           f"adapt/{kind}/compatible": float(result.verdict.compatible),
                           f"adapt/{kind}/margin": result.verdict.margin})
        log_metrics(self.client, run_id, values, step=task)
        for order, curve in record.backfill.curves().items():
            for index, fraction in enumerate(curve["fraction"]):
                log_metrics(self.client, run_id, {f"backfill/{order}/{name}": curve[name][index] for name in curve
                                                  if name != "fraction"}, step=int(round(100 * fraction)))
        names = [entry.blob for entry in record.adapters.values() if entry.blob in committed.blobs]
        with tempfile.TemporaryDirectory(prefix="compat-mlflow-adapters-") as folder:
            # the record as its manifest holds it (keys sorted, as the store writes manifests)
            Path(folder, "adapters.json").write_text(json.dumps(committed.record_json(), indent=2, sort_keys=True))
            for name in names:
                Path(folder, name).write_bytes(self.store.read_blob(stage.key, name, manifest))
            self.client.log_artifacts(run_id, folder, "adapters")
        if not self.register_models or not names:
            return
        adapters_model = f"{self.model_name}-adapters"
        ensure_registered_model(self.client, adapters_model, {"pipeline_id": self.pipeline_id,
                                                             "models_of": self.model_name})
        for kind, entry in record.adapters.items():
            sha256 = committed.blobs[entry.blob]["sha256"]
            register_version(self.client, adapters_model, run_id, f"{stage.key}/{kind}",
                             {"stage_kind": StageKind.ADAPT, "adapter": kind, "direction": entry.direction,
                              "task_0based": task, "task_1based": task + 1, "sha256": sha256,
                              **content_tags({entry.blob: sha256}), **self._identity_of_versions(),
                              "compatible": str(entry.verdict.compatible).lower()},
                             self._run_aliases([f"{kind}-task-{task + 1}"]), artifact_path=f"adapters/{entry.blob}")

    def _identity_of_versions(self) -> dict[str, str]:
        """The run's identity as version tags: which run folder, pipeline, config, overrides and code made it."""
        return {key: self._base_tags[key] for key in VERSION_IDENTITY_TAGS if key in self._base_tags}

    def _run_aliases(self, aliases: list[str]) -> list[str]:
        """The aliases a version of this run takes while it runs: each in the run's namespace. The bare scenario
        aliases move at the end of a complete run of an unchanged config (:meth:`_move_scenario_aliases`)."""
        return [scoped_alias(self.run_name, alias) for alias in aliases]

    def _move_scenario_aliases(self) -> None:
        """A complete run whose config file ran unchanged (``scenario_aliases``) takes the scenario's bare aliases,
        all at once, in the registered model and its adapters model (see cluster.model_registry.versions)."""
        if not (self.register_models and self.model_name and self.scenario_aliases):
            return
        for name in (self.model_name, f"{self.model_name}-adapters"):
            moved = move_scenario_aliases(self.client, name, scoped_alias(self.run_name, ""))
            if moved:
                log.info("%s: scenario aliases %s now name run %s", name, ", ".join(sorted(moved)), self.run_name)

    def _log_results(self, result: RunResult | None) -> None:
        """Summary metrics and result files of a complete run (the engine's RunResult), once per metrics.json
        content; the other result files (report, figures, config) are uploaded from the run directory."""
        if result is None:
            log.warning("run %s finished without a result from the engine: summary metrics and reports not logged",
                        self.store.root)
            return
        metrics_text = result.metrics_json()
        digest = sha256_bytes(metrics_text.encode("utf-8"))
        if self.client.get_run(self.parent_run_id).data.tags.get("results_sha256") == digest:
            return
        metrics = result.metrics
        last = int(metrics.get("num_tasks", 1)) - 1
        log_metrics(self.client, self.parent_run_id,
                    {name: metrics.get(name) for name in ("AC", "AA", "ACA", "BC", "FC")}, step=max(last, 0) + 1)
        for name in ("AC_tau", "AA_tau"):
            for step, value in enumerate(metrics.get(name) or []):
                log_metrics(self.client, self.parent_run_id, {name: value}, step=step + 1)  # tau is 1-based
        self._log_matrix_table(result.matrix.to_dict()["values"])
        with tempfile.TemporaryDirectory(prefix="compat-mlflow-results-") as folder:
            Path(folder, MATRIX_FILE).write_text(result.matrix_json())
            Path(folder, METRICS_FILE).write_text(metrics_text)
            for name in ("matrix.csv", "report.md", "config.yaml"):
                uri = self.store.uri(name)
                if cio.exists(uri):
                    Path(folder, name).write_bytes(cio.read_bytes(uri))
            if not Path(folder, "matrix.csv").exists():
                Path(folder, "matrix.csv").write_text(result.matrix.to_csv())
            root = self.store.uri()
            for name in cio.list_dir(root) if cio.is_dir(root) else []:
                if name.endswith(".png"):
                    Path(folder, name).write_bytes(cio.read_bytes(self.store.uri(name)))
            self.client.log_artifacts(self.parent_run_id, folder, "results")
            log_comparable_images(self.client, self.parent_run_id, folder)
        show_headline_in_name(self.client, self.parent_run_id, metrics)
        link_model_versions(self.client, self.parent_run_id, self.model_name, self.pipeline_id)
        self.client.set_tag(self.parent_run_id, "results_sha256", digest)

    def _log_matrix_table(self, values: list[list[float | None]]) -> None:
        """The compatibility matrix (rows of fractions, None above the diagonal) as one MLflow table (rows: query
        task, 1-based; a column per gallery task), shown and compared in the UI's artifact view; the heatmap
        matrix.png goes with the results."""
        table = {"query_task": [row + 1 for row in range(len(values))]}
        for column in range(len(values)):
            table[f"gallery_task_{column + 1}"] = [row[column] for row in values]
        self.client.log_table(self.parent_run_id, data=table, artifact_file="results/matrix_table.json")


def entry_metric_key(query_task: int, gallery_task: int) -> str:
    """Metric key of C[query_task, gallery_task]: ``compat/q{t}_g{k}`` with **0-based** task indices (matrix.json)."""
    if query_task < 0 or gallery_task < 0 or gallery_task > query_task:
        raise ValueError(f"compatibility entry ({query_task}, {gallery_task}): expected 0 <= gallery <= query")
    return f"compat/q{query_task}_g{gallery_task}"


__all__ = ["StageRecordLogging", "entry_metric_key"]
