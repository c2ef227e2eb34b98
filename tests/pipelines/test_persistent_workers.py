"""Input workers that outlive a task (``training.persistent_workers``): the same batches, so the same weights, as
workers started per task, and the setting stays out of stage keys and config hashes."""
from __future__ import annotations

import numpy as np
import torch

from compat_core.data.source import ArraySource
from compat_core.data.stream import _POOLS, close_persistent_workers
from compat_core.models.compat_model import create_model, frozen_copy
from pipelines.config.load import HOW_NOT_WHAT
from pipelines.methods import get_method
from pipelines.training.loop import train_task
from pipelines.training.settings import TrainConfig
from pipelines.training.task_data import TaskData

K = 16


def two_tasks(persistent: bool, prefetch_first: bool = False) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    labels = np.arange(64) % 8
    source = ArraySource(name="pool", images=rng.integers(0, 255, size=(64, 16, 16, 3), dtype=np.uint8),
                         labels=labels, class_names=[str(c) for c in range(8)])
    torch.manual_seed(0)
    model = create_model("cnn4", K, classifier="simplex", backbone_config={"width": 4})
    config = TrainConfig(epochs=2, batch_size=8, optimizer={"lr": 0.05}, autocast=False, input_workers=2,
                         persistent_workers=persistent, prefetch_first_batches=prefetch_first, seed=1)
    for task, classes in enumerate(((0, 1, 2, 3), (4, 5, 6, 7))):
        indices = np.flatnonzero(np.isin(labels, classes))
        data = TaskData(source=source, task=task, indices=indices, slots=K - 1 - labels[indices],
                        num_old_classes=4 * task, num_new_classes=4)
        model = train_task(model, frozen_copy(model) if task else None, get_method("dsimplex-hoc"), data,
                           config).model
        if persistent:
            assert id(source) in _POOLS  # the workers wait for the next task
    close_persistent_workers()
    return {name: value.clone() for name, value in model.state_dict().items()}


def test_persistent_workers_train_the_same_weights_as_per_task_workers():
    per_task, persistent = two_tasks(False), two_tasks(True)
    assert per_task.keys() == persistent.keys()
    assert all(torch.equal(per_task[name], persistent[name]) for name in per_task)
    assert "persistent_workers" in HOW_NOT_WHAT


def test_prefetching_the_first_batches_trains_the_same_weights():
    """The stream opened before the method's setup (``training.prefetch_first_batches``) yields the batches of the
    stream opened when the epochs start: bit-identical weights, with persistent and with per-task workers."""
    for persistent in (True, False):
        late, early = two_tasks(persistent, prefetch_first=False), two_tasks(persistent, prefetch_first=True)
        assert all(torch.equal(late[name], early[name]) for name in late)
    assert "prefetch_first_batches" in HOW_NOT_WHAT
