"""Stage functions: (stage, config, store, parent records) -> an artifact record committed to the store.

Every stage function is pure in the sense that matters for resuming: its output depends only on its inputs (config
slice, parent artifacts, seeds), and its result is committed atomically (blobs, then the manifest) by
:func:`execute_stage`. Records hold URIs, never tensors, so the same functions run in-process (LocalExecutor) or
inside Ray actors (cluster package) with a local or S3 store. Training progress goes through ``emit(record)``;
stages never call a tracker.

Class bookkeeping: the fine-tuning classes are numbered by *position* in task order (0 = first class of task 0).
Slots are derived per model line: d-Simplex methods put position ``i`` in slot ``K-1-i`` (right to left, after the
third-party classes in slots 0.. left to right); learnable classifiers put it at output ``P + i`` where ``P`` is the
number of classes the model line was pre-trained on (0 without pre-training).
"""
from __future__ import annotations

import collections
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from pipelines.config import PRETRAIN_PREFIX, PoolSpec, ScenarioConfig
from pipelines.distributed import is_leader
from pipelines.graph import Stage, protocol_params
from pipelines.progress import ProgressUpdate
from pipelines.records import (
    EntryRecord, FeatureRecord, MemoryRecord, ModelRecord, Record, RowRecord, read_record, record_to_json,
)
from pipelines.source_digests import source_digest
from pipelines.store import RunStore, decode_array, encode_array, feature_blobs, read_features

Emit = Callable[[Any], None]
# Adapters a method exports (TrainResult.extra_state) are stored next to the model as extra-<name>.safetensors
# (compat_core.adapters.save_adapter); FAN's adapter psi_t is "adapter".
ADAPTER_BLOB = "extra-adapter.safetensors"


# ---- stage results ------------------------------------------------------------------------------------------------
@dataclass
class StageResult:
    """A stage's typed record and the blobs (name -> bytes) committed with it."""

    record: Record
    blobs: dict[str, bytes] = field(default_factory=dict)


@dataclass
class StageContext:
    stage: Stage
    config: ScenarioConfig
    store: RunStore
    parents: dict[str, Record]
    emit: Emit
    device: torch.device


# ---- data --------------------------------------------------------------------------------------------------------
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
        from compat_core.data.stream import keep_rows

        keep_rows(self.source, self.indices[np.asarray(indices, dtype=np.int64)])

    def encoded_images(self, indices: np.ndarray):
        """The underlying source's encoded images of ``indices`` (replay shards store them), or None."""
        from compat_core.data.replay_shards import encoded_images

        return encoded_images(self.source, self.indices[np.asarray(indices, dtype=np.int64)])


_POOL_CACHE: dict[str, Any] = {}


def load_pool(spec: PoolSpec, key: str = "pool") -> Any:
    """Open a pool (dataset + filters); cached in-process by its spec. Raises naming ``key`` when data is missing."""
    from compat_core.data.registry import load_dataset

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
    pool = source if indices.shape[0] == labels.shape[0] else SubsetSource(source, indices)
    _POOL_CACHE[cache_key] = pool
    return pool


def task_classes(config: ScenarioConfig) -> list[np.ndarray]:
    """Dataset class ids of each task (0-based list index), by the seeded task-sequence builder."""
    from compat_core.data.tasks import build_task_sequence

    pool = load_pool(config.data, "data")
    class_ids = np.unique(np.asarray(pool.labels))
    total = sum(config.increments)
    if class_ids.shape[0] < total:
        raise ValueError(f"tasks.spec: {config.tasks.spec!r} needs {total} classes, data pool has {class_ids.shape[0]}")
    if config.tasks.order == "given":
        # the reference codes take classes in the dataset's id order (alphabetical for CIFAR) or a published list
        class_ids = np.asarray(class_ids if config.data.classes is None else config.data.classes, dtype=np.int64)
    sequence = build_task_sequence(class_ids, config.tasks.spec, config.task_seed, order=config.tasks.order)
    return [np.asarray(t, dtype=np.int64) for t in sequence.tasks]


def fine_labels(pool: Any) -> np.ndarray:
    """Fine class ids of every sample of a pool (``fine_labels`` when the reader keeps them apart, else labels)."""
    fine = getattr(pool, "fine_labels", None)
    return np.asarray(pool.labels if fine is None else fine)


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
    """Data-level open-set guard: no fine class of a training pool (fine-tuning data, every pre-training pool)
    may occur in the query or gallery set. Raises ValueError naming both pools; checked once per process.

    Class ids are compared only between pools of the *same* dataset (same registry name), since ids of different
    datasets live in different spaces (CIFAR-100 id 3 is not CIFAR-10 id 3; CUB180 and CUB20 renumber their
    classes). Pools of different datasets are disjoint by the protocol that pairs them (CIFAR-100 -> CIFAR-10,
    CUB180 -> CUB20, CASIA-WebFace -> CelebA, ...), which each shipped config states in its ``paper`` section.
    """
    from pipelines.config_load import stable_hash

    key = stable_hash([config.data.model_dump(mode="json"), [p.pool.model_dump(mode="json") for p in config.pretrain],
                       config.evaluation.query_set.model_dump(mode="json"),
                       config.evaluation.gallery_set.model_dump(mode="json"), os.getcwd()])
    if key in _OPEN_SET_CHECKED:
        return
    training = [("data", config.data)] + [(f"pretrain[{p.name}].pool", p.pool) for p in config.pretrain]
    tests = [("evaluation.query_set", config.evaluation.query_set),
             ("evaluation.gallery_set", config.evaluation.gallery_set)]
    for test_key, test_spec in tests:
        same_dataset = [(k, s) for k, s in training if s.dataset == test_spec.dataset]
        if not same_dataset:
            continue
        test_classes = class_identities(load_pool(test_spec, test_key))
        for train_key, train_spec in same_dataset:
            train_classes = class_identities(load_pool(train_spec, train_key))
            overlap = np.intersect1d(train_classes, test_classes)
            if overlap.size:
                shown = overlap[:20].tolist()
                raise ValueError(
                    f"open-set violation: {overlap.size} class(es) of dataset {test_spec.dataset!r} appear in both "
                    f"{train_key} and {test_key}: {shown}{' ...' if overlap.size > 20 else ''}; training and test "
                    f"classes must be disjoint")
    _OPEN_SET_CHECKED.add(key)


