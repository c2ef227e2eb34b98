"""`mlflow.pyfunc.load_model` of a registered version verifies its files: the digests written into the model's
MLmodel equal the version's files_sha256 / content_sha256 tags, an untouched version loads and predicts, and a
version whose stored weights or config were changed on the real MLflow server's artifact store is refused with an
IntegrityError naming the file."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration
NAME = "pyfunc-integrity-test"


def _register(client, folder: Path) -> tuple[str, str]:
    """A randomly initialised cnn4 registered the way the pipeline registers it; (version, run id)."""
    import torch

    from cluster.model_registry.model_cache import content_tags
    from cluster.model_registry.versions import ensure_registered_model, register_version, write_model_folder
    from cluster.tracking.client import ensure_experiment
    from compat_core.models.compat_model import create_model, model_to_bytes
    from pipelines.store.run_store import sha256_bytes

    torch.manual_seed(0)
    blobs = model_to_bytes(create_model("cnn4", num_slots=10, backbone_config={"in_chans": 1, "width": 4}).eval())
    target = write_model_folder(folder / "model", blobs["config.json"], blobs["model.safetensors"])
    run = client.create_run(ensure_experiment(client, "pyfunc-integrity"))
    client.log_artifacts(run.info.run_id, str(target), "model")
    client.set_terminated(run.info.run_id)
    ensure_registered_model(client, NAME)
    files = {name: sha256_bytes(blobs[name]) for name in ("config.json", "model.safetensors")}
    version = register_version(client, NAME, run.info.run_id, "integrity",
                               {"sha256": files["model.safetensors"], **content_tags(files)}, [])
    return str(version.version), run.info.run_id


def test_pyfunc_load_verifies_the_files_against_the_versions_digests(mlflow_server, tmp_path, monkeypatch):
    import mlflow
    from mlflow import MlflowClient

    from compat_core.integrity import IntegrityError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.tracking_uri)
    mlflow.set_tracking_uri(mlflow_server.tracking_uri)
    client = MlflowClient(mlflow_server.tracking_uri)
    version, run_id = _register(client, tmp_path)
    tags = client.get_model_version(NAME, version).tags
    recorded = mlflow.models.Model.load(f"models:/{NAME}/{version}").flavors["python_function"]["config"]
    assert json.loads(recorded["files_sha256"]) == json.loads(tags["files_sha256"])
    assert recorded["content_sha256"] == tags["content_sha256"]

    images = np.random.default_rng(0).standard_normal((2, 1, 16, 16)).astype(np.float32)
    features = mlflow.pyfunc.load_model(f"models:/{NAME}/{version}").predict(images)
    assert features.shape == (2, 9)

    stored = {path.name: path for path in Path(mlflow_server.artifacts_destination).rglob("*")
              if run_id in path.parts and path.parent.name == "artifacts" and path.is_file()}
    assert {"model.safetensors", "config.json"} <= set(stored), sorted(stored)
    for name in ("model.safetensors", "config.json"):
        original = stored[name].read_bytes()
        changed = bytearray(original)
        changed[-2] ^= 0x01   # one bit of the stored file, the registry's tags untouched
        stored[name].write_bytes(bytes(changed))
        try:
            with pytest.raises(IntegrityError, match=rf"registered file {name.replace('.', '[.]')}"):
                mlflow.pyfunc.load_model(f"models:/{NAME}/{version}")
        finally:
            stored[name].write_bytes(original)
    assert mlflow.pyfunc.load_model(f"models:/{NAME}/{version}").predict(images) == pytest.approx(features)
