"""A task given by its own data (``tasks.sources``): next month's identities as a folder in the published
CASIA-WebFace layout, appended after a class-incremental split of another folder.

The own-data task's classes take the class positions after the earlier tasks' (its identities in name order), its
stage keys hold the data's content digest and nothing of later tasks, the replay memory is appended (the earlier
shard's bytes unchanged), and the two refusals (identities of an earlier task, K too small) name the fix before any
compute.
"""
import hashlib
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from app.cli import main
from compat_core import io as cio
from compat_core.slots import SlotMapper
from pipelines.config.load import (
    HOW_NOT_WHAT,
    config_hash,
    stable_hash,
    validate_config,
)
from pipelines.config.local_paths import absolute_config, local_config_paths
from pipelines.config.preflight import data_problems
from pipelines.config.validate import ConfigError
from pipelines.engine.runner import LocalExecutor
from pipelines.graph.compile import compile_scenario
from pipelines.graph.plan_cost import stage_images
from pipelines.graph.stage_kind import StageKind
from pipelines.stages.pools import identities_of, load_pool, own_task_classes
from pipelines.stages.replay_store import memory_parts, read_memory_shard
from pipelines.store.run_store import RunStore

# The published-format writers live next to the dataset-reader tests (rootdir-style imports, no package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat_core" / "data"))
import fixtures_published as fx

SPLIT_IDS = ["id0001", "id0002", "id0003", "id0004"]  # tasks.spec "4": task 1 (1-based)
NEW_IDS = ["id0103", "id0101", "id0102"]               # next month's identities: task 2
TEST_IDS = ["id0201", "id0202", "id0203"]              # open-set query / gallery identities
PER_IDENTITY = 6
K = 8
PER_CLASS = 2


def write_identities(root: Path, identities: list[str], per_identity: int = PER_IDENTITY) -> Path:
    """<root>/CASIA-WebFace/<identity>/NNN.jpg: one fixed colour pattern per identity plus noise (16x16 RGB)."""
    rng = np.random.default_rng(len(identities))
    for identity in identities:
        pattern = np.random.default_rng(int(identity[2:])).integers(0, 256, size=(16, 16, 3))
        for k in range(per_identity):
            pixels = np.clip(pattern + rng.normal(0, 20, size=pattern.shape), 0, 255).astype(np.uint8)
            fx.write_image(root / "CASIA-WebFace" / identity / f"{k + 1:03d}.jpg", pixels)
    return root


def casia(root) -> dict:
    return {"dataset": "casia_webface", "root": str(root), "options": {"image_size": 16}}


def scenario(data_root: Path, output: Path, sources: list[dict] | None = None, num_slots: int = K) -> dict:
    tests = casia(data_root / "test")
    return {
        "name": "task-sources", "seed": 0, "device": "cpu",
        "data": casia(data_root / "split"),
        "tasks": {"spec": "4", **({"sources": sources} if sources else {})},
        "model": {"backbone": "cnn4", "backbone_config": {"in_chans": 3, "width": 4}, "num_slots": num_slots},
        "method": {"name": "dsimplex-hoc"},
        "training": {"optimizer": {"name": "sgd", "lr": 0.01}, "epochs": 1, "batch_size": 8, "autocast": False,
                     "channels_last": "off"},
        "replay": {"per_class": PER_CLASS},
        "evaluation": {"query_set": {**tests, "portion": {"take": "first"}},
                       "gallery_set": {**tests, "portion": {"take": "second"}}, "batch_size": 16},
        "output": {"dir": str(output)},
    }


def next_month(root: Path, name: str = "2026-12", num_classes: int = 3) -> dict:
    return {"name": name, "data": casia(root), "num_classes": num_classes}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faces")
    write_identities(root / "split", SPLIT_IDS)
    write_identities(root / "new", NEW_IDS)
    write_identities(root / "test", TEST_IDS)
    return root


