"""Epoch checkpoints (pipelines.training.checkpoints): a training interrupted after an epoch or by SIGTERM mid-epoch resumes
from the run store bit-identically to an uninterrupted run (CPU, fp32); checkpoints of committed stages are deleted."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from compat_core.models.compat_model import frozen_copy
from pipelines.methods import get_method
from pipelines.store.run_store import RunStore
from pipelines.training.checkpoints import (
    MAX_WRITE_FRACTION,
    CheckpointPolicy,
    EpochCheckpoint,
    StoreCheckpointSink,
    collect_garbage,
    decode_state,
    encode_state,
)
from pipelines.training.loop import train_task
from pipelines.training.task_data import SelectionSplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_training import config, source, task_data, tiny_model, weights_equal  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[2]


class Interrupted(RuntimeError):
    pass


class CrashAfterSaves(StoreCheckpointSink):
    """A sink that dies (raises) right after its ``crash_after``-th save: a stage killed just after a checkpoint."""

    def __init__(self, store, key, every, crash_after):
        super().__init__(store, key, CheckpointPolicy(every))
        self.crash_after = crash_after

    def save(self, checkpoint):
        super().save(checkpoint)
        if self.saved == self.crash_after:
            raise Interrupted(f"killed after epoch {checkpoint.epochs_done}")


def _records_without_timing(records):
    return [(r.task, r.epoch, r.step, r.loss, r.loss_parts, r.lr, r.metrics) for r in records]


def _setup(source, method_name: str, selection: bool):
    classifier = get_method(method_name).classifier
    extra = {}
    if selection:
        labels = source.labels
        extra["selection"] = SelectionSplit(source, np.flatnonzero(labels < 3)[::2], np.flatnonzero(labels < 3)[1::2])
    data = task_data(source, classifier, **extra)
    old = frozen_copy(tiny_model(classifier, seed=1, classes=3 if classifier == "learnable" else 0))
    settings = dict(epochs=4, model_selection="compatibility" if selection else "last", selection_strict=False)
    return classifier, data, old, settings


@pytest.mark.parametrize("method_name, selection, workers", [("dsimplex-hoc", False, 0), ("fan", False, 0),
                                                              ("er", True, 0), ("dsimplex-hoc", False, 2)])
def test_training_killed_after_epoch_2_resumes_bit_identically(source, tmp_path, method_name, selection, workers):
    """Reference: 4 epochs without checkpoints. Then a run killed right after the epoch-2 checkpoint and a restart
    with a fresh model: identical weights, method extra state (FAN adapter), selected epoch and records; the restart
    trains only epochs 3 and 4. With input workers the restart's stream, opened before the checkpoint is read (from
    epoch 0), is replaced by one from the checkpoint's position."""
    classifier, data, old, settings = _setup(source, method_name, selection)
    settings["input_workers"] = workers
    classes = 3 if classifier == "learnable" else 0
    reference = train_task(tiny_model(classifier, classes=classes), old, get_method(method_name), data,
                           config(**settings))
    store = RunStore(tmp_path / "run")
    with pytest.raises(Interrupted):
        train_task(tiny_model(classifier, classes=classes), old, get_method(method_name), data, config(**settings),
                   checkpoints=CrashAfterSaves(store, "finetune-x", 2, crash_after=1))
    assert store.list_files("checkpoints/finetune-x") == ["epoch-00002.json", "epoch-00002.pt"]
    steps_after_restart = []
    sink = StoreCheckpointSink(store, "finetune-x", CheckpointPolicy(2))
    resumed = train_task(tiny_model(classifier, classes=classes), old, get_method(method_name), data,
                         config(**settings), checkpoints=sink,
                         progress=lambda epoch, step, total, speed: steps_after_restart.append(epoch))
    assert weights_equal(resumed.model, reference.model)
    assert sorted(set(steps_after_restart)) == [2, 3]  # 0-based epochs 2, 3: only the last two were recomputed
    assert resumed.selected_epoch == reference.selected_epoch
    assert _records_without_timing(resumed.records) == _records_without_timing(reference.records)
    assert resumed.extra_state.keys() == reference.extra_state.keys()
    for name, adapter in reference.extra_state.items():
        state, restored = adapter.state_dict(), resumed.extra_state[name].state_dict()
        assert state.keys() == restored.keys() and all(torch.equal(state[k], restored[k]) for k in state)
    if method_name == "fan":
        assert reference.extra_state  # the adapter really is method extra state
    assert sink.saved == 0  # every 2 epochs: epoch 4 is the last, the stage commits instead


