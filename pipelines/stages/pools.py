"""Data pools of a scenario: opening a pool spec (dataset + filters, cached per process), the task sequence's class
ids, class identities across splits, the data-level open-set guard (no training class in the query or gallery set),
and the classifier slots of fine-tuning class positions.

Class bookkeeping: the fine-tuning classes are numbered by *position* in task order (0 = first class of task 0); a
task given by its own data (``tasks.sources``) numbers its pool's classes, in class-id order, after every earlier
task's, and its data is checked against the digest its key holds and against the earlier tasks' identities.
Slots are derived per model line: d-Simplex methods put position ``i`` in slot ``K-1-i`` (right to left, after the
third-party classes in slots 0.. left to right); learnable classifiers put it at output ``P + i`` where ``P`` is the
number of classes the model line was pre-trained on (0 without pre-training).
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from compat_core.data.datasets import dataset_info, load_dataset
from compat_core.data.replay_parquet import encoded_images
from compat_core.data.source import keep_rows
from compat_core.data.tasks import build_task_sequence
from compat_core.kinds import ClassifierFamily
from compat_core.slots import SlotMapper
from pipelines.config.load import stable_hash
from pipelines.config.schema import PoolSpec, ScenarioConfig
from pipelines.graph.source_digests import data_digest
from pipelines.stages.inputs import ClassOrder, DataGuards, OpenSetPools, TaskSource


class SubsetSource:
    """An ImageSource view of ``indices`` of another source (class ids, names and statistics unchanged)."""

    def __init__(self, source: Any, indices: np.ndarray, name: str | None = None) -> None:
        self.source = source
        self.indices = np.asarray(indices, dtype=np.int64)
        self.name = name or source.name
        self.labels = np.asarray(source.labels)[self.indices]
        coarse = getattr(source, "coarse_labels", None)
        self.coarse_labels = None if coarse is None else np.asarray(coarse)[self.indices]
        fine = getattr(source, "fine_labels", None)
        self.fine_labels = None if fine is None else np.asarray(fine)[self.indices]
        self.class_names = source.class_names
        self.image_shape = source.image_shape
        self.mean = source.mean
        self.std = source.std
        self.hflip = source.hflip

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def read(self, indices: np.ndarray) -> np.ndarray:
        return self.source.read(self.indices[np.asarray(indices, dtype=np.int64)])

    def keep_rows(self, indices: np.ndarray) -> None:
        """Keep rows ``indices`` resident in the underlying source (see ``compat_core.data.stream.keep_rows``)."""
        keep_rows(self.source, self.indices[np.asarray(indices, dtype=np.int64)])

    def encoded_images(self, indices: np.ndarray):
        """The underlying source's encoded images of ``indices`` (replay shards store them), or None."""
        return encoded_images(self.source, self.indices[np.asarray(indices, dtype=np.int64)])


_POOL_CACHE: dict[str, Any] = {}


def load_pool(spec: PoolSpec, key: str = "pool") -> Any:
    """Open a pool (dataset + filters); cached in-process by its spec. Raises naming ``key`` when data is missing."""
    # a relative local root means another folder after a chdir: the cache key holds the resolved location
    root = spec.root
    if root is not None and "://" not in root and not os.path.isabs(root):
        root = os.path.abspath(root)
    cache_key = json.dumps([spec.model_dump(mode="json"), root], sort_keys=True)
    if cache_key in _POOL_CACHE:
        return _POOL_CACHE[cache_key]
    try:
        source = load_dataset(spec.dataset, root=spec.root, split=spec.split, **spec.options)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{key}: data of {spec.dataset!r} (split {spec.split!r}, root {spec.root!r}) "
                                f"not found: {error}") from error
    labels = np.asarray(source.labels)
    keep = np.ones(labels.shape[0], dtype=bool)
    if spec.classes is not None:
        unknown = sorted(set(spec.classes) - set(np.unique(labels).tolist()))
        if unknown:
            raise ValueError(f"{key}.classes: ids {unknown[:10]} do not occur in {spec.dataset}/{spec.split}")
        keep &= np.isin(labels, np.asarray(spec.classes))
    indices = np.flatnonzero(keep)
    if spec.per_class is not None:
        chosen = [indices[labels[indices] == c][: spec.per_class] for c in np.unique(labels[indices])]
        indices = np.sort(np.concatenate(chosen)) if chosen else indices[:0]
    if spec.portion is not None:
        rng = np.random.default_rng(spec.portion.seed)
        parts = []
        for c in np.unique(labels[indices]):
            members = indices[labels[indices] == c]
            members = members[rng.permutation(members.shape[0])]
            cut = int(round(spec.portion.fraction * members.shape[0]))
            parts.append(members[:cut] if spec.portion.take == "first" else members[cut:])
        indices = np.sort(np.concatenate(parts)) if parts else indices[:0]
    if spec.num_samples is not None and indices.shape[0] != spec.num_samples:
        raise ValueError(f"{key}.num_samples: config expects {spec.num_samples} samples, the data has "
                         f"{indices.shape[0]} after filtering; fix num_samples or the filters")
    pool = source if indices.shape[0] == labels.shape[0] and spec.normalize is None else SubsetSource(source, indices)
    if spec.normalize is not None:
        channels = int(pool.image_shape[-1])
        if len(spec.normalize.mean) != channels:
            raise ValueError(f"{key}.normalize: {len(spec.normalize.mean)} values per statistic, but the images of "
                             f"{spec.dataset}/{spec.split} have {channels} channels")
        pool.mean, pool.std = tuple(spec.normalize.mean), tuple(spec.normalize.std)
    _POOL_CACHE[cache_key] = pool
    return pool