def slot_of_positions(positions: np.ndarray, classifier: str, num_slots: int, pretrained_classes: int) -> np.ndarray:
    """Classifier targets of fine-tuning class positions (see module docstring). Shapes (N,) -> (N,) int64."""
    positions = np.asarray(positions, dtype=np.int64)
    if classifier == "simplex":
        return num_slots - 1 - positions
    return pretrained_classes + positions


# ---- models --------------------------------------------------------------------------------------------------------
def _model_blobs(model) -> dict[str, bytes]:
    """The model's save_model files as blobs, serialised in memory once (the store commits them atomically)."""
    from compat_core.models.compat_model import model_to_bytes

    return dict(sorted(model_to_bytes(model).items()))


def artifact_location(stage_key: str) -> str:
    """Where a stage's blobs live, relative to the run root (records never hold absolute paths, so a run folder
    can be moved or copied; ``RunStore.uri(location)`` resolves it)."""
    return f"{RunStore.ARTIFACTS}/{stage_key}"


def load_model_artifact(store: RunStore, record: ModelRecord, device: torch.device):
    """Model of a model record, every blob verified against the manifest first."""
    from compat_core.models.compat_model import CONFIG_FILE, WEIGHTS_FILE, model_from_bytes

    # The bytes that pass the manifest's sha256 are the bytes loaded, read from this run folder (never from the
    # path the record was written under: a moved or copied run loads its own verified weights).
    key = record.stage_key
    manifest = store.load_manifest(key)
    config_bytes = store.read_blob(key, CONFIG_FILE, manifest)
    weights_bytes = store.read_blob(key, WEIGHTS_FILE, manifest)
    return model_from_bytes(config_bytes, weights_bytes, store.uri(store.ARTIFACTS, key), map_location=device)


def _method(config: ScenarioConfig):
    from pipelines.methods import get_method

    return get_method(config.method.name, **dict(config.method.params))


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))


def _initial_model(config: ScenarioConfig, classifier: str, seed: int, backbone: str | None = None,
                   backbone_config: dict | None = None, num_active: int = 0):
    from compat_core.models.compat_model import create_model

    from pipelines.config import resolved_head

    _seed_everything(seed)
    # a d-Simplex model always has the junction (a third-party d-Simplex model of a scenario whose learnable
    # method uses the backbone head is converted exactly when adopted, see _load_source)
    head = "junction" if classifier == "simplex" else resolved_head(config, classifier)
    return create_model(backbone or config.model.backbone, config.model.num_slots, classifier=classifier,
                        backbone_config=config.model.backbone_config if backbone_config is None else backbone_config,
                        num_active_classes=num_active, head=head)


initial_model = _initial_model  # the model a stage starts from before any weights load (the preflight builds it too)


def load_weights_strictly(model, source: str, sha256: str | None, ignore: list[str] | None, key: str) -> dict:
    """Strict external weights (every target key loaded, extras only as listed in ``ignore``); the load report as
    JSON for the stage record. Errors name the config ``key``."""
    from compat_core.models import load_external_weights

    try:
        report = load_external_weights(model, source, sha256=sha256, ignore=ignore or ())
    except (ValueError, FileNotFoundError) as error:
        hint = f" (set {key.rsplit('.', 1)[0]}'s ignore keys for known extras)" if "do not fit" in str(error) else ""
        raise type(error)(f"{key}: {error}{hint}") from error
    return {"key": key, **report.to_json()}


def _load_source(ctx: StageContext, source: str, classifier: str, backbone: str | None, backbone_config: dict | None,
                 sha256: str | None, seed: int, num_pretrain_classes: int | None = None, ignore: list[str] | None = None,
                 key: str = "source") -> tuple[Any, int, dict | None]:
    """Model to start from, P (classes it was pre-trained on) and the weights load report (None for a pretrain
    stage's output): a pretrain stage's output or external weights."""
    if source.startswith(PRETRAIN_PREFIX):
        name = source[len(PRETRAIN_PREFIX):]
        matches = [r for r in ctx.parents.values() if isinstance(r, ModelRecord) and r.pretrain_name == name]
        if not matches:
            raise RuntimeError(f"stage {ctx.stage.label}: source {source!r} is not among its parents")
        record = matches[0]
        model = load_model_artifact(ctx.store, record, ctx.device)
        if record.classifier == "simplex" and classifier == "learnable":
            # a third-party model shared with d-Simplex runs (pretrain classifier: simplex): the same logits on
            # its classes, as this method's learnable head
            from compat_core.models import learnable_from_simplex
            from pipelines.config import resolved_head

            model = learnable_from_simplex(model, record.pretrained_classes, resolved_head(ctx.config, classifier))
        elif record.classifier != classifier:
            raise ValueError(f"stage {ctx.stage.label}: {source!r} has a {record.classifier} classifier; method "
                             f"{ctx.config.method.name!r} needs a {classifier} one (see pretrain classifier)")
        return model, record.pretrained_classes, None
    pretrained = int(num_pretrain_classes or 0)
    model = _initial_model(ctx.config, classifier, seed, backbone, backbone_config,
                           num_active=pretrained if classifier == "learnable" else 0)
    report = load_weights_strictly(model, source, sha256 or source_digest(ctx.stage.params), ignore, key)
    return model.to(ctx.device), pretrained, report