def test_checkpoint_bytes_are_verified_and_read_without_pickle(tmp_path):
    store = RunStore(tmp_path / "run")
    sink = StoreCheckpointSink(store, "pretrain-p", CheckpointPolicy(1))
    sink.save(EpochCheckpoint(1, {"format": 1, "w": torch.arange(3.0), "python": (3, (1, 2), None)}))
    sink.save(EpochCheckpoint(2, {"format": 1, "w": torch.arange(4.0)}))
    assert store.list_files("checkpoints/pretrain-p") == ["epoch-00002.json", "epoch-00002.pt"]  # older deleted
    latest = sink.load_latest()
    assert latest.epochs_done == 2 and torch.equal(latest.state["w"], torch.arange(4.0))
    # a flipped byte: the checkpoint is skipped (no older one left), never loaded
    blob = tmp_path / "run/checkpoints/pretrain-p/epoch-00002.pt"
    data = bytearray(blob.read_bytes())
    data[-5] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert sink.load_latest() is None
    # weights_only: an object that is not plain data is refused
    with pytest.raises(Exception, match="weights_only|Unsupported|WeightsUnpickler"):
        decode_state(encode_state({"bad": Interrupted("x")}))
    size = sum(path.stat().st_size for path in (tmp_path / "run/checkpoints/pretrain-p").iterdir())
    assert collect_garbage(store, "pretrain-p") == size > len(data)
    assert store.list_dirs("checkpoints") == []