def folder_digest(root: Path) -> str:
    """The documented data digest, computed here from the files: sha256 over 'name\\tsize\\tsha256\\n' in name order."""
    lines = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        lines.append(f"{path.relative_to(root).as_posix()}\t{len(data)}\t{hashlib.sha256(data).hexdigest()}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


# ---- config and keys (no compute) -----------------------------------------------------------------------------------
def test_earlier_keys_do_not_see_the_own_data_task_and_its_key_holds_the_data(data_root, tmp_path):
    base = compile_scenario(validate_config(scenario(data_root, tmp_path / "run")))
    config = validate_config(scenario(data_root, tmp_path / "run", [next_month(data_root / "new")]))
    grown = compile_scenario(config)
    assert config.num_tasks == 2 and len(grown.model_stages) == 2
    # every stage of the split-only scenario has the same key in the scenario with the own-data task
    assert [stage.key for stage in base] == [stage.key for stage in grown if stage.key in base]
    assert len(grown) - len(base) == 1 + 2 + 2 + 1  # its training, two extractions, entries [1,0] [1,1], row 1
    own = grown[grown.model_stages[1]]
    assert own.kind == StageKind.FINETUNE and own.parents == (base.model_stages[0],)
    source = own.inputs.own_data
    assert source.sha256 == folder_digest(data_root / "new")
    assert (source.first_position, source.num_classes, source.pool.root) == (4, 3, None)
    assert own.inputs.data is None and own.inputs.classes is None

    # the same bytes elsewhere: the same keys; one changed image: new keys for the own-data task and what follows
    moved = tmp_path / "moved"
    shutil.copytree(data_root / "new", moved)
    assert compile_scenario(validate_config(scenario(data_root, tmp_path / "run", [next_month(moved)]))).model_stages \
        == grown.model_stages
    image = moved / "CASIA-WebFace" / "id0101" / "001.jpg"
    image.write_bytes(image.read_bytes() + b"\0")
    changed = compile_scenario(validate_config(scenario(data_root, tmp_path / "run", [next_month(moved)])))
    assert changed.model_stages[0] == grown.model_stages[0] and changed.model_stages[1] != grown.model_stages[1]


def test_k_too_small_for_the_classes_to_come_says_the_free_slots_and_the_k_that_fits(data_root, tmp_path):
    sources = [next_month(data_root / "new"), next_month(data_root / "x", "2027-01", 2)]
    document = scenario(data_root, tmp_path / "run", sources, num_slots=8)
    # 4 split classes + 3 of the first source fill 7 of K = 8 slots: the second source's 2 classes do not fit
    with pytest.raises(ConfigError) as error:
        validate_config(document)
    message = str(error.value)
    assert "model.num_slots: K=8 is too small for tasks.sources[1] ('2027-01', task 3)" in message
    assert "only 1 slot(s) remain free" in message and "set model.num_slots: 9" in message


def test_config_refusals_name_the_key(data_root, tmp_path):
    twice = scenario(data_root, tmp_path / "run", [next_month(data_root / "new"), next_month(data_root / "new")],
                     num_slots=12)
    with pytest.raises(ConfigError, match=r"tasks.sources: names must be unique, \['2026-12'\]"):
        validate_config(twice)
    unknown = scenario(data_root, tmp_path / "run", [{**next_month(data_root / "new"),
                                                      "data": {"dataset": "casia", "root": "x"}}])
    with pytest.raises(ConfigError,
                       match=r"tasks.sources\[0\].data.dataset: unknown dataset 'casia'; valid: .*casia_webface"):
        validate_config(unknown)
    retraining = {**scenario(data_root, tmp_path / "run", [next_month(data_root / "new")]), "method": {"name": "cores"}}
    with pytest.raises(ConfigError, match=r"tasks.sources: method 'cores' retrains every model on the data of all"):
        validate_config(retraining)


def test_identities_of_earlier_tasks_are_refused_named_and_counted(data_root, tmp_path):
    clash = write_identities(tmp_path / "clash", ["id0002", "id0104", "id0004"])
    config = validate_config(scenario(data_root, tmp_path / "run", [next_month(clash)]))
    problems = dict(data_problems(config))
    message = problems["tasks.sources[0].data"]
    assert "2 of its 3 classes are already classes of earlier tasks (tasks.spec): ['id0002', 'id0004']" in message
    wrong_count = validate_config(scenario(data_root, tmp_path / "run", [next_month(data_root / "new", num_classes=2)]))
    assert "set num_classes: 3" in dict(data_problems(wrong_count))["tasks.sources[0]"]
    assert data_problems(validate_config(scenario(data_root, tmp_path / "run", [next_month(data_root / "new")]))) == []


# ---- end to end -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grown_run(data_root, tmp_path_factory):
    """The split-only scenario run first; then the scenario with next month's task, run over the committed stages
    of the first run (its artifacts, manifests and replay shards: what appending a task to a finished run finds)."""
    torch.set_num_threads(1)
    first_dir, run_dir = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("grown")
    base = compile_scenario(validate_config(scenario(data_root, first_dir)))
    LocalExecutor(progress=False).run(base, RunStore(first_dir))
    for folder in ("artifacts", "manifests", "replay"):
        shutil.copytree(first_dir / folder, run_dir / folder)
    first_shard = sorted((run_dir / "replay" / base.model_stages[0]).rglob("*"))
    before = {path: path.read_bytes() for path in first_shard if path.is_file()}
    grown = compile_scenario(validate_config(scenario(data_root, run_dir, [next_month(data_root / "new")])))
    invocation = LocalExecutor(progress=False).run(grown, RunStore(run_dir))
    return base, grown, invocation, run_dir, before


def test_grown_run_computes_only_the_new_task_and_its_matrix_row(grown_run):
    base, grown, invocation, _, _ = grown_run
    assert set(invocation.skipped) == {stage.key for stage in base}
    assert sorted(grown[key].label for key in invocation.executed) == [
        "entry[1,0]", "entry[1,1]", "evaluate[row=1]", "extract[t=1,gallery]", "extract[t=1,query]", "finetune[t=1]"]
    values = np.asarray(invocation.result.matrix.values, dtype=np.float64)
    assert values.shape == (2, 2) and np.isnan(values[0, 1]) and np.isfinite(values[np.tril_indices(2)]).all()


def test_own_data_classes_take_the_slots_after_the_earlier_tasks(grown_run, data_root):
    _, grown, _, run_dir, _ = grown_run
    store, key = RunStore(run_dir), grown.model_stages[1]
    record = store.load_record(key)
    assert record["positions_seen"] == 4 + 3
    memory, _ = read_memory_shard(store, record["memory"]["shard"])
    own_rows = memory.source_task == 1
    pool = load_pool(grown[key].inputs.own_data.pool_spec())
    identities = np.asarray(pool.class_names)[np.asarray(pool.labels)[memory.indices[own_rows]]]
    # hand-computed: positions 0..3 are the split task's; the new identities follow in name order (4, 5, 6), and the
    # d-Simplex puts position p in slot K-1-p, right to left
    expected_slot = {"id0101": 3, "id0102": 2, "id0103": 1}
    slots = SlotMapper(K, finetune_labels=np.arange(7)).finetune_slots(memory.labels[own_rows])
    assert [expected_slot[name] for name in identities] == slots.tolist()
    assert sorted(set(identities)) == sorted(NEW_IDS)
    # the split task's classes kept positions 0..3
    assert sorted(set(memory.labels[~own_rows].tolist())) == [0, 1, 2, 3]


def test_the_memory_is_appended_and_the_earlier_shard_is_unchanged(grown_run):
    base, grown, _, run_dir, before = grown_run
    store = RunStore(run_dir)
    assert before and all(path.read_bytes() == data for path, data in before.items())
    first = store.load_record(base.model_stages[0])["memory"]["shard"]
    shard = store.load_record(grown.model_stages[1])["memory"]["shard"]
    parts = memory_parts(shard)
    assert [p.stage_key for p in parts] == list(grown.model_stages)
    assert (parts[0].sha256, parts[0].rows) == (first["sha256"], first["rows"]) == (first["sha256"], 4 * PER_CLASS)
    assert parts[1].rows == 3 * PER_CLASS  # the method's rule: a fixed quota per class, only the new classes added
    earlier, _ = read_memory_shard(store, first)
    memory, images = read_memory_shard(store, shard)
    assert np.array_equal(memory.indices[:earlier.indices.size], earlier.indices)
    assert memory.source_task.tolist() == [0] * (4 * PER_CLASS) + [1] * (3 * PER_CLASS)
    assert images.shape[0] == 7 * PER_CLASS


def test_plan_counts_the_own_data_task_with_the_earlier_exemplars(grown_run):
    _, grown, _, _, _ = grown_run
    images = stage_images(grown)[grown.model_stages[1]]
    # 18 images of the 3 new identities, 4 per half-batch: 4 batches (the rest of 2 dropped) of 4 task + 4 memory
    # samples drawn from the split task's 4 x 2 exemplars
    assert (images.epoch_images, images.memory, images.train_images) == (32, 4 * PER_CLASS, 32)


# ---- from the S3 test server ----------------------------------------------------------------------------------------
@pytest.fixture
def object_store(s3_env, s3_bucket, monkeypatch, tmp_path, fresh_object_storage):
    """compat_core.io configured for the test S3 server (from the AWS variables of ``s3_env``); the bucket name."""
    from cluster.storage.s3 import configure_object_storage

    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    configure_object_storage()
    yield s3_bucket


@pytest.mark.integration
def test_own_data_task_read_from_a_bucket_trains_what_the_local_folder_trains(object_store, grown_run, data_root,
                                                                             tmp_path):
    base, grown, local_invocation, local_dir, _ = grown_run
    uri = f"s3://{object_store}/faces/2026-12"
    local_root = data_root / "new"
    for path in sorted(p for p in local_root.rglob("*") if p.is_file()):
        cio.write_bytes(cio.join(uri, path.relative_to(local_root).as_posix()), path.read_bytes())
    run_dir = tmp_path / "s3-run"
    earlier = {stage.key for stage in base}
    for folder in ("artifacts", "manifests", "replay"):  # the finished split-only run's committed stages
        (run_dir / folder).mkdir(parents=True)
        for entry in (local_dir / folder).iterdir():
            if entry.name.removesuffix(".json") in earlier:
                (shutil.copytree if entry.is_dir() else shutil.copy)(entry, run_dir / folder / entry.name)
    from_bucket = compile_scenario(validate_config(scenario(data_root, run_dir, [next_month(uri)])))
    # the same bytes in a bucket: the same keys as from the local folder (the data's digest, not its place)
    assert [stage.key for stage in from_bucket] == [stage.key for stage in grown]
    invocation = LocalExecutor(progress=False).run(from_bucket, RunStore(run_dir))
    assert set(invocation.skipped) == earlier and len(invocation.executed) == 6
    np.testing.assert_array_equal(invocation.result.matrix.values, local_invocation.result.matrix.values)
    key = grown.model_stages[1]
    assert memory_parts(RunStore(run_dir).load_record(key)["memory"]["shard"]) == \
        memory_parts(RunStore(local_dir).load_record(key)["memory"]["shard"])


def test_own_data_task_from_compat_ingest_shards_is_keyed_by_the_manifest(data_root, tmp_path):
    from cluster.storage.ingest import ingest

    out = tmp_path / "ingested"
    ingest("casia_webface", str(data_root / "new"), "train", str(out), options={"image_size": 16}, progress=None)
    source = {"name": "2026-12", "data": {"dataset": "shards", "root": str(out), "split": "train"}, "num_classes": 3}
    config = validate_config(scenario(data_root, tmp_path / "run", [source]))
    assert data_problems(config) == []
    own = compile_scenario(config)[compile_scenario(config).model_stages[1]].inputs.own_data
    manifest = (out / "train" / "manifest.json").read_bytes()  # it pins every part's sha256
    expected = hashlib.sha256(f"manifest.json\t{len(manifest)}\t{hashlib.sha256(manifest).hexdigest()}\n".encode())
    assert own.sha256 == expected.hexdigest()
    pool, class_ids = own_task_classes(own)
    assert identities_of(pool, class_ids).tolist() == sorted(NEW_IDS)


def test_a_learnable_classifier_grows_by_the_own_data_classes(data_root, tmp_path):
    torch.set_num_threads(1)
    document = {**scenario(data_root, tmp_path / "run", [next_month(data_root / "new")]), "method": {"name": "er"}}
    graph = compile_scenario(validate_config(document))
    invocation = LocalExecutor(progress=False).run(graph, RunStore(tmp_path / "run"))
    record = RunStore(tmp_path / "run").load_record(graph.model_stages[1])
    # outputs 0..3 for the split task's classes, 4..6 for the new identities (no pre-training: P = 0)
    assert (record["num_active_classes"], record["positions_seen"]) == (7, 7)
    assert np.asarray(invocation.result.matrix.values).shape == (2, 2)


def test_a_relative_root_of_own_data_is_made_absolute_where_the_command_is_typed(data_root, tmp_path, monkeypatch):
    monkeypatch.chdir(data_root)
    config = validate_config(scenario(data_root, tmp_path / "run", [next_month(Path("new"))]))
    assert local_config_paths(config)["tasks.sources[0].data.root"] == "new"
    moved = absolute_config(config)
    assert moved.tasks.sources[0].data.root == str(data_root / "new")
    assert moved.tasks.sources[0].model_copy(update={"data": config.tasks.sources[0].data}) == config.tasks.sources[0]


def test_compat_run_refuses_identities_of_earlier_tasks_before_any_stage(data_root, tmp_path, capsys):
    clash = write_identities(tmp_path / "clash", ["id0003", "id0105"])
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(scenario(data_root, tmp_path / "run", [next_month(clash, num_classes=2)])))
    assert main(["run", str(config), "--no-progress", "--tracking-uri", "none"]) == 2
    err = capsys.readouterr().err
    assert "tasks.sources[0].data: 1 of its 2 classes are already classes of earlier tasks (tasks.spec): ['id0003']" \
        in err
    assert not list((tmp_path / "run").glob("manifests/*.json"))


