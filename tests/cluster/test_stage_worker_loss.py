"""The Ray worker process training a fine-tuning stage dies right after the stage's epoch-2 checkpoint (of 3);
Ray retries the task in a new worker, which resumes from that checkpoint: the run ends with the matrix of the
in-process backend and no epoch is recomputed (local Ray of the session, local run folder)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

from pipelines.config.load import validate_config  # noqa: E402
from pipelines.engine.runner import LocalExecutor  # noqa: E402
from pipelines.graph.compile import compile_scenario  # noqa: E402
from pipelines.store.run_store import RunStore  # noqa: E402


def _die_after_checkpoint_setup(marker: str, stage_key: str, epochs_done: int):
    """Worker setup: the worker saving ``stage_key``'s checkpoint after ``epochs_done`` epochs exits at once
    (os._exit, as a process killed by the OOM killer or a crash), once."""
    def setup():
        import os as _os

        import pipelines.training.checkpoints as checkpoints

        tiny.register()
        original = checkpoints.StoreCheckpointSink.save
        if getattr(original, "_dying", False):
            return

        def save(self, checkpoint):
            original(self, checkpoint)
            if (self.stage_key == stage_key and checkpoint.epochs_done == epochs_done
                    and not _os.path.exists(marker)):
                open(marker, "w").close()
                _os._exit(1)

        save._dying = True
        checkpoints.StoreCheckpointSink.save = save
    return setup


def test_training_worker_killed_after_a_checkpoint_resumes_from_it(ray_local, tmp_path):
    import ray

    from cluster.ray.task_backend import RayExecutor

    tiny.register()
    ray.cloudpickle.register_pickle_by_value(tiny)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    torch.set_num_threads(1)
    document = tiny.scenario("dsimplex-hoc", output=str(tmp_path / "local"))
    document["training"].update(epochs=3, checkpoint_every_epochs=1)
    graph = compile_scenario(validate_config(document))
    LocalExecutor(progress=False).run(graph, RunStore(tmp_path / "local"))
    target = next(stage for stage in graph if stage.kind == "finetune" and stage.task == 1)
    marker = tmp_path / "died"
    store = RunStore(tmp_path / "ray")
    executor = RayExecutor(progress=False, setup=_die_after_checkpoint_setup(str(marker), target.key, 2))
    executor.run(graph, store)
    assert marker.exists()  # the worker really died after the checkpoint
    for name in ("matrix.json", "metrics.json"):
        assert json.loads((tmp_path / "ray" / name).read_text()) == json.loads((tmp_path / "local" / name).read_text())
    training = store.load_record(target.key)["training"]
    assert training["resumed_from_epoch"] == 2 and training["epochs_recorded"] == 3
    assert store.list_dirs("checkpoints") == []


def _sigterm_at_step_setup(marker: str, stage_key: str, step: int):
    """Worker setup: the worker training ``stage_key`` receives SIGTERM (what a preempted node's processes get)
    after optimiser step ``step``, once."""
    def setup():
        import os as _os
        import signal as _signal

        import pipelines.stages.training_stages as train_stages

        tiny.register()
        original = train_stages._progress_hook
        if getattr(original, "_preempting", False):
            return

        def progress_hook(ctx):
            hook = original(ctx)

            def wrapped(epoch, done, total, speed):
                hook(epoch, done, total, speed)
                if ctx.stage.key == stage_key and done == step and not _os.path.exists(marker):
                    open(marker, "w").close()
                    _os.kill(_os.getpid(), _signal.SIGTERM)
            return wrapped

        progress_hook._preempting = True
        train_stages._progress_hook = progress_hook
    return setup


def test_sigterm_to_a_training_worker_saves_mid_epoch_and_the_retry_resumes(ray_local, tmp_path):
    """SIGTERM in the middle of epoch 2 of finetune[t=2] (1-based): the stage saves a checkpoint at the next step
    boundary, its worker ends, Ray retries the task, and the retry continues from that step: same matrix."""
    import ray

    from cluster.ray.task_backend import RayExecutor

    tiny.register()
    ray.cloudpickle.register_pickle_by_value(tiny)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    torch.set_num_threads(1)
    document = tiny.scenario("dsimplex-hoc", output=str(tmp_path / "local"))
    document["training"].update(epochs=3, checkpoint_every_epochs=5)  # only the SIGTERM checkpoint is written
    graph = compile_scenario(validate_config(document))
    LocalExecutor(progress=False).run(graph, RunStore(tmp_path / "local"))
    target = next(stage for stage in graph if stage.kind == "finetune" and stage.task == 1)
    steps = RunStore(tmp_path / "local").load_record(target.key)
    marker = tmp_path / "preempted"
    store = RunStore(tmp_path / "ray")
    # 2 task classes x 10 images, batches of 4 task + 4 memory images: 5 steps per epoch; step 7 is in epoch 2
    RayExecutor(progress=False, setup=_sigterm_at_step_setup(str(marker), target.key, 7)).run(graph, store)
    assert marker.exists()
    for name in ("matrix.json", "metrics.json"):
        assert json.loads((tmp_path / "ray" / name).read_text()) == json.loads((tmp_path / "local" / name).read_text())
    training = store.load_record(target.key)["training"]
    assert training["resumed_from_epoch"] == 1 and training["final_loss"] == steps["training"]["final_loss"]