# ---- training ------------------------------------------------------------------------------------------------------
def _progress_hook(ctx: StageContext):
    """train_task's per-step progress -> ProgressUpdate records (epoch bar with images/s and ETA)."""
    def hook(epoch: int, step: int, total_steps: int, images_per_s: float) -> None:
        ctx.emit(ProgressUpdate(ctx.stage.key, step, total_steps, "step", images_per_s))
    return hook


def _summary(result: Any) -> dict:
    """JSON summary of a TrainResult: selected epoch (0-based), images/s, seconds, last epoch's mean loss (nats)."""
    records = getattr(result, "records", []) or []
    return {
        "selected_epoch": int(result.selected_epoch),
        "images_per_s": float(result.images_per_s),
        "seconds": float(result.seconds),
        "final_loss": float(records[-1].loss) if records else None,
        "epochs_recorded": len(records),
        "resumed_from_epoch": getattr(result, "resumed_from_epoch", None),  # epoch checkpoint restored, if any
        # where the time went: device idle waiting for input (fraction of the training seconds), start-up, memory
        "input_stall_fraction": float(getattr(result, "input_stall_seconds", 0.0)) / max(float(result.seconds), 1e-9),
        "first_step_seconds": getattr(result, "first_step_seconds", None),
        "peak_device_memory_bytes": getattr(result, "peak_device_memory_bytes", None),
        "loop_unix_seconds": list(getattr(result, "loop_unix_seconds", None) or []),  # to align device samples
    }


def _checkpoints(ctx: StageContext):
    """The stage's epoch checkpoints in the run store (None with ``training.checkpoint_every_epochs: 0``)."""
    from pipelines.checkpoints import StoreCheckpointSink, policy_from_settings

    from pipelines.distributed import launcher_checkpoint_sink

    training = ctx.config.training
    policy = policy_from_settings(training.checkpoint_every_epochs, training.checkpoint_every_minutes)
    if policy is None:
        return None
    # data-parallel ranks keep theirs through their launcher (Ray Train), written once, by rank 0
    return launcher_checkpoint_sink(policy) or StoreCheckpointSink(ctx.store, ctx.stage.key, policy)


def pretrain_stage(ctx: StageContext) -> StageResult:
    """Train a third-party model on its pool: class y takes slot y (0.., left to right) / output y (learnable).

    The model has the entry's classifier family: by default the method under test's (shared d-Simplex with the
    same K, or a learnable classifier), as the reference pre-trains third-party models; ``classifier: simplex``
    trains one d-Simplex model that runs of every method share.
    """
    from pipelines.training import pretrain_model

    config = ctx.config
    spec = config.pretrain_spec(ctx.stage.name)
    classifier = ctx.stage.params["classifier"]  # the entry's family, resolved by the graph
    pool = load_pool(spec.pool, f"pretrain[{spec.name}].pool")
    labels = np.asarray(pool.labels)
    occupied = int(labels.max()) + 1 if labels.size else 0
    if occupied != spec.num_classes or np.unique(labels).size != spec.num_classes:
        raise ValueError(f"pretrain[{spec.name}].num_classes: config says {spec.num_classes}; the pool has "
                         f"{np.unique(labels).size} classes with labels up to {occupied - 1} (pre-training labels "
                         f"are the slots, so they must be exactly 0..num_classes-1)")
    seed = spec.seed if spec.seed is not None else config.seed
    model = _initial_model(config, classifier, seed, spec.backbone, spec.backbone_config,
                           num_active=spec.num_classes if classifier == "learnable" else 0)
    weights = None
    if spec.init is not None:
        # fine-tune published weights (e.g. DINOv3) on the pool; the junction and classifier start fresh
        weights = load_weights_strictly(model, spec.init, spec.init_sha256 or source_digest(ctx.stage.params),
                                        spec.init_ignore_keys, f"pretrain[{spec.name}].init")
        if spec.init_sha256 is None:
            logging.getLogger(__name__).warning(
                "pretrain[%s].init: no init_sha256 set; %s has sha256 %s: pin it with init_sha256: %s so that a "
                "changed file is refused", spec.name, spec.init, weights.get("sha256"), weights.get("sha256"))
    model = model.to(ctx.device)
    model.config["pretrained_classes"] = spec.num_classes
    result = pretrain_model(model, pool, np.arange(len(pool)), config.train_config(seed, ctx.device, spec),
                            on_record=ctx.emit, progress=_progress_hook(ctx), checkpoints=_checkpoints(ctx))
    record = ModelRecord(ctx.stage.key, artifact_location(ctx.stage.key), task=None, line=0,
                         pretrained_classes=spec.num_classes, positions_seen=0, classifier=classifier,
                         num_active_classes=spec.num_classes if classifier == "learnable" else 0,
                         training=_summary(result), pretrain_name=spec.name, weights=weights)
    return StageResult(record, _model_blobs(result.model))


