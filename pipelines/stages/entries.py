"""The ``entry`` and ``evaluate`` stages: one matrix entry C[row, column] from committed extracts (through the FAN
adapters of the tasks in between, direct features or the exact linear-head bridge) and a matrix row from its
entries."""
from __future__ import annotations

from compat_core.upgrades.adapters import load_adapter_bytes
from pipelines.records.payloads import EvaluationProtocol
from pipelines.records.stage_records import EntryRecord, FeatureRecord, RowRecord
from pipelines.stages.bridge_features import entry_value
from pipelines.stages.context import StageContext, StageResult
from pipelines.stages.inputs import EntryInputs, EvaluateInputs, MatrixProtocol
from pipelines.stages.model_io import ADAPTER_BLOB
from pipelines.store.run_store import RunStore


def entry_adapters(store: RunStore, gallery_records: list[FeatureRecord], row: int, column: int) -> list:
    """FAN adapters for entry C[row, column]: those stored with the models of tasks column+1..row, oldest first.

    gallery_records: the gallery extract records of columns 0..row (their ``model_stage_key`` / ``adapter_blob``).
    Empty for methods without adapters. At a replacement FAN's adapter maps the newly loaded model's features (its
    old model there), so a chain crossing a replacement is an approximation the papers do not define.
    """
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


def entry_stage(ctx: StageContext) -> StageResult:
    """The one function computing a matrix-entry record C[row, column]; parents = (query extract, gallery extracts
    of columns 0..row), so the FAN adapters of tasks column+1..row are applied to the gallery features."""
    stage = ctx.stage
    inputs: EntryInputs = ctx.inputs
    row, column = inputs.row, inputs.column
    query_key, gallery_keys = stage.parents[0], stage.parents[1:]
    gallery_key = gallery_keys[column]
    adapters = entry_adapters(ctx.store, [ctx.parents[k] for k in gallery_keys], row, column)
    value, features = entry_value(ctx.store, inputs.rules, ctx.parents[query_key], ctx.parents[gallery_key],
                                  adapters, ctx.device)
    return StageResult(EntryRecord(stage.key, row, column, value, query_key, gallery_key,
                                   protocol_record(inputs.rules.protocol, stage.key), features))


def evaluate_stage(ctx: StageContext) -> StageResult:
    """Row t of the matrix, C[t, 0..t], from its committed entry nodes (its parents, in column order)."""
    stage = ctx.stage
    inputs: EvaluateInputs = ctx.inputs
    protocol = protocol_record(inputs.protocol, stage.key)
    values = [float(ctx.parents[key].value) for key in stage.parents]
    return StageResult(RowRecord(stage.key, inputs.row, values, list(stage.parents), protocol.metric, protocol))


def protocol_record(protocol: MatrixProtocol, stage_key: str) -> EvaluationProtocol:
    """The protocol as the records hold it."""
    return EvaluationProtocol.from_json(protocol.model_dump(mode="json"), f"stage {stage_key}: protocol")
