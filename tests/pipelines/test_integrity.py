"""Run-folder integrity: records hold locations relative to the run root and the bytes that pass the manifest's
sha256 are the bytes loaded, so a moved run resumes, and a copied run never loads the original folder's weights."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import tiny_scenario_helpers as tiny
import torch

from pipelines.config.load import validate_config
from pipelines.engine.runner import LocalExecutor
from pipelines.graph.compile import compile_scenario
from pipelines.stages.feature_store import read_features
from pipelines.store.run_store import RunStore


def _run(document: dict, folder: Path):
    tiny.register()
    torch.set_num_threads(1)
    document = dict(document, output={"dir": str(folder)})
    graph = compile_scenario(validate_config(document))
    store = RunStore(str(folder))
    return graph, store, LocalExecutor(progress=False).run(graph, store)


def _forget_everything_but_models(folder: Path, graph) -> None:
    """Delete every committed stage except the trained models, so a resume re-extracts from the stored weights."""
    models = set(graph.model_stages) | set(graph.pretrain_stages.values())
    for manifest in (folder / "manifests").glob("*.json"):
        if manifest.stem not in models:
            manifest.unlink()
    (folder / "matrix.json").unlink()


def test_moved_and_copied_runs_load_their_own_verified_weights(tmp_path):
    document = tiny.scenario("dsimplex-hoc")
    original = tmp_path / "original"
    graph, store, summary = _run(document, original)
    reference = summary.matrix["values"]
    reference_features = read_features(store, graph.extract_stages[(0, "query")])[0]
    record = store.load_record(graph.model_stages[0])
    assert not Path(record["uri"]).is_absolute() and record["uri"] == f"artifacts/{graph.model_stages[0]}"

    copied = tmp_path / "copied"
    shutil.copytree(original, copied)
    moved = tmp_path / "moved"
    original.rename(moved)  # the folder the records were written in is gone
    _forget_everything_but_models(moved, graph)
    _, moved_store, again = _run(document, moved)
    assert again.matrix["values"] == reference

    # a folder at the original path now holds other weights (task 0's model swapped for task 1's): a resume of the
    # copy must still load the copy's own weights and reproduce the reference exactly
    shutil.copytree(moved, original)
    first, second = (original / "artifacts" / graph.model_stages[t] / "model.safetensors" for t in (0, 1))
    first.write_bytes(second.read_bytes())
    _forget_everything_but_models(copied, graph)
    _, copied_store, resumed = _run(document, copied)
    assert resumed.matrix["values"] == reference
    features = read_features(copied_store, graph.extract_stages[(0, "query")])[0]
    assert np.array_equal(features, reference_features)


def test_results_do_not_depend_on_the_ambient_thread_count_and_threads_are_in_the_key(tmp_path):
    """A stage computes with its own thread count (resources.<kind>.num_cpus) on every backend, so the process's
    torch thread setting changes nothing; a different stage thread count is a different stage key."""
    document = tiny.scenario("dsimplex-hoc")
    blobs = []
    for ambient, folder in ((1, tmp_path / "one"), (2, tmp_path / "two")):
        torch.set_num_threads(ambient)
        tiny.register()
        graph = compile_scenario(validate_config(dict(document, output={"dir": str(folder)})))
        LocalExecutor(progress=False).run(graph, RunStore(str(folder)))
        blobs.append({p.relative_to(folder): p.read_bytes() for p in (folder / "artifacts").rglob("*") if p.is_file()})
    torch.set_num_threads(1)
    assert blobs[0].keys() == blobs[1].keys() and blobs[0] == blobs[1]
    two_threads = dict(document, resources={"finetune": {"num_cpus": 2}})
    keys_one = set(compile_scenario(validate_config(document)).model_stages)
    keys_two = set(compile_scenario(validate_config(two_threads)).model_stages)
    assert not keys_one & keys_two  # every model stage (all are finetune here) changes key