def _state_copy(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


_EMPTY = np.zeros(0, dtype=np.int64)


def _memory_from_record(store: RunStore, model_record: ModelRecord | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pool indices, class positions, source task) of the replay memory stored with a model record."""
    memory = model_record.memory if model_record is not None else None
    if memory is None:
        return _EMPTY, _EMPTY, _EMPTY
    key = model_record.stage_key
    manifest = store.load_manifest(key)
    return (store.read_array(key, memory.indices_blob, manifest),
            store.read_array(key, memory.positions_blob, manifest),
            store.read_array(key, memory.tasks_blob, manifest))


def _memory_images_from_record(store: RunStore, model_record: ModelRecord | None, memory: tuple) -> np.ndarray | None:
    """uint8 (M, H, W, C) images of the recorded replay shard, rows aligned with ``memory``; None when the record
    has no shard (runs written before replay shards)."""
    shard = model_record.memory.shard if model_record is not None and model_record.memory is not None else None
    if not shard:
        return None
    from compat_core.data.replay_shards import CorruptShardError
    from pipelines.replay_shards import read_memory_shard
    from pipelines.store import CorruptArtifactError

    try:
        stored, images = read_memory_shard(store, shard)
    except CorruptShardError as error:
        # the stage that wrote the shard is the one to recompute (the CLI prints the --recompute fix)
        raise CorruptArtifactError(str(error), stage_key=getattr(error, "stage_key", None)
                                   or model_record.stage_key) from error
    if not np.array_equal(stored.indices, memory[0]) or not np.array_equal(stored.source_task, memory[2]):
        raise ValueError(f"replay shard {shard['folder']} (task {shard['task']}) does not hold the memory recorded "
                         f"with model stage {model_record.stage_key}")
    return images


def _write_memory_shard(ctx: StageContext, task: int, memory: tuple, memory_images: np.ndarray | None, pool,
                        indices: np.ndarray, positions: np.ndarray, tasks: np.ndarray,
                        previous_shard: dict | None = None) -> dict:
    """Write this stage's replay shard: the exemplars this task adds, appended to the previous shard's parts, when
    the updated memory is the previous one plus new rows (the fixed quota per class); else the whole memory, kept
    exemplars' images from the previous shard, new ones from this task's source."""
    from compat_core.data.replay import ReplayMemory
    from pipelines.replay_shards import write_memory_shard

    from compat_core.data.encoded import EncodedImages
    from compat_core.data.replay_shards import concatenate_images, encoded_images

    kept = memory[0].size
    if (kept == 0 or (memory_images is not None and previous_shard is not None)) and \
            np.array_equal(indices[:kept], memory[0]) and np.array_equal(tasks[:kept], memory[2]) and \
            bool((tasks[kept:] == task).all()):
        added = slice(kept, None)
        new = encoded_images(pool, indices[added])
        record = ReplayMemory(indices=indices[added], labels=positions[added], slots=positions[added],
                              source_task=tasks[added])
        return write_memory_shard(ctx.store, ctx.stage.key, task, record,
                                  pool.read(indices[added]) if new is None else new,
                                  previous=previous_shard if kept else None)
    # kept exemplars come from the previous shard (its encoded bytes or pixels), new ones from this task's source
    from_previous = tasks != task
    parts = []
    if from_previous.any():
        if memory_images is None:
            parts.append(pool.read(indices[from_previous]))  # a run started before replay shards
        else:
            row_of = {int(index): row for row, index in enumerate(memory[0])}
            rows = np.asarray([row_of[int(i)] for i in indices[from_previous]], dtype=np.int64)
            parts.append(memory_images.take(rows) if isinstance(memory_images, EncodedImages)
                         else memory_images[rows])
    if (~from_previous).any():
        new = encoded_images(pool, indices[~from_previous])
        parts.append(pool.read(indices[~from_previous]) if new is None else new)
    if parts:
        joined = concatenate_images(parts)       # kept rows, then new rows: put them back in memory order
        order = np.argsort(np.concatenate([np.flatnonzero(from_previous), np.flatnonzero(~from_previous)]))
        images = joined.take(order) if isinstance(joined, EncodedImages) else joined[order]
    else:
        images = np.zeros((0, *pool.image_shape), dtype=np.uint8)
    record = ReplayMemory(indices=indices, labels=positions, slots=positions, source_task=tasks)
    return write_memory_shard(ctx.store, ctx.stage.key, task, record, images)


def _update_memory(config: ScenarioConfig, memory: tuple, new_indices, new_positions, task: int,
                   features: np.ndarray | None = None) -> tuple:
    """Add ``per_class`` samples of each new class; old classes keep theirs (fixed quota per seen class).

    features: (n, K-1) features of the new samples for ``replay.strategy: herding`` (None for random)."""
    from compat_core.data import replay

    indices, positions, tasks = memory
    current = replay.ReplayMemory(indices=indices, labels=positions, slots=positions, source_task=tasks)
    updated = replay.update_memory(current, new_indices, new_positions, new_positions, task,
                                   config.replay.per_class, strategy=config.replay.strategy,
                                   seed=config.seed * 1000 + task, features=features)
    return (np.asarray(updated.indices, dtype=np.int64), np.asarray(updated.labels, dtype=np.int64),
            np.asarray(updated.source_task, dtype=np.int64))


def _selection_split(config: ScenarioConfig, pool, indices: np.ndarray, seed: int):
    """CoReS Sec. 8.2 held-out split: ``selection_holdout`` of the task's samples per class, halved into query and
    gallery; returns (training indices without them, SelectionSplit)."""
    from pipelines.task_data import SelectionSplit

    rng = np.random.default_rng(seed)
    labels = np.asarray(pool.labels)[indices]
    held_query, held_gallery = [], []
    for c in np.unique(labels):
        members = indices[labels == c][rng.permutation(int((labels == c).sum()))]
        count = max(2, int(round(config.training.selection_holdout * members.size)))
        if count >= members.size:
            continue
        held = members[:count]
        held_query.append(held[: count // 2])
        held_gallery.append(held[count // 2:])
    if not held_query:
        raise ValueError("training.selection_holdout: no class has enough samples for a held-out split")
    query, gallery = np.concatenate(held_query), np.concatenate(held_gallery)
    remaining = np.setdiff1d(indices, np.concatenate([query, gallery]))
    return remaining, SelectionSplit(pool, query, gallery)


def train_task_stage(ctx: StageContext) -> StageResult:
    """finetune(t) / replace(t): one task of the scenario, then the replay memory update."""
    from pipelines.task_data import TaskData
    from pipelines.training import train_task

    config = ctx.config
    stage = ctx.stage
    task = int(stage.task)
    method = _method(config)
    classifier = method.classifier
    K = config.model.num_slots
    pool = load_pool(config.data, "data")
    tasks = task_classes(config)
    position_of = {int(c): i for i, c in enumerate(np.concatenate(tasks))}
    pool_labels = np.asarray(pool.labels)
    first_position = sum(len(t) for t in tasks[:task])
    seed = config.seed * 1000 + task
    previous = ctx.parents[stage.parents[0]] if task > 0 else None
    memory = _memory_from_record(ctx.store, previous)
    # the previous task's exemplars come from its replay shard (verified now, before any training), never from
    # the old tasks' source data
    memory_images = _memory_images_from_record(ctx.store, previous, memory)
    replacement = config.replacement_at(task) if stage.kind == "replace" else None
    wants_old = method.needs_old_model or config.training.model_selection == "compatibility"

    initial_state = None
    old_model = None
    weights = None
    if method.retrain_from_scratch:
        # CoReS: the same initial weights (seeded once) at every step; PSP/LSP: independently trained models, each
        # step with its own initial weights (the paper; CoReS Sec. 8.3 shows a shared start raises AC). All data so far.
        init_seed = seed if getattr(method, "independent_init", False) else config.seed
        model = _initial_model(config, classifier, init_seed).to(ctx.device)
        initial_state = _state_copy(model)
        pretrained, line = 0, 0
        if previous is not None and wants_old:
            old_model = _frozen(load_model_artifact(ctx.store, previous, ctx.device))
        indices = np.flatnonzero(np.isin(pool_labels, np.concatenate(tasks[: task + 1])))
    else:
        if replacement is not None:
            index = config.replacements.index(replacement)
            model, pretrained, weights = _load_source(ctx, replacement.source, classifier, replacement.backbone,
                                                      replacement.backbone_config, replacement.sha256, config.seed,
                                                      replacement.num_pretrain_classes, replacement.ignore_keys,
                                                      f"replacements[{index}].source")
            line = previous.line + 1
            if replacement.anchor == "replaced":
                # trained to be compatible with the model it replaces (its features are what the index holds)
                old_model = _frozen(load_model_artifact(ctx.store, previous, ctx.device))
            else:
                old_model = _frozen(model)  # the reference HOC anchors to the newly loaded model
        elif task == 0 and config.initial_model:
            model, pretrained, weights = _load_source(ctx, config.initial_model, classifier, None, None, None,
                                                      config.seed, ignore=config.initial_model_ignore_keys,
                                                      key="initial_model")
            line = 0
            if wants_old:
                # a line that starts from loaded weights anchors to them, at the first task as at a replacement
                old_model = _frozen(model)
        elif task == 0:
            model, pretrained, line = _initial_model(config, classifier, config.seed).to(ctx.device), 0, 0
        else:
            model = load_model_artifact(ctx.store, previous, ctx.device)
            pretrained, line = previous.pretrained_classes, previous.line
            if wants_old:
                old_model = _frozen(model)
        if classifier == "simplex" and model.num_slots != K:
            raise ValueError(f"model.num_slots: the starting model of task {task + 1} (1-based) has "
                             f"K={model.num_slots}, the scenario uses K={K}; a d-Simplex line needs one K throughout")
        indices = np.flatnonzero(np.isin(pool_labels, tasks[task]))

    selection = None
    if config.training.model_selection == "compatibility":
        indices, selection = _selection_split(config, pool, indices, seed)
    positions = np.asarray([position_of[int(c)] for c in pool_labels[indices]], dtype=np.int64)
    use_memory = method.uses_replay and config.replay.per_class > 0 and not method.retrain_from_scratch
    memory_indices = memory_slots = None
    train_source = pool
    if use_memory and memory[0].size:
        memory_indices = memory[0]
        memory_slots = slot_of_positions(memory[1], classifier, K, pretrained)
        if memory_images is not None:
            from pipelines.replay_shards import WithMemory

            train_source = WithMemory(pool, memory_images, np.concatenate(tasks)[memory[1]])
            memory_indices = train_source.memory_indices()
    num_old = first_position if not method.retrain_from_scratch else 0
    data = TaskData(
        source=train_source, task=task, indices=indices, slots=slot_of_positions(positions, classifier, K, pretrained),
        num_old_classes=num_old + (pretrained if classifier == "learnable" else 0),
        num_new_classes=len(tasks[task]) + (first_position if method.retrain_from_scratch else 0),
        memory_indices=memory_indices, memory_slots=memory_slots, initial_state=initial_state, selection=selection,
    )
    result = train_task(model, old_model, method, data, config.train_config(seed, ctx.device), on_record=ctx.emit,
                        progress=_progress_hook(ctx), checkpoints=_checkpoints(ctx))
    if not is_leader():  # data-parallel training: rank 0 builds and commits the artifacts, the other ranks nothing
        return StageResult(None)
    trained = result.model
    blobs = _model_blobs(trained)
    extra = []
    if result.extra_state:
        from compat_core.adapters import save_adapter

        for module_name, adapter in result.extra_state.items():  # FAN's psi_t: stored like every adapter
            name = f"extra-{module_name}.safetensors"
            blobs[name] = save_adapter(adapter)
            extra.append(name)

    memory_record = None
    if use_memory:
        task_indices = np.flatnonzero(np.isin(pool_labels, tasks[task]))
        task_positions = np.asarray([position_of[int(c)] for c in pool_labels[task_indices]], dtype=np.int64)
        herding_features = None
        if config.replay.strategy == "herding":
            # iCaRL herding ranks the task's samples by the features of the model just trained (eval transforms)
            from pipelines.training import compute_features

            herding_features = compute_features(trained, pool, task_indices,
                                                config.train_config(seed, ctx.device)).numpy()
        new_indices, new_positions, new_tasks = _update_memory(config, memory, task_indices, task_positions, task,
                                                               herding_features)
        blobs["memory-indices.npy"] = encode_array(new_indices)
        blobs["memory-positions.npy"] = encode_array(new_positions)
        blobs["memory-tasks.npy"] = encode_array(new_tasks)
        memory_record = MemoryRecord("memory-indices.npy", "memory-positions.npy", "memory-tasks.npy",
                                     int(new_indices.shape[0]), config.replay.per_class,
                                     shard=_write_memory_shard(ctx, task, memory, memory_images, pool, new_indices,
                                                               new_positions, new_tasks,
                                                               previous.memory.shard if previous is not None
                                                               and previous.memory is not None else None))
    num_active = int(trained.num_active_classes) if classifier == "learnable" else 0
    source = replacement.source if replacement is not None else (config.initial_model if task == 0 else None)
    record = ModelRecord(stage.key, artifact_location(stage.key), task=task, line=line, pretrained_classes=pretrained,
                         positions_seen=first_position + len(tasks[task]), classifier=classifier,
                         num_active_classes=num_active, source=source, memory=memory_record, extra_blobs=extra,
                         training=_summary(result), weights=weights)
    return StageResult(record, blobs)


def _frozen(model):
    from compat_core.models.compat_model import frozen_copy

    return frozen_copy(model)


# ---- extraction --------------------------------------------------------------------------------------------------
@torch.no_grad()
def extract_stage(ctx: StageContext) -> StageResult:
    """Features of the parent model on the query or gallery set, once, stored as fp16 (default) shards."""
    config = ctx.config
    split = ctx.stage.split
    check_pools_open_set(config)
    spec = config.evaluation.query_set if split == "query" else config.evaluation.gallery_set
    pool = load_pool(spec, f"evaluation.{split}_set")
    model_record = ctx.parents[ctx.stage.parents[0]]
    model = load_model_artifact(ctx.store, model_record, ctx.device)
    total = len(pool)
    started = time.perf_counter()

    def progress(done: int, batches: int, images_per_second: float) -> None:
        ctx.emit(ProgressUpdate(ctx.stage.key, done, batches, "batch", images_per_second))

    from pipelines.bridge_features import bridge_blobs, model_feature_way

    way, reason = model_feature_way(config, model)  # bridge: store m-dim embeddings, entries use the exact bridge
    features = extract_pool_features(model, pool, config, ctx.device, progress, embeddings=way == "bridge")
    seconds = time.perf_counter() - started
    coarse = getattr(pool, "coarse_labels", None)
    if way == "bridge":
        blobs, layout = bridge_blobs(features, model_record.stage_key, model.feature_dim, np.asarray(pool.labels),
                                     coarse, config.evaluation.feature_dtype)
    else:
        blobs, layout = feature_blobs(features, np.asarray(pool.labels), coarse,
                                      dtype=config.evaluation.feature_dtype)
        layout["way"] = "direct"
    layout["way_reason"] = reason
    adapter = ADAPTER_BLOB if ADAPTER_BLOB in model_record.extra_blobs else None
    record = FeatureRecord(ctx.stage.key, int(ctx.stage.task), split, artifact_location(ctx.stage.key), layout,
                           num_classes_model=model_record.num_active_classes, seconds=seconds,
                           images_per_second=total / max(seconds, 1e-9), model_stage_key=model_record.stage_key,
                           adapter_blob=adapter)
    return StageResult(record, blobs)


@torch.no_grad()
def extract_pool_features(model, pool, config: ScenarioConfig, device: torch.device,
                          progress: Callable[[int, int, float], None] | None = None,
                          embeddings: bool = False) -> np.ndarray:
    """(N, D) float32 features of ``model`` on every image of ``pool`` (logits for training-free methods; the
    (N, m) backbone embeddings with ``embeddings``, for the linear-head bridge).

    The one extraction path: extract stages and ``compat gate`` use it. The next batches are decoded on CPU
    workers (``training.input_workers``) while the model runs. progress(batch, batches, images per s).
    """
    from compat_core.data.stream import stream_batches
    from compat_core.data.transforms import make_transforms
    from compat_core.models.precision import prepare_batch
    from pipelines.autocast import example_batch, precision_context, prepare_model, resolve_autocast

    batch_size = config.evaluation.batch_size
    mode = config.training.autocast
    if len(pool):
        # "auto": inference in half precision only where a measured forward pass of this model is faster
        mode = resolve_autocast(mode, device, model, example_batch(pool, np.arange(min(len(pool), batch_size)),
                                                                   batch_size, device), train=False)
    model = prepare_model(model, device, mode)
    model.eval()
    method = _method(config)
    transform = make_transforms(pool, train=False)
    outputs = []
    started = time.perf_counter()
    total = len(pool)
    batches = max(1, -(-total // batch_size))
    stream = stream_batches(pool, np.arange(total), [np.arange(start, min(start + batch_size, total))
                                                     for start in range(0, total, batch_size)],
                            workers=config.training.input_workers, pin_memory=device.type == "cuda")
    with torch.no_grad():
        for batch_index, (positions, images) in enumerate(stream):
            images = images.to(device, non_blocking=True)
            inputs = prepare_batch(transform(images), model)
            with precision_context(device, mode):
                output = model(inputs)
            # training-free methods (PSP/LSP) map logits into the gallery model's class space at evaluation time
            values = (output.embedding if embeddings
                      else output.logits if getattr(method, "training_free", False) else output.features)
            outputs.append(values.float().cpu().numpy())
            if progress is not None:
                done = int(positions[-1]) + 1
                progress(batch_index + 1, batches, done / max(time.perf_counter() - started, 1e-9))
    width = model.embed_dim if embeddings else model.feature_dim
    return np.concatenate(outputs, axis=0) if outputs else np.zeros((0, width), np.float32)


# ---- evaluation --------------------------------------------------------------------------------------------------
def verification_pairs(query_labels: np.ndarray, gallery_labels: np.ndarray, count: int,
                       seed: int, same_pool: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded cross-set 1:1 pairs: side a a query sample (model t), side b a gallery sample (model k).

    ``count`` positive (same label) and ``count`` negative pairs, each drawn uniformly among the pairs of its kind
    (with replacement when fewer exist). ``same_pool``: query and gallery are the same images (CoReS draws its 3,000
    + 3,000 pairs from the CIFAR-10 test set), so a positive pair never pairs an image with itself.
    Returns (query index (2n,), gallery index (2n,), same (2n,) bool), shuffled.
    """
    rng = np.random.default_rng(seed)
    query_labels = np.asarray(query_labels)
    gallery_labels = np.asarray(gallery_labels)
    if same_pool and not np.array_equal(query_labels, gallery_labels):
        raise ValueError("verification_pairs: same_pool needs identical query and gallery label arrays")
    classes = np.intersect1d(query_labels, gallery_labels)
    if classes.size == 0:
        raise ValueError("evaluation.metric: verification needs labels shared by the query and gallery sets")
    q_members = [np.flatnonzero(query_labels == c) for c in classes]
    g_members = [np.flatnonzero(gallery_labels == c) for c in classes]
    weights = np.asarray([a.size * (b.size - 1 if same_pool else b.size) for a, b in zip(q_members, g_members)],
                         dtype=np.float64)
    if weights.sum() == 0:
        raise ValueError("evaluation.metric: verification needs a class with two images to form a positive pair")
    chosen = rng.choice(classes.size, size=count, p=weights / weights.sum())
    pos_a = np.asarray([q_members[c][rng.integers(q_members[c].size)] for c in chosen], dtype=np.int64)
    if same_pool:  # the partner is another image of the class: skip a's own position among the members
        picks = []
        for c, a in zip(chosen, pos_a):
            others = g_members[c][g_members[c] != a]
            picks.append(others[rng.integers(others.size)])
        pos_b = np.asarray(picks, dtype=np.int64)
    else:
        pos_b = np.asarray([g_members[c][rng.integers(g_members[c].size)] for c in chosen], dtype=np.int64)
    neg_a, neg_b = [], []
    while len(neg_a) < count:
        a = rng.integers(query_labels.size, size=2 * count)
        b = rng.integers(gallery_labels.size, size=2 * count)
        keep = query_labels[a] != gallery_labels[b]
        neg_a.extend(a[keep].tolist())
        neg_b.extend(b[keep].tolist())
    index_a = np.concatenate([pos_a, np.asarray(neg_a[:count], dtype=np.int64)])
    index_b = np.concatenate([pos_b, np.asarray(neg_b[:count], dtype=np.int64)])
    same = np.concatenate([np.ones(count, dtype=bool), np.zeros(count, dtype=bool)])
    order = rng.permutation(index_a.size)
    return index_a[order], index_b[order], same[order]


def compute_entry(query: tuple, gallery: tuple, protocol: dict, config: ScenarioConfig,
                  query_classes: int = 0, gallery_classes: int = 0, adapters: list | None = None) -> float:
    """One matrix entry M(Q, G) from stored features; ``query``/``gallery`` = (features, labels, coarse labels).

    protocol: metric (recall_at_1 | map | verification | tar_at_far), gallery (instances | class_means),
    label_level (fine | coarse), far, verification_pairs. query_classes / gallery_classes: classifier outputs of
    the two models (PSP/LSP project the query into the gallery model's space). adapters: gallery adapters
    (compat_core.adapters, FAN's psi) that map the gallery model's features into the query model's space, oldest
    first (see :func:`entry_adapters`), applied by :func:`compat_core.adapters.apply_chain`.
    Returns a fraction in [0, 1].
    """
    from compat_core import retrieval, verification

    q_features, q_labels, q_coarse = query
    g_features, g_labels, g_coarse = gallery
    if protocol["label_level"] == "coarse":
        if q_coarse is None or g_coarse is None:
            raise ValueError("evaluation.label_level: 'coarse' needs a dataset with coarse labels (this one has none)")
        q_labels, g_labels = q_coarse, g_coarse
    q = torch.from_numpy(np.asarray(q_features, dtype=np.float32))
    g = torch.from_numpy(np.asarray(g_features, dtype=np.float32))
    method = _method(config)
    if getattr(method, "training_free", False):
        # features are logits; PSP/LSP project both into the class space of the older (gallery) model
        q = method.extract_features(q, num_classes_old=gallery_classes or None)
        g = method.extract_features(g, num_classes_old=gallery_classes or None)
    if adapters:
        from compat_core.adapters import apply_chain

        g = apply_chain(g, adapters)
    q = torch.nn.functional.normalize(q.float(), dim=1)
    g = torch.nn.functional.normalize(g.float(), dim=1)
    q_labels = np.asarray(q_labels, dtype=np.int64)
    g_labels = np.asarray(g_labels, dtype=np.int64)
    metric = protocol["metric"]
    if metric in ("recall_at_1", "map") and protocol["gallery"] == "class_means":
        g, g_labels = retrieval.class_mean_gallery(g, g_labels)
    if metric == "recall_at_1":
        value = retrieval.recall_at_1(q, q_labels, g, g_labels)
    elif metric == "map":
        value = retrieval.mean_average_precision(q, q_labels, g, g_labels)
    else:
        same_pool = config.evaluation.query_set == config.evaluation.gallery_set
        index_a, index_b, same = verification_pairs(q_labels, g_labels, int(protocol["verification_pairs"]),
                                                    config.seed, same_pool=same_pool)
        if metric == "verification":
            value = verification.verification_accuracy(q[index_a], g[index_b], same)[0]
        else:
            scores = (q[index_a].double() * g[index_b].double()).sum(dim=1).numpy()
            value = verification.tar_at_far(scores, same, far=protocol["far"])
    return float(value)


def entry_adapters(store: RunStore, gallery_records: list[FeatureRecord], row: int, column: int) -> list:
    """FAN adapters for entry C[row, column]: those stored with the models of tasks column+1..row, oldest first.

    gallery_records: the gallery extract records of columns 0..row (their ``model_stage_key`` / ``adapter_blob``).
    Empty for methods without adapters. At a replacement FAN's adapter maps the newly loaded model's features (its
    old model there), so a chain crossing a replacement is an approximation the papers do not define.
    """
    from compat_core.adapters import load_adapter_bytes

    if not any(record.adapter_blob for record in gallery_records[column + 1: row + 1]):
        return []
    adapters = []
    for task in range(column + 1, row + 1):
        record = gallery_records[task]
        if not record.adapter_blob:
            raise ValueError(f"entry C[{row}, {column}]: the model of task {task} has no FAN adapter "
                             f"({ADAPTER_BLOB}) although other models of the run have one")
        adapters.append(load_adapter_bytes(store.read_blob(record.model_stage_key, record.adapter_blob)))
    return adapters


_FEATURE_CACHE: "collections.OrderedDict[tuple[str, str], tuple]" = collections.OrderedDict()
_FEATURE_CACHE_ITEMS = 4  # a row's query and a few galleries: entries of one row reuse them


def cached_features(store: RunStore, key: str) -> tuple:
    """read_features with a small per-process LRU cache. Safe because extract keys are content hashes (a key's
    features never change); an in-process run and a reused Ray worker process both read a row's query once."""
    cache_key = (store.root, key)
    if cache_key in _FEATURE_CACHE:
        _FEATURE_CACHE.move_to_end(cache_key)
        return _FEATURE_CACHE[cache_key]
    features = read_features(store, key)
    _FEATURE_CACHE[cache_key] = features
    while len(_FEATURE_CACHE) > _FEATURE_CACHE_ITEMS:
        _FEATURE_CACHE.popitem(last=False)
    return features


def entry_stage(ctx: StageContext) -> StageResult:
    """The one function computing a matrix-entry record C[row, column]; parents = (query extract, gallery extracts
    of columns 0..row), so the FAN adapters of tasks column+1..row are applied to the gallery features."""
    stage = ctx.stage
    row, column, protocol = int(stage.params["row"]), int(stage.params["column"]), stage.params["protocol"]
    query_key, gallery_keys = stage.parents[0], stage.parents[1:]
    gallery_key = gallery_keys[column]
    adapters = entry_adapters(ctx.store, [ctx.parents[k] for k in gallery_keys], row, column)
    from pipelines.bridge_features import entry_value  # direct features or the exact linear-head bridge

    value, features = entry_value(ctx.store, ctx.config, ctx.parents[query_key], ctx.parents[gallery_key], protocol,
                                  adapters)
    return StageResult(EntryRecord(stage.key, row, column, value, query_key, gallery_key, protocol, features))


def evaluate_stage(ctx: StageContext) -> StageResult:
    """Row t of the matrix, C[t, 0..t], from its committed entry nodes (its parents, in column order)."""
    stage = ctx.stage
    protocol = stage.params["protocol"]
    values = [float(ctx.parents[key].value) for key in stage.parents]
    return StageResult(RowRecord(stage.key, int(stage.task), values, list(stage.parents), protocol["metric"], protocol))


STAGE_FUNCTIONS: dict[str, Callable[[StageContext], StageResult]] = {
    "pretrain": pretrain_stage,
    "finetune": train_task_stage,
    "replace": train_task_stage,
    "extract": extract_stage,
    "entry": entry_stage,
    "evaluate": evaluate_stage,
}


def _adapt_stage(ctx: StageContext) -> StageResult:
    from pipelines.upgrades import adapt_stage  # adapters at a replacement

    return adapt_stage(ctx)


STAGE_FUNCTIONS["adapt"] = _adapt_stage


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def execute_stage(stage: Stage, config: ScenarioConfig, store: RunStore, emit: Emit,
                  code_version: str | None = None, placement: dict | None = None) -> Record:
    """Run one stage whose parents are committed, commit its artifacts (blobs, then manifest) and return the record.

    This is the unit a Ray actor runs: everything it needs comes from the store by key. placement: where it ran
    (the Ray backend gives node id, host, pid), kept in the record as ``placement``.
    """
    parents = {}
    for key in stage.parents:
        if not store.has(key):
            raise RuntimeError(f"stage {stage.label}: parent {key} is not committed; run the graph in order")
        parents[key] = read_record(store, key)
    ctx = StageContext(stage, config, store, parents, emit, resolve_device(config.device))
    from pipelines.graph import stage_threads

    threads_before = torch.get_num_threads()
    torch.set_num_threads(stage_threads(stage.resources))  # the count in the stage key, on every backend
    try:
        result = STAGE_FUNCTIONS[stage.kind](ctx)
    finally:
        torch.set_num_threads(threads_before)
    if not is_leader():
        return None  # a data-parallel rank other than 0 (pipelines.distributed): rank 0 commits the stage
    node = {"kind": stage.kind, "label": stage.label}
    if placement is not None:
        node["placement"] = dict(placement)
    store.commit(stage.key, record_to_json(result.record, **node), result.blobs, code_version=code_version)
    if stage.kind in ("pretrain", "finetune", "replace"):
        from pipelines.checkpoints import collect_garbage

        collect_garbage(store, stage.key)  # the committed model supersedes its epoch checkpoints
    return result.record


__all__ = [
    "StageResult", "StageContext",
    "STAGE_FUNCTIONS", "execute_stage", "entry_stage", "cached_features", "load_pool", "task_classes", "slot_of_positions", "compute_entry",
    "entry_adapters", "verification_pairs", "check_pools_open_set", "fine_labels", "ADAPTER_BLOB",
    "load_model_artifact", "SubsetSource", "extract_pool_features", "decode_array", "protocol_params",
]