def task_classes(data: PoolSpec, classes: ClassOrder, guards: DataGuards | None = None) -> list[np.ndarray]:
    """Dataset class ids of each task of ``classes`` (0-based list index), by the seeded task-sequence builder: a
    permutation of all the pool's classes (or the order given) cut into consecutive chunks, so the classes of a
    task never depend on the tasks after it. ``guards``: the run's, whose tasks (all of them) the pool must hold."""
    pool = load_pool(data, "data")
    class_ids = np.unique(np.asarray(pool.labels))
    spec, total = "+".join(str(count) for count in classes.increments), sum(classes.increments)
    if guards is not None and guards.task_classes > total:
        spec, total = guards.tasks_spec, guards.task_classes
    if class_ids.shape[0] < total:
        raise ValueError(f"tasks.spec: {spec!r} needs {total} classes, data pool has {class_ids.shape[0]}")
    if classes.order == "given":
        # the reference codes take classes in the dataset's id order (alphabetical for CIFAR) or a published list
        class_ids = np.asarray(class_ids if data.classes is None else data.classes, dtype=np.int64)
    sequence = build_task_sequence(class_ids, "+".join(str(count) for count in classes.increments), classes.seed,
                                   order=classes.order)
    return [np.asarray(t, dtype=np.int64) for t in sequence.tasks]


def own_task_classes(source: TaskSource) -> tuple[Any, np.ndarray]:
    """(pool, sorted class ids) of a task given by its own data, once the data is the data its key holds (the
    content digest) and has the classes its entry declares; raises naming ``tasks.sources[i]`` otherwise."""
    key, spec = source.config_key, source.pool_spec()
    if source.sha256 is not None:
        digest = data_digest(spec)
        if digest != source.sha256:
            raise ValueError(f"{key}.data: the data at {spec.root} is not the data this stage's key was made "
                             f"from (sha256 {source.sha256}, now {digest or 'unreadable'}); data of a task never "
                             f"changes under its key: run again to compile the new data into new keys")
    pool = load_pool(spec, f"{key}.data")
    class_ids = np.unique(np.asarray(pool.labels))
    if class_ids.size != source.num_classes:
        raise ValueError(f"{key}.num_classes: the entry says {source.num_classes}, the data at "
                         f"{spec.root} holds {class_ids.size} classes; set num_classes: {class_ids.size}")
    return pool, class_ids.astype(np.int64)


def identities_of(pool: Any, class_ids: np.ndarray) -> np.ndarray:
    """Class identities (the readers' class names: identity folders, published identity ids) of ``class_ids``."""
    names = np.asarray(pool.class_names, dtype=object)
    return names[np.asarray(class_ids, dtype=np.int64)].astype(str)


def task_source_data_problems(config: ScenarioConfig) -> list[tuple[str, str]]:
    """(config key, problem) for each ``tasks.sources`` entry whose data does not hold its declared classes, whose
    images differ in shape from the fine-tuning pool's (the replay memory mixes them), or whose classes (by
    identity) were already a class of an earlier task: named and counted, with the fix."""
    if not config.tasks.sources:
        return []
    problems = []
    split_pool = load_pool(config.data, "data")
    split_classes = np.concatenate(scenario_task_classes(config))
    earlier = {str(name): "tasks.spec" for name in identities_of(split_pool, split_classes)}
    for index, spec in enumerate(config.tasks.sources):
        key = f"tasks.sources[{index}]"
        try:
            pool, class_ids = own_task_classes(TaskSource(name=spec.name, pool=spec.data, sha256=None,
                                                         num_classes=spec.num_classes, first_position=0,
                                                         config_key=key))
        except (OSError, ValueError) as error:
            problems.append((key, str(error)))
            continue
        if tuple(pool.image_shape) != tuple(split_pool.image_shape):
            problems.append((f"{key}.data", f"images are {tuple(pool.image_shape)} (H, W, C), the fine-tuning "
                             f"pool's (data) are {tuple(split_pool.image_shape)}; the replay memory mixes them, so "
                             f"read both at one size (the reader's image_size option)"))
        names = identities_of(pool, class_ids)
        clashes = sorted(name for name in set(names.tolist()) if name in earlier)
        if clashes:
            where = sorted({earlier[name] for name in clashes})
            shown = f"{clashes[:20]}{' ...' if len(clashes) > 20 else ''}"
            problems.append((f"{key}.data", f"{len(clashes)} of its {names.size} classes are already classes of "
                             f"earlier tasks ({', '.join(where)}): {shown}; "
                             f"a task brings new classes only: remove those identities from {spec.data.root} (or "
                             f"keep them out with {key}.data.classes)"))
        earlier.update({str(name): key for name in names})
    return problems


