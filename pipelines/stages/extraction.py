"""The ``extract`` stage: features (or, for the linear-head bridge, backbone embeddings) of a model on the query or
gallery set, once per model and split, and the one extraction path (:func:`extract_pool_features`) other commands
use too."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from compat_core.data.stream import stream_batches
from compat_core.data.transforms import make_transforms
from compat_core.models.precision import prepare_batch
from pipelines.config.schema import ScenarioConfig
from pipelines.engine.events import ProgressUpdate
from pipelines.methods import configured_method
from pipelines.records.stage_records import FeatureRecord
from pipelines.stages.bridge_features import bridge_blobs, model_feature_way
from pipelines.stages.context import StageContext, StageResult
from pipelines.stages.inputs import Extraction, ExtractInputs
from pipelines.stages.model_io import ADAPTER_BLOB, artifact_location, load_model_artifact
from pipelines.stages.pools import check_open_set_pools, load_pool
from pipelines.store.run_store import feature_blobs
from pipelines.training.autocast import example_batch, precision_context, prepare_model, resolve_autocast


@torch.no_grad()
def extract_stage(ctx: StageContext) -> StageResult:
    """Features of the parent model on the query or gallery set, once, stored as fp16 (default) shards."""
    inputs: ExtractInputs = ctx.inputs
    if ctx.settings.guards is not None:
        check_open_set_pools(ctx.settings.guards.open_set)  # the data-level guard, where the test pools are read
    pool = load_pool(inputs.pool, f"evaluation.{inputs.split}_set")
    model_record = ctx.parents[ctx.stage.parents[0]]
    model = load_model_artifact(ctx.store, model_record, ctx.device)
    total = len(pool)
    started = time.perf_counter()

    def progress(done: int, batches: int, images_per_second: float) -> None:
        ctx.emit(ProgressUpdate(ctx.stage.key, done, batches, "batch", images_per_second))

    # bridge: store m-dim embeddings, entries use the exact bridge
    way, reason = model_feature_way(inputs.features, inputs.extraction.method.name, model)
    features = pool_features(model, pool, inputs.extraction, ctx.device, ctx.settings.input_workers, progress,
                             embeddings=way == "bridge")
    seconds = time.perf_counter() - started
    coarse = getattr(pool, "coarse_labels", None)
    if way == "bridge":
        blobs, layout = bridge_blobs(features, model_record.stage_key, model.feature_dim, np.asarray(pool.labels),
                                     coarse, inputs.feature_dtype)
    else:
        blobs, layout = feature_blobs(features, np.asarray(pool.labels), coarse, dtype=inputs.feature_dtype)
        layout.way = "direct"
    layout.way_reason = reason
    adapter = ADAPTER_BLOB if ADAPTER_BLOB in model_record.extra_blobs else None
    record = FeatureRecord(ctx.stage.key, inputs.task, inputs.split, artifact_location(ctx.stage.key), layout,
                           num_classes_model=model_record.num_active_classes, seconds=seconds,
                           images_per_second=total / max(seconds, 1e-9), model_stage_key=model_record.stage_key,
                           adapter_blob=adapter)
    return StageResult(record, blobs)


def extract_pool_features(model, pool, config: ScenarioConfig, device: torch.device,
                          progress: Callable[[int, int, float], None] | None = None,
                          embeddings: bool = False) -> np.ndarray:
    """:func:`pool_features` with the extraction settings of a scenario config (commands that hold one: ``compat
    gate``, the serving index and backfill)."""
    return pool_features(model, pool, Extraction.of(config), device, config.training.input_workers, progress,
                         embeddings)


@torch.no_grad()
def pool_features(model, pool, extraction: Extraction, device: torch.device, input_workers: int = 0,
                  progress: Callable[[int, int, float], None] | None = None, embeddings: bool = False) -> np.ndarray:
    """(N, D) float32 features of ``model`` on every image of ``pool`` (logits for training-free methods; the
    (N, m) backbone embeddings with ``embeddings``, for the linear-head bridge).

    The one extraction path: extract stages and ``compat gate`` use it. The next batches are decoded on
    ``input_workers`` CPU processes while the model runs. progress(batch, batches, images per s).
    """
    batch_size = extraction.batch_size
    mode = extraction.autocast
    if len(pool):
        # "auto": inference in half precision only where a measured forward pass of this model is faster
        mode = resolve_autocast(mode, device, model, example_batch(pool, np.arange(min(len(pool), batch_size)),
                                                                   batch_size, device), train=False)
    model = prepare_model(model, device, mode)
    model.eval()
    method = configured_method(extraction.method)
    transform = make_transforms(pool, train=False)
    outputs = []
    started = time.perf_counter()
    total = len(pool)
    batches = max(1, -(-total // batch_size))
    stream = stream_batches(pool, np.arange(total), [np.arange(start, min(start + batch_size, total))
                                                     for start in range(0, total, batch_size)],
                            workers=input_workers, pin_memory=device.type == "cuda")
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