def test_own_data_with_a_test_identity_breaks_the_open_set_protocol(data_root, tmp_path):
    leaking = write_identities(tmp_path / "leaking", ["id0106", "id0202"])
    config = validate_config(scenario(data_root, tmp_path / "run", [next_month(leaking, num_classes=2)]))
    message = dict(data_problems(config))["evaluation"]
    assert "open-set violation" in message and "tasks.sources[0].data" in message and "id0202" in message


@pytest.mark.integration
def test_own_data_task_on_ray_gives_the_local_matrix_bit_for_bit(grown_run, data_root, tmp_path, ray_local):
    from cluster.ray.task_backend import RayExecutor

    _, grown, local_invocation, local_dir, _ = grown_run
    graph = compile_scenario(validate_config(scenario(data_root, tmp_path / "ray", [next_month(data_root / "new")])))
    assert [stage.key for stage in graph] == [stage.key for stage in grown]
    invocation = RayExecutor(progress=False).run(graph, RunStore(tmp_path / "ray"))
    assert invocation.result.matrix.values.tobytes() == local_invocation.result.matrix.values.tobytes()
    key = grown.model_stages[1]
    assert memory_parts(RunStore(tmp_path / "ray").load_record(key)["memory"]["shard"]) == \
        memory_parts(RunStore(local_dir).load_record(key)["memory"]["shard"])


