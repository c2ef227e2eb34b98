"""Models of a stage: the fresh model a line starts from, strict external weights, the model a replacement or the
first task adopts (a pretrain stage's output or a weights file), and models as committed blobs (written once,
read back verified against the manifest)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from compat_core.kinds import ClassifierFamily
from compat_core.models.compat_model import learnable_from_simplex
from compat_core.models.weights import load_external_weights
from compat_core.models.compat_model import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    create_model,
    frozen_copy,
    model_from_bytes,
    model_to_bytes,
)
from pipelines.records.payloads import WeightsReport
from pipelines.records.stage_records import ModelRecord
from pipelines.stages.context import StageContext
from pipelines.stages.inputs import ModelShape, ModelSource
from pipelines.store.run_store import RunStore

# Adapters a method exports (TrainResult.extra_state) are stored next to the model as extra-<name>.safetensors
# (compat_core.upgrades.adapters.save_adapter); FAN's adapter psi_t is "adapter".
ADAPTER_BLOB = "extra-adapter.safetensors"


def model_blobs(model) -> dict[str, bytes]:
    """The model's save_model files as blobs, serialised in memory once (the store commits them atomically)."""
    return dict(sorted(model_to_bytes(model).items()))


def artifact_location(stage_key: str) -> str:
    """Where a stage's blobs live, relative to the run root (records never hold absolute paths, so a run folder
    can be moved or copied; ``RunStore.uri(location)`` resolves it)."""
    return f"{RunStore.ARTIFACTS}/{stage_key}"


def load_model_artifact(store: RunStore, record: ModelRecord, device: torch.device):
    """Model of a model record, every blob verified against the manifest first."""
    # The bytes that pass the manifest's sha256 are the bytes loaded, read from this run folder (never from the
    # path the record was written under: a moved or copied run loads its own verified weights).
    key = record.stage_key
    manifest = store.load_manifest(key)
    config_bytes = store.read_blob(key, CONFIG_FILE, manifest)
    weights_bytes = store.read_blob(key, WEIGHTS_FILE, manifest)
    return model_from_bytes(config_bytes, weights_bytes, store.uri(store.ARTIFACTS, key), map_location=device)


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))


def initial_model(shape: ModelShape, classifier: ClassifierFamily, seed: int, num_active: int = 0):
    """A fresh model of ``shape`` with ``classifier``, its weights drawn after seeding torch and numpy with
    ``seed``."""
    _seed_everything(seed)
    return create_model(shape.backbone, shape.num_slots, classifier=classifier, backbone_config=shape.backbone_config,
                        num_active_classes=num_active, head=shape.head, simplex_norm=shape.simplex_norm)


def load_weights_strictly(model, source: str, sha256: str | None, ignore: list[str] | None,
                          key: str) -> WeightsReport:
    """Strict external weights (every target key loaded, extras only as listed in ``ignore``); the load report as
    JSON for the stage record. Errors name the config ``key``."""
    try:
        report = load_external_weights(model, source, sha256=sha256, ignore=ignore or ())
    except (ValueError, FileNotFoundError) as error:
        hint = f" (set {key.rsplit('.', 1)[0]}'s ignore keys for known extras)" if "do not fit" in str(error) else ""
        raise type(error)(f"{key}: {error}{hint}") from error
    return WeightsReport.from_json({"key": key, **report.to_json()}, f"{key}: load report")


def load_source(ctx: StageContext, source: ModelSource, classifier: ClassifierFamily, head: str,
                seed: int) -> tuple[Any, int, WeightsReport | None]:
    """Model to start from, P (classes it was pre-trained on) and the weights load report (None for a pretrain
    stage's output): a pretrain stage's output (a parent; a d-Simplex one adopted by a learnable line keeps its
    logits exactly, with the line's ``head``) or a weights file loaded strictly into a fresh model seeded ``seed``."""
    if source.pretrain is not None:
        matches = [r for r in ctx.parents.values() if isinstance(r, ModelRecord) and r.pretrain_name == source.pretrain]
        if not matches:
            raise RuntimeError(f"stage {ctx.stage.label}: source {source.text!r} is not among its parents")
        record = matches[0]
        model = load_model_artifact(ctx.store, record, ctx.device)
        if record.classifier == "simplex" and classifier == "learnable":
            # a third-party model shared with d-Simplex runs (pretrain classifier: simplex): the same logits on
            # its classes, as this method's learnable head
            model = learnable_from_simplex(model, record.pretrained_classes, head)
        elif record.classifier != classifier:
            raise ValueError(f"stage {ctx.stage.label}: {source.text!r} has a {record.classifier} classifier; this "
                             f"line needs a {classifier} one (see pretrain classifier)")
        return model, record.pretrained_classes, None
    pretrained = int(source.num_pretrain_classes or 0)
    model = initial_model(source.model, classifier, seed, num_active=pretrained if classifier == "learnable" else 0)
    report = load_weights_strictly(model, source.file.location, source.file.sha256, source.file.ignore_keys,
                                   source.file.config_key)
    return model.to(ctx.device), pretrained, report


def frozen(model):
    return frozen_copy(model)
