"""One registered model per scenario across runs, and models logged as MLflow's pyfunc flavour written as code.

Against the real ``mlflow server`` (session fixture), through ``compat run``:

- two runs of one scenario (the second with another seed, so new weights) add their versions to ONE registered model
  named after the scenario; ``task-N`` and ``latest-task`` follow the newest run, the first run's versions stay;
  ``output.registered_model`` puts a run's models under another name;
- ``mlflow.pyfunc.load_model("models:/NAME@task-2").unwrap_python_model().model`` returns the model, whose weights are the run's
  model.safetensors and whose features on the query pool, computed by the pipeline's own extraction path, equal the
  features the run stored (float32 features, one torch thread: bit-identical);
- the same alias still works as a ``models:/`` replacement source (tests/cluster/test_model_sources.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

from app.cli import main  # noqa: E402

pytestmark = pytest.mark.integration
SCENARIO = "registry-stable-name"


def _run(tmp_path: Path, folder: str, uri: str, *overrides: str) -> Path:
    document = tiny.scenario("dsimplex-hoc", output=str(tmp_path / folder))
    document["name"] = SCENARIO
    document["evaluation"]["feature_dtype"] = "float32"  # stored features comparable bit for bit
    config = tmp_path / f"{folder}.yaml"
    config.write_text(yaml.safe_dump(document))
    sets = [arg for override in overrides for arg in ("--set", override)]
    assert main(["run", str(config), "--tracking-uri", uri, "--no-progress", *sets]) == 0
    return tmp_path / folder


def test_one_registered_model_per_scenario_and_pytorch_flavour_loads_by_alias(mlflow_server, tmp_path, monkeypatch):
    import mlflow.pyfunc
    from mlflow import MlflowClient
    from safetensors.torch import load_file

    from pipelines.config.load import load_config
    from pipelines.stages.extraction import extract_pool_features
    from pipelines.stages.feature_store import read_features
    from pipelines.stages.pools import load_pool
    from pipelines.store.run_store import RunStore

    tiny.register()
    torch.set_num_threads(1)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = mlflow_server.tracking_uri
    client = MlflowClient(uri)

    first = _run(tmp_path, "first", uri)
    first_versions = {v.tags["stage_key"]: v.version for v in client.search_model_versions(f"name = '{SCENARIO}'")}
    assert len(first_versions) == 4  # pretrain p1 + tasks 1..3
    second = _run(tmp_path, "second", uri, "seed=1")  # new weights: new stage keys, same scenario
    versions = client.search_model_versions(f"name = '{SCENARIO}'")
    assert len(versions) == 8 and {v.tags["stage_key"]: v.version for v in versions
                                   if v.tags["stage_key"] in first_versions} == first_versions
    assert [m.name for m in client.search_registered_models(f"name LIKE '{SCENARIO}%'")] == [SCENARIO]
    second_store = RunStore(second)
    model_keys = sorted(k for k in second_store.stage_keys() if k.startswith(("finetune-", "replace-")))
    by_task = {int(second_store.load_record(k)["task"]): k for k in model_keys}
    # --set seed=1 changed what the file computes: the second run moves its own aliases only, the bare scenario
    # aliases stay on the first run (its config file as written)
    second_name = next(v.tags["run_name"] for v in versions if v.tags["stage_key"] == by_task[0])
    for task, key in by_task.items():
        assert client.get_model_version_by_alias(SCENARIO, f"{second_name}__task-{task + 1}").tags["stage_key"] == key
        assert client.get_model_version_by_alias(SCENARIO, f"task-{task + 1}").tags["stage_key"] in first_versions
    assert client.get_model_version_by_alias(SCENARIO, f"{second_name}__latest-task").tags["stage_key"] == by_task[2]
    assert second_name.startswith("second-")

    # the pyfunc flavour written as code: models:/NAME@<run>__task-2 -> the CompatModel with the run's weights
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # how a user points mlflow at the server
    loaded = mlflow.pyfunc.load_model(f"models:/{SCENARIO}@{second_name}__task-2").unwrap_python_model().model
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert type(loaded).__name__ == "CompatModel"
    weights = load_file(str(second_store.blob_path(by_task[1], "model.safetensors")))
    state = loaded.state_dict()
    assert weights.keys() <= state.keys() and all(torch.equal(state[k], v) for k, v in weights.items())
    config = load_config(str(second / "config.yaml"))
    extract_key = next(k for k in second_store.stage_keys() if k.startswith("extract-")
                       and second_store.load_record(k)["task"] == 1 and second_store.load_record(k)["split"] == "query")
    stored, labels, _ = read_features(second_store, extract_key)
    pool = load_pool(config.evaluation.query_set, "evaluation.query_set")
    computed = extract_pool_features(loaded, pool, config, torch.device("cpu"))
    assert stored.dtype == np.float32 and stored.shape == computed.shape == (len(pool), 9)
    np.testing.assert_array_equal(computed, stored)
    np.testing.assert_array_equal(labels, np.asarray(pool.labels))
    # and the first run's model differs (the bare alias names that one)
    first_weights = load_file(str(RunStore(first).blob_path(
        next(k for k in RunStore(first).stage_keys() if k.startswith("finetune-")
             and RunStore(first).load_record(k)["task"] == 1), "model.safetensors")))
    assert not all(torch.equal(first_weights[k], weights[k]) for k in weights)

    # output.registered_model: the run's models go to the name the team chose
    _run(tmp_path, "named", uri, "output.registered_model=team-retrieval")
    named = client.get_model_version_by_alias("team-retrieval", "task-3")
    assert named.tags["stage_key"] in first_versions  # same config as the first run: same stage keys
    assert named.source == f"runs:/{named.run_id}/model"
