"""cluster.tracking.tracker without a server: param flattening and secret exclusion, naming, and a pipeline tracked into the
default SQLite database of its run directory (hand-made stage outputs driven through the real LocalExecutor)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

tiny.register()  # the scenario below names the tiny-synth dataset: configs validate only once it is registered

from cluster.model_registry.versions import registered_model_name, task_alias
from cluster.tracking.client import EXPERIMENT_KIND_TAG, check_tracking_uri, ensure_experiment, open_client
from cluster.tracking.store import resolve_tracking
from cluster.tracking.params import flatten_params, looks_like_secret
from cluster.tracking.record_logging import entry_metric_key
from cluster.tracking.tracker import MlflowTracker, NullTracker, create_tracker
from cluster.tracking.ui import RESULTS_VIEW
from pipelines.store.run_store import RunStore

# C[t, k] (0-based query t, gallery k); exact binary fractions so that hand arithmetic is exact
MATRIX = [[0.5], [0.625, 0.75], [0.375, 0.875, 1.0]]
# Hand-worked (strict ECC C[t,k] > C[k,k]): pairs (1,0) yes, (2,0) no, (2,1) yes -> AC = 2/3;
# AA = (0.5+0.625+0.75+0.375+0.875+1.0)/6 = 4.125/6; ACA = (0.625+0.875)/3; BC = mean(0.375-0.5, 0.875-0.75) = 0;
# FC = mean(0.625-0.75, 0.875-1.0) = -0.125; AC_tau = [undefined, 1, 2/3]; AA_tau = [0.5, 1.875/3, 4.125/6]
EXPECTED = {"AC": 2 / 3, "AA": 4.125 / 6, "ACA": 1.5 / 3, "BC": 0.0, "FC": -0.125}
EXPECTED_AC_TAU = {2: 1.0, 3: 2 / 3}  # step = tau, 1-based
EXPECTED_AA_TAU = {1: 0.5, 2: 1.875 / 3, 3: 4.125 / 6}


# ---- params and names ----------------------------------------------------------------------------------------------
def test_flatten_params_uses_dot_keys_and_excludes_secrets_by_key_and_by_value():
    config = {
        "name": "demo",
        "training": {"optimizer": {"name": "sgd", "lr": 0.01}, "epochs": 8},
        "replacements": [{"at_task": 3, "sha256": "ab" * 32}],
        "increments": [10, 15],
        "storage": {"aws_secret_key": "x", "db_password": "hunter2", "hf_token": "t", "credentials": {"a": 1},
                    "endpoint": "https://user:pa55word@example.com/bucket", "key_id": "AKIAABCDEFGHIJKLMNOP",
                    "blob": "Zx9" * 12, "note": None},
        "empty": {},
    }
    params, excluded = flatten_params(config)
    assert params == {
        "name": "demo",
        "training.optimizer.name": "sgd",
        "training.optimizer.lr": "0.01",
        "training.epochs": "8",
        "replacements.0.at_task": "3",
        "replacements.0.sha256": "ab" * 32,  # a lower-case hex digest is not a secret
        "increments": "[10, 15]",
        "empty": "{}",
    }
    assert sorted(excluded) == sorted([
        "storage.aws_secret_key", "storage.db_password", "storage.hf_token", "storage.credentials",
        "storage.endpoint", "storage.key_id", "storage.blob"])


def test_secret_values_are_recognised_and_plain_values_are_not():
    assert looks_like_secret("ghp_" + "a1B2" * 9)
    assert looks_like_secret("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.abc")
    assert looks_like_secret("-----BEGIN RSA PRIVATE KEY-----\nMII")
    for plain in ("recall_at_1", "pretrain:p2", "s3://bucket/models/p1", "runs/demo/er", "0" * 64, "token", 0.5):
        assert not looks_like_secret(plain), plain


def test_long_param_values_are_truncated_to_mlflow_limit():
    params, _ = flatten_params({"description": "x" * 7000})
    assert len(params["description"]) == 6000 and params["description"].endswith("...")


def test_naming_helpers():
    assert entry_metric_key(2, 0) == "compat/q2_g0"
    with pytest.raises(ValueError, match="gallery <= query"):
        entry_metric_key(0, 1)
    # one name per scenario, the same for every run of it; output.registered_model overrides it
    assert registered_model_name("demo-er") == "demo-er"
    assert registered_model_name("demo-er", "team-retrieval") == "team-retrieval"
    with pytest.raises(ValueError, match="scenario name"):
        registered_model_name("demo er")
    with pytest.raises(ValueError, match="output.registered_model"):
        registered_model_name("demo-er", "team/retrieval")
    assert task_alias(2) == "task-3"  # 0-based task 2 is the papers' third task


def test_tracking_uri_is_checked_and_off_gives_the_null_tracker():
    assert check_tracking_uri("https://mlflow.example.com:5000") == "https://mlflow.example.com:5000"
    with pytest.raises(ValueError, match="tracking URI"):
        check_tracking_uri("ftp://host")
    assert isinstance(create_tracker(None), NullTracker)


def test_tracking_uri_credentials_never_stay_in_the_uri(monkeypatch):
    from pipelines.config.redaction import redact_uri

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    assert check_tracking_uri("https://ana:s3cr%40t@mlflow.example.com:5000/x") == "https://mlflow.example.com:5000/x"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "ana" and os.environ["MLFLOW_TRACKING_PASSWORD"] == "s3cr%40t"
    with pytest.raises(ValueError) as error:
        check_tracking_uri("ftp://ana:hunter2@host")
    assert "hunter2" not in str(error.value) and "ftp://ana:***@host" in str(error.value)
    assert redact_uri("see http://u:p@h:1/a and s3://bucket/k") == "see http://u:***@h:1/a and s3://bucket/k"


def test_train_record_has_the_fields_the_tracker_reads():
    training = pytest.importorskip("pipelines.training.loop")
    names = {f for f in training.TrainRecord.__dataclass_fields__}
    assert {"task", "epoch", "step", "loss", "loss_parts", "lr", "images_per_s", "metrics"} <= names


# ---- a hand-made pipeline ------------------------------------------------------------------------------------------
@dataclass
class FakeTrainRecord:
    """Same fields as pipelines.training.loop.TrainRecord (the tracker reads records by duck typing)."""

    task: int
    epoch: int
    step: int
    loss: float
    loss_parts: dict
    lr: float
    images_per_s: float
    seconds: float
    metrics: dict = field(default_factory=dict)


def train_loss(task: int, step: int) -> float:
    return 2.0 - 0.25 * step + task  # step 1 -> 1.75 + task, step 2 -> 1.5 + task


def scenario(output: str) -> dict:
    """3 tasks (2+2x2), pretrain p1 (initial model) and p2 (replacement at task 3, 1-based); K = 10."""
    pool = {"dataset": "tiny-synth", "split": "pretrain"}
    return {
        "name": "track-demo",
        "seed": 0,
        "device": "cpu",
        "data": {"dataset": "tiny-synth", "split": "finetune"},
        "tasks": {"spec": "2+2x2"},
        "model": {"backbone": "cnn4", "backbone_config": {"in_chans": 1, "width": 4}, "num_slots": 10},
        "method": {"name": "er", "params": {}},
        "training": {"optimizer": {"name": "sgd", "lr": 0.01}, "epochs": 2, "batch_size": 8, "autocast": False,
                     "channels_last": "off"},
        "pretrain": [{"name": "p1", "pool": pool, "num_classes": 4}, {"name": "p2", "pool": pool, "num_classes": 4}],
        "initial_model": "pretrain:p1",
        "replacements": [{"at_task": 3, "source": "pretrain:p2"}],
        "evaluation": {"query_set": {"dataset": "tiny-synth", "split": "query"},
                       "gallery_set": {"dataset": "tiny-synth", "split": "gallery"}},
        "output": {"dir": output},
    }


def model_blobs(seed: int) -> dict[str, bytes]:
    from compat_core.models.compat_model import create_model, save_model

    torch.manual_seed(seed)
    model = create_model("cnn4", 10, classifier="learnable", backbone_config={"in_chans": 1, "width": 4},
                         num_active_classes=4)
    with tempfile.TemporaryDirectory() as folder:
        save_model(model, folder)
        return {name: Path(folder, name).read_bytes() for name in os.listdir(folder)}


def fake_stage_functions(fail_task: int | None = None) -> dict:
    """Stage functions returning hand-made records (no data, no training); ``fail_task`` raises in that model stage."""
    from pipelines.records.payloads import EvaluationProtocol, FeatureLayout, TrainingSummary
    from pipelines.records.stage_records import EntryRecord, FeatureRecord, ModelRecord, RowRecord
    from pipelines.stages.context import StageResult

    def model_stage(ctx):
        stage = ctx.stage
        task = stage.task
        if fail_task is not None and task == fail_task:
            raise RuntimeError(f"injected failure in {stage.label}")
        for step in (1, 2):
            ctx.emit(FakeTrainRecord(task if task is not None else 0, step - 1, step, train_loss(task or 0, step),
                                     {"ce": train_loss(task or 0, step) - 0.5, "distill": 0.5}, 0.01 / step,
                                     100.0 * step, 0.1))
        seed = 1000 + (task if task is not None else 100 + int(stage.name[1:]))
        start = getattr(stage.inputs, "start", None)  # a replacement's source, or initial_model at task 0
        source = start.text if start is not None else None
        record = ModelRecord(stage.key, ctx.store.uri(ctx.store.ARTIFACTS, stage.key), task,
                             1 if stage.kind == "replace" else 0, 4, 0 if task is None else 2 * task + 2,
                             "learnable", 4, source=source,
                             training=TrainingSummary(selected_epoch=1, images_per_s=150.0, seconds=2.0 + (task or 0),
                                                      final_loss=train_loss(task or 0, 2), epochs_recorded=2))
        return StageResult(record, model_blobs(seed))

    def extract_stage(ctx):
        record = FeatureRecord(ctx.stage.key, ctx.stage.task, ctx.stage.split,
                               ctx.store.uri(ctx.store.ARTIFACTS, ctx.stage.key),
                               FeatureLayout([], 30, 9, "float16", False),
                               4, 0.5, 60.0)
        return StageResult(record)

    def evaluate_stage(ctx):
        row = ctx.stage.task
        record = RowRecord(ctx.stage.key, row, MATRIX[row], [f"e{row}{k}" for k in range(row + 1)],
                           "recall_at_1", EvaluationProtocol.from_json(ctx.stage.inputs.protocol.model_dump()))
        return StageResult(record)

    def entry_stage(ctx):
        row, column = ctx.stage.inputs.row, ctx.stage.inputs.column
        return StageResult(EntryRecord(ctx.stage.key, row, column, MATRIX[row][column], "", "",
                                       EvaluationProtocol.from_json(ctx.stage.inputs.rules.protocol.model_dump())))

    return {"pretrain": model_stage, "finetune": model_stage, "replace": model_stage, "extract": extract_stage,
            "entry": entry_stage, "evaluate": evaluate_stage}


class TrackerStore(RunStore):
    """The run folder as the tracker gets it: it may read the blobs and files it uploads, while reading a stage
    manifest or a result file fails the test (the engine hands the tracker the committed records and the result)."""

    def load_manifest(self, stage_key: str) -> dict:
        raise AssertionError(f"the tracker read the manifest of {stage_key} back from the store")

    def uri(self, *parts: str) -> str:
        if parts and parts[-1] in ("matrix.json", "metrics.json"):
            raise AssertionError(f"the tracker read {parts[-1]} back from the store")
        return super().uri(*parts)

    def read_text(self, relative: str) -> str:
        self.uri(relative)  # refuses the result files
        return super().read_text(relative)


def run_tracked(run_dir: Path, tracking_uri: str | None, monkeypatch, fail_task: int | None = None,
                ray_job: str | None = None, stop_after: int | None = None):
    """Compile the scenario, run it with the LocalExecutor and fake stages, tracked by an MlflowTracker whose store
    refuses manifest and result-file reads (:class:`TrackerStore`); stop_after: run only this many nodes.

    Returns (graph, store, tracker). Re-raises a stage failure after the tracker has closed the runs.
    """
    from pipelines.config.load import validate_config
    from pipelines.engine.runner import LocalExecutor
    from pipelines.engine.progress import ProgressReporter
    from pipelines.graph.compile import compile_scenario
    from pipelines.reports.run_report import ReportWriter
    from pipelines.stages import execute as stages

    for kind, function in fake_stage_functions(fail_task).items():
        monkeypatch.setitem(stages.STAGE_FUNCTIONS, kind, function)
    if ray_job is not None:
        fake_ray = SimpleNamespace(is_initialized=lambda: True,
                                   get_runtime_context=lambda: SimpleNamespace(get_job_id=lambda: ray_job))
        monkeypatch.setitem(__import__("sys").modules, "ray", fake_ray)
    config = validate_config(scenario(str(run_dir)))
    graph = compile_scenario(config, version="test+0123")
    store = RunStore(run_dir)
    tracker = create_tracker(resolve_tracking(tracking_uri).uri)  # as app.dispatch resolves --tracking-uri
    with tracker.pipeline(graph, TrackerStore(run_dir)):
        # the reports as the commands write them (cluster.run_driver.run_tracked)
        LocalExecutor(emit=ProgressReporter(enabled=False, sinks=[ReportWriter(store), tracker]),
                      stop_after=stop_after).run(graph, store)
    if ray_job is not None:
        monkeypatch.delitem(__import__("sys").modules, "ray")
    return graph, store, tracker


def metric_history(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


@pytest.fixture(scope="module")
def sqlite_run(tmp_path_factory):
    """One tracked run into the default SQLite database (module-scoped: creating the schema takes seconds)."""
    monkeypatch = pytest.MonkeyPatch()
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    try:
        yield (run_dir, *run_tracked(run_dir, None, monkeypatch, ray_job="02000000"))
    finally:
        monkeypatch.undo()


def test_done_stages_are_logged_from_the_committed_record_the_engine_hands_over(sqlite_run):
    run_dir, graph, store, tracker = sqlite_run
    assert isinstance(tracker.store, TrackerStore)  # which fails a manifest read
    experiment = tracker.client.get_experiment_by_name("track-demo")
    extracts = [run for run in tracker.client.search_runs([experiment.experiment_id])
                if run.data.tags.get("stage_kind") == "extract"]
    assert extracts and {run.data.metrics["extract/rows"] for run in extracts} == {30}  # the fake layout's rows


def test_default_sqlite_run_holds_parent_nested_runs_metrics_and_tags(sqlite_run):
    run_dir, graph, store, tracker = sqlite_run
    # the machine's one store (COMPAT_HOME), never a file in or next to the run folder
    store_file = Path(tracker.tracking_uri[len("sqlite:///"):])
    assert store_file.parts[-2:] == ("mlflow", "mlflow.db") and store_file.is_file()
    assert not (run_dir / "mlflow.db").exists() and not (run_dir.parent / "mlflow.db").exists()
    client = tracker.client
    experiment = client.get_experiment_by_name("track-demo")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("run_role") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    # one nested run per stage; the 6 matrix entries are logged with their rows, not as runs of their own
    assert len(children) == sum(stage.kind != "entry" for stage in graph) == 14
    assert {r.data.tags["stage_key"] for r in children} == {s.key for s in graph if s.kind != "entry"}
    assert all(r.info.status == "FINISHED" for r in children)
    replace = next(r for r in children if r.data.tags["stage_kind"] == "replace")
    assert replace.data.tags["task_0based"] == "2" and replace.data.tags["task_1based"] == "3"
    assert replace.data.tags["ray_job_id"] == "02000000" and parent.data.tags["ray_job_id"] == "02000000"
    assert replace.data.tags["code_version"] == "test+0123"
    assert replace.data.tags["pipeline_id"] == parent.data.tags["pipeline_id"] == tracker.pipeline_id
    # params: flattened validated config
    assert parent.data.params["training.optimizer.lr"] == "0.01"
    assert parent.data.params["replacements.0.source"] == "pretrain:p2"
    # per-step training metrics of task 2 (0-based): loss 1.75 + 2 at step 1, 1.5 + 2 at step 2
    assert metric_history(client, replace.info.run_id, "train/loss") == {1: 3.75, 2: 3.5}
    assert metric_history(client, replace.info.run_id, "train/loss/ce") == {1: 3.25, 2: 3.0}
    assert metric_history(client, replace.info.run_id, "train/lr") == {1: 0.01, 2: 0.005}
    assert metric_history(client, replace.info.run_id, "train/images_per_s") == {1: 100.0, 2: 200.0}
    # per-task metrics on the parent, step = 1-based task
    assert metric_history(client, parent.info.run_id, "task/seconds") == {1: 2.0, 2: 3.0, 3: 4.0}
    # the matrix once, as a table (rows: 1-based query task), not T(T+1)/2 single-dot metrics on the parent
    assert not any(key.startswith("compat/q") for key in parent.data.metrics)
    table_path = client.download_artifacts(parent.info.run_id, "results/matrix_table.json")
    table = json.loads(Path(table_path).read_text())
    rows = {row[0]: row[1:] for row in table["data"]}
    for t, row in enumerate(MATRIX):
        for k, value in enumerate(row):
            assert rows[t + 1][k] == value
    for name, value in EXPECTED.items():
        history = metric_history(client, parent.info.run_id, name)
        # NaN at step 0 (logged when the run started: "not computed yet"), the result at the last task's step
        assert list(history) == [0, 3] and math.isnan(history[0]), (name, history)
        assert history[3] == pytest.approx(value, abs=1e-12) and parent.data.metrics[name] == history[3], name
    # the summary metrics are the run's first metrics (MLflow's compare-runs page plots the first shared one)
    assert list(parent.data.metrics)[:5] == ["AC", "AA", "ACA", "BC", "FC"], list(parent.data.metrics)[:8]
    assert metric_history(client, parent.info.run_id, "AC_tau") == pytest.approx(EXPECTED_AC_TAU, abs=1e-12)
    assert metric_history(client, parent.info.run_id, "AA_tau") == pytest.approx(EXPECTED_AA_TAU, abs=1e-12)
    artifacts = {f.path for f in client.list_artifacts(parent.info.run_id, "results")}
    assert {"results/matrix.json", "results/matrix.csv", "results/metrics.json"} <= artifacts


def test_models_are_registered_with_aliases_lineage_and_load_by_uri(sqlite_run, tmp_path, uri_resolvers):
    from cluster.model_registry.versions import register_mlflow_resolvers
    from compat_core.models.compat_model import create_model
    from compat_core.models.weights import load_external_weights

    run_dir, graph, store, tracker = sqlite_run
    client = tracker.client
    name = "track-demo"  # the scenario name: stable across runs
    versions = {v.tags["stage_key"]: v for v in client.search_model_versions(f"name = '{name}'")}
    assert len(versions) == 5  # p1, p2, tasks 0..2
    by_alias = {alias: str(client.get_model_version_by_alias(name, alias).version)
                for alias in ("task-1", "task-2", "task-3", "latest-task", "pretrain-p1", "pretrain-p2")}
    model_keys = graph.model_stages
    assert by_alias["task-3"] == by_alias["latest-task"] == str(versions[model_keys[2]].version)
    task3 = versions[model_keys[2]]
    assert task3.tags["parent_version"] == by_alias["task-2"]
    assert task3.tags["external_source"] == "pretrain:p2"
    assert task3.tags["source_version"] == by_alias["pretrain-p2"]
    assert task3.tags["task_1based"] == "3"
    weights = Path(store.blob_path(model_keys[2], "model.safetensors"))
    assert task3.tags["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert task3.source == f"runs:/{task3.run_id}/model"

    register_mlflow_resolvers(tracker.tracking_uri, cache_dir=tmp_path / "cache")  # forgotten after the test
    torch.manual_seed(99)
    model = create_model("cnn4", 10, classifier="learnable", backbone_config={"in_chans": 1, "width": 4},
                         num_active_classes=4)
    report = load_external_weights(model, f"models:/{name}@task-3", sha256=task3.tags["sha256"])
    assert report.ok
    from safetensors.torch import load_file

    expected = load_file(str(weights))
    for key, value in model.state_dict().items():
        if key in expected:
            assert torch.equal(value, expected[key]), key


def test_resumed_pipeline_reuses_runs_and_versions(sqlite_run, monkeypatch):
    run_dir, graph, store, tracker = sqlite_run
    client = tracker.client
    experiment_id = client.get_experiment_by_name("track-demo").experiment_id
    before = {r.info.run_id for r in client.search_runs([experiment_id])}
    name = f"track-demo-{tracker.pipeline_id[:8]}"
    versions_before = len(client.search_model_versions(f"name = '{name}'"))
    # resumed as a Ray Job: Ray hands the driver its submission id in the job config metadata
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(
        {"runtime_env": {}, "metadata": {"job_submission_id": "compat-track-demo-0123456789ab"}}))
    _, _, again = run_tracked(run_dir, tracker.tracking_uri, monkeypatch)  # the store the first run used
    after = client.search_runs([experiment_id])
    assert {r.info.run_id for r in after} == before
    assert len(client.search_model_versions(f"name = '{name}'")) == versions_before
    parent = next(r for r in after if r.data.tags.get("run_role") == "pipeline")
    assert parent.info.status == "FINISHED" and parent.data.tags["resumes"] == "1"
    assert parent.data.tags["ray_submission_id"] == "compat-track-demo-0123456789ab"
    # the summary metrics were not logged a second time (nor their placeholder: the resumed run is not new)
    assert sorted(m.step for m in client.get_metric_history(parent.info.run_id, "AC")) == [0, 3]


def test_failed_stage_ends_failed_and_retry_gets_a_new_attempt(sqlite_run, tmp_path, monkeypatch):
    _, _, _, first = sqlite_run
    run_dir = tmp_path / "failing"
    with pytest.raises(RuntimeError, match="injected failure"):
        run_tracked(run_dir, first.tracking_uri, monkeypatch, fail_task=1)
    client = first.client
    experiment_id = client.get_experiment_by_name("track-demo").experiment_id
    parent = [r for r in client.search_runs([experiment_id], "tags.run_role = 'pipeline'")
              if r.data.tags["pipeline_id"] != first.pipeline_id]
    assert len(parent) == 1 and parent[0].info.status == "FAILED"
    children = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent[0].info.run_id}'")
    statuses = {r.data.tags["stage_label"]: r.info.status for r in children}
    assert statuses == {"pretrain[p1]": "FINISHED", "pretrain[p2]": "FINISHED", "finetune[t=0]": "FINISHED",
                        "finetune[t=1]": "FAILED"}

    run_tracked(run_dir, first.tracking_uri, monkeypatch)  # the retry succeeds
    parent_after = client.get_run(parent[0].info.run_id)
    assert parent_after.info.status == "FINISHED"
    children = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent[0].info.run_id}'")
    attempts = sorted((r.data.tags["attempt"], r.info.status) for r in children
                      if r.data.tags["stage_label"] == "finetune[t=1]")
    assert attempts == [("1", "FAILED"), ("2", "FINISHED")]
    assert len(children) == 15  # 14 stages + the failed first attempt


def test_tracker_refuses_records_before_start(tmp_path):
    tracker = MlflowTracker("http://127.0.0.1:9")  # never contacted: the record is refused first
    with pytest.raises(RuntimeError, match="before start"):
        tracker(json.loads("{}"))


def test_pipeline_run_is_readable_in_the_ui_without_configuration(sqlite_run):
    """Heatmaps at the artifact root (the compare view offers only top-level files common to the runs) and as
    MLflow images under one key; the headline metrics in the run name; links to the run's model versions."""
    run_dir, graph, store, tracker = sqlite_run
    client = tracker.client
    experiment = client.get_experiment_by_name("track-demo")
    assert experiment.tags[EXPERIMENT_KIND_TAG] == "custom_model_development"  # MLflow UI: runs table, not traces
    parent = client.search_runs([experiment.experiment_id], f"tags.run_role = 'pipeline' and "
                                f"tags.pipeline_id = '{tracker.pipeline_id}'")[0]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for name in ("AC", "AA", "ACA", "BC", "FC"):  # metric columns the runs table can show, as metrics.json has them
        assert parent.data.metrics[name] == pytest.approx(metrics[name], abs=1e-12), name
    pictures = sorted(name for name in ("matrix.png", "aa_tau.png") if (run_dir / name).exists())
    assert pictures, "the run folder has no result picture to log"
    top_level = {a.path for a in client.list_artifacts(parent.info.run_id) if not a.is_dir}
    assert set(pictures) <= top_level
    images = {a.path for a in client.list_artifacts(parent.info.run_id, "images")}
    assert any(path.startswith("images/compat_matrix") for path in images), images
    expected = " ".join(f"{name} {metrics[name]:.3f}" for name in ("AC", "AA", "BC", "FC"))
    assert parent.info.run_name.endswith(f" | {expected}")
    versions = [v for v in client.search_model_versions(f"name = '{tracker.model_name}'")
                if v.tags.get("pipeline_id") == tracker.pipeline_id]
    assert versions
    listed = parent.data.tags["registered_versions"].split(",")
    assert sorted(listed) == sorted(f"{v.name}/{v.version}" for v in versions)
    note = parent.data.tags["mlflow.note.content"]
    for item in listed:
        name, version = item.split("/")
        assert f"(#/models/{name}/versions/{version})" in note