def test_bad_checkpoint_interval_is_refused(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_every_epochs"):
        CheckpointPolicy(-1)
    with pytest.raises(ValueError, match="checkpoint_every_minutes"):
        CheckpointPolicy(None, float("nan"))
    with pytest.raises(TypeError, match="CheckpointPolicy"):
        StoreCheckpointSink(RunStore(tmp_path), "k", 1)


def test_time_policy_bounds_the_write_share():
    """By time: no save before every_minutes, and never sooner than 50x the last write (writes <= 2 %)."""
    policy = CheckpointPolicy(None, every_minutes=1.0, last_save=100.0)
    assert not policy.due(1, now=159.0) and policy.due(1, now=160.0)
    policy.wrote(6.0, now=170.0)  # a slow store: a 6 s write
    assert 6.0 / MAX_WRITE_FRACTION == 300.0
    assert not policy.due(2, now=170.0 + 299.0) and policy.due(2, now=170.0 + 300.0)
    epochs = CheckpointPolicy(3)
    assert [epochs.due(n) for n in range(1, 7)] == [False, False, True, False, False, True]


def test_default_policy_saves_by_time_during_training(source, tmp_path):
    """The default (by time) writes no checkpoint in a short stage, and one per epoch when the interval is 0."""
    data = task_data(source, "simplex")
    old = frozen_copy(tiny_model(seed=1))
    default = StoreCheckpointSink(RunStore(tmp_path / "a"), "finetune-x", CheckpointPolicy())
    quiet = train_task(tiny_model(seed=0), old, get_method("dsimplex-hoc"), data, config(epochs=3),
                       checkpoints=default)
    assert default.saved == 0 and (quiet.checkpoints_written, quiet.checkpoint_seconds) == (0, 0.0)
    eager = StoreCheckpointSink(RunStore(tmp_path / "b"), "finetune-x", CheckpointPolicy(None, every_minutes=0.0))
    result = train_task(tiny_model(seed=0), old, get_method("dsimplex-hoc"), data, config(epochs=3),
                        checkpoints=eager)
    assert eager.saved >= 1 and eager.policy.write_seconds > 0
    # the result counts the writes the sink made, and their seconds are part of the task's seconds
    assert result.checkpoints_written == eager.saved
    assert eager.policy.write_seconds <= result.checkpoint_seconds < result.seconds


SIGTERM_SCRIPT = """
import sys, os, signal, torch
sys.path.insert(0, {here!r})
torch.set_num_threads(1)
import numpy as np
from test_training import config, task_data, tiny_model
from compat_core.data.source import ArraySource
from compat_core.models.compat_model import frozen_copy
from pipelines.training.checkpoints import CheckpointPolicy, StoreCheckpointSink
from pipelines.methods import get_method
from pipelines.store.run_store import RunStore
from pipelines.training.loop import train_task
from safetensors.torch import save_file

rng = np.random.default_rng(0)
images = rng.integers(0, 60, size=(48, 16, 16, 1), dtype=np.uint8)
labels = np.repeat(np.arange(6), 8)
for index, label in enumerate(labels):
    row, col = divmod(int(label), 3)
    images[index, 2 + 6 * row : 7 + 6 * row, 1 + 5 * col : 5 + 5 * col] = 230
source = ArraySource(name="squares", images=images, labels=labels, class_names=[str(c) for c in range(6)], hflip=False)
data = task_data(source, "simplex")
old = frozen_copy(tiny_model(seed=1))
kill_at = int(sys.argv[2])

def progress(epoch, step, total, speed):
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGTERM)  # what a preempted node receives

sink = StoreCheckpointSink(RunStore(sys.argv[1]), "finetune-x", CheckpointPolicy(10))
result = train_task(tiny_model(seed=0), old, get_method("dsimplex-hoc"), data, config(epochs=4), progress=progress,
                    checkpoints=sink)
save_file({{k: v.contiguous() for k, v in result.model.state_dict().items()}}, sys.argv[3])
"""


def test_sigterm_mid_epoch_saves_and_the_restart_is_bit_identical(source, tmp_path):
    """SIGTERM at step 8 (mid-epoch 2 of 4; 6 steps per epoch): the process saves a checkpoint at the step
    boundary and dies by SIGTERM; the restart continues from step 8 to the same weights as an uninterrupted run.
    (every_epochs=10: only the SIGTERM checkpoint exists.)"""
    from safetensors.torch import load_file

    data = task_data(source, "simplex")
    old = frozen_copy(tiny_model(seed=1))
    torch.set_num_threads(1)
    reference = train_task(tiny_model(seed=0), old, get_method("dsimplex-hoc"), data, config(epochs=4))
    script = tmp_path / "train.py"
    script.write_text(SIGTERM_SCRIPT.format(here=str(Path(__file__).resolve().parent)))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = tmp_path / "run"
    killed = subprocess.run([sys.executable, str(script), str(run), "8", str(tmp_path / "a.safetensors")],
                            env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGTERM, killed.stderr
    assert "SIGTERM received; checkpoint at epoch 1 step 2 saved" in killed.stdout
    manifest = json.loads((run / "checkpoints/finetune-x/epoch-00001-step-000002.json").read_text())
    assert (manifest["epochs_done"], manifest["step_in_epoch"]) == (1, 2)
    finished = subprocess.run([sys.executable, str(script), str(run), "-1", str(tmp_path / "b.safetensors")],
                              env=env, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    weights = load_file(str(tmp_path / "b.safetensors"))
    expected = reference.model.state_dict()
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)


# ---- through the engine ------------------------------------------------------------------------------------------
def _tiny_graph(output: Path, every: int, epochs: int = 3):
    import tiny_scenario_helpers as tiny

    from pipelines.config.load import validate_config
    from pipelines.graph.compile import compile_scenario

    tiny.register()
    document = tiny.scenario("dsimplex-hoc", output=str(output))
    document["training"].update(epochs=epochs, checkpoint_every_epochs=every)
    return compile_scenario(validate_config(document))


def test_stage_killed_after_a_checkpoint_resumes_to_the_same_matrix_and_checkpoints_are_collected(tmp_path,
                                                                                                   monkeypatch):
    """finetune[t=2] dies right after its epoch-2 checkpoint (of 3); the run started again restores it and ends
    with the matrix of a run without checkpoints (same stage keys: the interval is not part of them); no checkpoint
    is left once the stages are committed."""
    import pipelines.training.checkpoints as checkpoints
    from pipelines.engine.runner import LocalExecutor

    torch.set_num_threads(1)
    reference_graph = _tiny_graph(tmp_path / "reference", every=0)
    LocalExecutor(progress=False).run(reference_graph, RunStore(tmp_path / "reference"))
    graph = _tiny_graph(tmp_path / "run", every=1)
    assert [s.key for s in graph] == [s.key for s in reference_graph]
    target = next(s for s in graph if s.kind == "finetune" and s.task == 1)
    original = checkpoints.StoreCheckpointSink.save

    def dying_save(self, checkpoint):
        original(self, checkpoint)
        if self.stage_key == target.key and checkpoint.epochs_done == 2:
            raise Interrupted("stage killed after its epoch-2 checkpoint")

    monkeypatch.setattr(checkpoints.StoreCheckpointSink, "save", dying_save)
    store = RunStore(tmp_path / "run")
    with pytest.raises(Interrupted):
        LocalExecutor(progress=False).run(graph, store)
    assert store.list_files(f"checkpoints/{target.key}") == ["epoch-00002.json", "epoch-00002.pt"]
    monkeypatch.setattr(checkpoints.StoreCheckpointSink, "save", original)
    LocalExecutor(progress=False).run(graph, store)
    for name in ("matrix.json", "metrics.json"):
        assert json.loads((tmp_path / "run" / name).read_text()) == json.loads(
            (tmp_path / "reference" / name).read_text()), name
    assert store.list_dirs("checkpoints") == []
    resumed_record = store.load_record(target.key)
    reference_record = RunStore(tmp_path / "reference").load_record(target.key)
    assert resumed_record["training"]["final_loss"] == reference_record["training"]["final_loss"]
    assert resumed_record["training"]["epochs_recorded"] == 3  # the restored records count too
    assert resumed_record["training"]["resumed_from_epoch"] == 2
    assert reference_record["training"]["resumed_from_epoch"] is None


def test_sigterm_to_compat_run_saves_the_stage_and_resume_finishes_it_identically(tmp_path):
    """`compat run` (in-process backend) gets SIGTERM while a stage trains: the stage saves a checkpoint at the next
    step, the driver exits by SIGTERM, and `compat run --resume` continues that stage from the checkpoint and ends
    with the matrix of an uninterrupted run."""
    import time

    import tiny_scenario_helpers as tiny
    import yaml
    from test_executor_resume import HERE, _run

    from pipelines.engine.runner import LocalExecutor

    torch.set_num_threads(1)
    graph = _tiny_graph(tmp_path / "reference", every=1)
    LocalExecutor(progress=False).run(graph, RunStore(tmp_path / "reference"))
    script = tmp_path / "compat_tiny.py"
    script.write_text(tiny.CLI_SCRIPT.format(here=str(HERE)))
    document = tiny.scenario("dsimplex-hoc")
    document["training"].update(epochs=3, checkpoint_every_epochs=1)
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(document))
    run_dir = tmp_path / "run"
    process = _run(["run", str(config_path), "--output", str(run_dir), "--no-progress", "--tracking-uri", "none"],
                   script, wait=False)
    target = next(s for s in graph if s.kind == "finetune" and s.task == 1)
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:
        if (run_dir / "checkpoints" / target.key).is_dir() and any((run_dir / "checkpoints" / target.key).iterdir()):
            break
        time.sleep(0.02)
    assert process.poll() is None, "the run finished before it could be signalled"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == -signal.SIGTERM
    assert not RunStore(run_dir).has(target.key)
    resumed = _run(["run", "--resume", str(run_dir), "--no-progress", "--tracking-uri", "none"], script)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for name in ("matrix.json", "metrics.json"):
        assert json.loads((run_dir / name).read_text()) == json.loads(
            (tmp_path / "reference" / name).read_text()), name
    resumed_from = RunStore(run_dir).load_record(target.key)["training"]["resumed_from_epoch"]
    assert resumed_from in (1, 2, 3)  # the checkpoint seen (epoch 1) or a later one: the SIGTERM one (step boundary)
    assert RunStore(run_dir).list_dirs("checkpoints") == []