def scenario_task_classes(config: ScenarioConfig) -> list[np.ndarray]:
    """:func:`task_classes` of every task of a scenario (planning and tests)."""
    return task_classes(config.data, ClassOrder.of(config), DataGuards.of(config))


def class_identities(pool: Any) -> np.ndarray:
    """Sorted unique class identities of a pool, comparable across splits of one dataset: the global fine ids when
    the reader keeps them (glyphs), else the class names of the labels (readers such as CelebA renumber labels per
    split, but their class names are the published identities / synsets / class names)."""
    fine = getattr(pool, "fine_labels", None)
    if fine is not None:
        return np.unique(np.asarray(fine)).astype(str)
    names = np.asarray(pool.class_names, dtype=object)
    return np.unique(names[np.unique(np.asarray(pool.labels))].astype(str))


_OPEN_SET_CHECKED: set[str] = set()


def check_pools_open_set(config: ScenarioConfig) -> None:
    """:func:`check_open_set_pools` of a scenario's pools."""
    check_open_set_pools(OpenSetPools.of(config))


def check_open_set_pools(pools: OpenSetPools) -> None:
    """Data-level open-set guard: no fine class of a training pool (fine-tuning data, every pre-training pool)
    may occur in the query or gallery set. Raises ValueError naming both pools and the override; checked once per
    process. ``pools.closed_set`` (``evaluation.closed_set: true``) is the named override: nothing is checked.

    Class ids are compared only between pools of the same *class space* (a dataset and those registered as drawing
    from it, e.g. ``cifar100r`` and ``cifar100``), since ids of different datasets live in different spaces
    (CIFAR-100 id 3 is not CIFAR-10 id 3; CUB180 and CUB20 renumber their classes). Pools of different spaces are
    disjoint by the protocol that pairs them (CIFAR-100 -> CIFAR-10, CUB180 -> CUB20, CASIA-WebFace -> CelebA, ...),
    which each shipped config states in its ``paper`` section.
    """
    if pools.closed_set:
        return
    key = stable_hash([pools.model_dump(mode="json"), os.getcwd()])
    if key in _OPEN_SET_CHECKED:
        return
    for test_key, test_spec in pools.tests:
        test_space = dataset_info(test_spec.dataset).space
        same_space = [(k, s) for k, s in pools.training if dataset_info(s.dataset).space == test_space]
        if not same_space:
            continue
        test_classes = class_identities(load_pool(test_spec, test_key))
        for train_key, train_spec in same_space:
            train_classes = class_identities(load_pool(train_spec, train_key))
            overlap = np.intersect1d(train_classes, test_classes)
            if overlap.size:
                shown = overlap[:20].tolist()
                raise ValueError(
                    f"open-set violation: {overlap.size} class(es) of class space {test_space!r} appear in both "
                    f"{train_key} ({train_spec.dataset}) and {test_key} ({test_spec.dataset}): {shown}"
                    f"{' ...' if overlap.size > 20 else ''}; training and test classes must be disjoint, or set "
                    f"evaluation.closed_set: true for a closed-set protocol (test classes seen in training)")
    _OPEN_SET_CHECKED.add(key)


def slot_of_positions(positions: np.ndarray, classifier: ClassifierFamily, num_slots: int,
                      pretrained_classes: int) -> np.ndarray:
    """Classifier targets of fine-tuning class positions (see module docstring). Shapes (N,) -> (N,) int64.

    d-Simplex slots go through :class:`compat_core.slots.SlotMapper`, which refuses a position outside the K slots
    or one whose slot a pre-trained class of the line already holds (slots 0..P-1)."""
    positions = np.asarray(positions, dtype=np.int64)
    if classifier == "simplex":
        mapper = SlotMapper(num_slots, pretrain_labels=np.arange(pretrained_classes), finetune_labels=positions)
        return mapper.finetune_slots(positions)
    return pretrained_classes + positions