def test_experiments_the_product_uses_open_as_model_training_in_the_ui(tmp_path):
    client = open_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    created = ensure_experiment(client, "fresh")
    older = client.create_experiment("made-before")  # e.g. by an earlier version, without a kind
    chosen = client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    assert ensure_experiment(client, "made-before") == older and ensure_experiment(client, "chosen") == chosen
    kinds = {name: client.get_experiment_by_name(name).tags.get(EXPERIMENT_KIND_TAG)
             for name in ("fresh", "made-before", "chosen")}
    assert kinds == {"fresh": "custom_model_development", "made-before": "custom_model_development",
                     "chosen": "genai_development"}  # a kind set by the user in the UI stays theirs
    assert created == client.get_experiment_by_name("fresh").experiment_id
    view = f"mlflow.sharedViewState.{RESULTS_VIEW}"
    client.set_experiment_tag(created, view, "{}")  # written by an older version of the product
    ensure_experiment(client, "fresh")
    columns = json.loads(client.get_experiment(created).tags[view])["selectedColumns"]
    assert columns == [f"metrics.`{name}`" for name in ("AC", "AA", "ACA", "BC", "FC")]


def test_artifact_downloads_through_the_product_client_show_no_progress_bar(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    client = open_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(ensure_experiment(client, "downloads"))
    for index in range(3):
        (tmp_path / f"part-{index}.txt").write_text(str(index))
        client.log_artifact(run.info.run_id, str(tmp_path / f"part-{index}.txt"), "parts")
    capfd.readouterr()
    folder = client.download_artifacts(run.info.run_id, "parts", str(tmp_path / "down"))
    assert sorted(p.read_text() for p in Path(folder).iterdir()) == ["0", "1", "2"]
    assert "Downloading artifacts" not in capfd.readouterr().err
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "true")  # a user who wants them gets them
    client.download_artifacts(run.info.run_id, "parts", str(tmp_path / "again"))
    assert "Downloading artifacts" in capfd.readouterr().err
