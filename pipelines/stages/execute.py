"""Stage dispatch: (stage, run settings, store) -> the stage function of its kind, run with its committed parents'
records, its artifacts committed to the store (blobs, then the manifest).

Every stage function is pure in the sense that matters for resuming: its output depends only on its typed inputs
(``stage.inputs``, all in its key) and its parents' artifacts, and its result is committed atomically (blobs, then
the manifest) by
:func:`execute_stage`. Records hold URIs, never tensors, so the same functions run in-process (LocalExecutor) or
inside Ray actors (cluster package) with a local or S3 store. Training progress goes through ``emit(record)``;
stages never call a tracker. The functions by kind: ``pipelines.stages.training_stages`` (pretrain, finetune, replace),
``pipelines.stages.extraction`` (extract), ``pipelines.stages.entries`` (entry, evaluate), ``pipelines.stages.adapt`` (adapt).
"""
from __future__ import annotations

from typing import Callable

import torch

from pipelines.engine.process_memory import limit_heap_caching, release_freed_memory
from pipelines.graph.compile import Stage, stage_threads
from pipelines.graph.stage_kind import StageKind
from pipelines.records.stage_records import CommittedStage, committed_stage, read_record, record_to_json
from pipelines.stages.context import Emit, StageContext, StageResult, resolve_device
from pipelines.stages.entries import entry_stage, evaluate_stage
from pipelines.stages.extraction import extract_stage
from pipelines.stages.inputs import RunSettings
from pipelines.stages.training_stages import pretrain_stage, train_task_stage
from pipelines.stages.adapt import adapt_stage
from pipelines.store.run_store import RunStore
from pipelines.training.checkpoints import collect_garbage
from pipelines.training.distributed import is_leader

STAGE_FUNCTIONS: dict[StageKind, Callable[[StageContext], StageResult]] = {
    StageKind.PRETRAIN: pretrain_stage,
    StageKind.FINETUNE: train_task_stage,
    StageKind.REPLACE: train_task_stage,
    StageKind.EXTRACT: extract_stage,
    StageKind.ENTRY: entry_stage,
    StageKind.EVALUATE: evaluate_stage,
    StageKind.ADAPT: adapt_stage,  # adapters at a replacement
}


def execute_stage(stage: Stage, settings: RunSettings, store: RunStore, emit: Emit,
                  code_version: str | None = None, placement: dict | None = None) -> CommittedStage | None:
    """Run one stage whose parents are committed, commit its artifacts (blobs, then manifest) and return what was
    committed (typed record, node keys, blob table: what the engine hands the tracker); None on a data-parallel rank
    other than 0, which commits nothing.

    This is the unit a Ray actor runs: everything it needs is the stage (with its inputs), the run's settings (how
    it runs: device, checkpoint cadence, input workers) and the store, where its parents' records are read by key.
    placement: where it ran (the Ray backend gives node id, host, pid), kept in the record as ``placement``.
    """
    # large tensors in mappings of their own, and what earlier stages of this process freed back to the OS
    limit_heap_caching()
    release_freed_memory()
    parents = {}
    for key in stage.parents:
        if not store.has(key):
            raise RuntimeError(f"stage {stage.label}: parent {key} is not committed; run the graph in order")
        parents[key] = read_record(store, key)
    ctx = StageContext(stage, store, parents, emit, resolve_device(settings.device), settings)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(stage_threads(stage.resources))  # the count in the stage key, on every backend
    try:
        result = STAGE_FUNCTIONS[stage.kind](ctx)
    finally:
        torch.set_num_threads(threads_before)
    if not is_leader():
        return None  # a data-parallel rank other than 0 (pipelines.training.distributed): rank 0 commits the stage
    node = {"kind": stage.kind, "label": stage.label}
    if placement is not None:
        node["placement"] = dict(placement)
    manifest = store.commit(stage.key, record_to_json(result.record, **node), result.blobs, code_version=code_version,
                            precision=stage.inputs.precision, compiled=getattr(stage.inputs, "compiled", None),
                            channels_last=getattr(stage.inputs, "channels_last", None))
    if stage.kind.trains:
        collect_garbage(store, stage.key)  # the committed model supersedes its epoch checkpoints
    return committed_stage(manifest)