def test_config_hash_of_a_scenario_without_own_data_tasks_is_unchanged(data_root, tmp_path):
    document = scenario(data_root, tmp_path / "run")
    data = validate_config(document).model_dump(mode="json")
    for name in ("output", "resources", "description", "paper", "initial_model_ignore_keys"):
        data.pop(name)
    data["tasks"].pop("sources")
    data["model"].pop("simplex_norm")  # the default d-Simplex norm leaves the hash of configs written without it
    for key in HOW_NOT_WHAT:
        data["training"].pop(key)
    assert config_hash(validate_config(document)) == stable_hash(data)
    grown = validate_config(scenario(data_root, tmp_path / "run", [next_month(data_root / "new")]))
    assert config_hash(grown) != config_hash(validate_config(document))


def test_a_finished_run_grows_by_next_months_folder_through_compat_run_resume(data_root, tmp_path):
    """The user's path: the split-only run finished, next month's folder appended to its config file as a
    ``tasks.sources`` entry, and ``compat run CONFIG --resume RUN``: only the new task's six stages run, and the grown
    matrix equals byte for byte the matrix of the longer scenario run from scratch in another folder."""
    torch.set_num_threads(1)
    run_dir, scratch = tmp_path / "run", tmp_path / "scratch"
    first, grown = tmp_path / "month0.yaml", tmp_path / "month1.yaml"
    first.write_text(yaml.safe_dump(scenario(data_root, run_dir)))
    grown.write_text(yaml.safe_dump(scenario(data_root, run_dir, [next_month(data_root / "new")])))
    quiet = ["--no-progress", "--tracking-uri", "none"]
    assert main(["run", str(first), *quiet]) == 0
    before = {path.name: path.read_bytes() for path in (run_dir / "manifests").glob("*.json")}
    assert main(["run", str(grown), "--resume", str(run_dir), *quiet]) == 0
    after = {path.name: path.read_bytes() for path in (run_dir / "manifests").glob("*.json")}
    assert {name: after[name] for name in before} == before and len(after) == len(before) + 6
    assert len(list((run_dir / "extensions").glob("*.json"))) == 1
    assert main(["run", str(grown), "--output", str(scratch), *quiet]) == 0
    for name in ("matrix.json", "metrics.json"):
        assert (run_dir / name).read_bytes() == (scratch / name).read_bytes(), name
