"""Test helper: register model versions on a real MLflow server whose folders hold the files a compatible model is
saved as (``model.safetensors`` + ``config.json``), real tiny models or chosen bytes."""
from __future__ import annotations

import hashlib
from pathlib import Path

from compat_core.models.compat_model import CONFIG_FILE, WEIGHTS_FILE, create_model, model_to_bytes


def tiny_model_files(num_slots: int = 10, seed: int = 0) -> dict[str, bytes]:
    """config.json and model.safetensors of a cnn4 (width 4, one channel) model with ``num_slots`` slots."""
    import torch

    torch.manual_seed(seed)
    return model_to_bytes(create_model("cnn4", num_slots, backbone_config={"in_chans": 1, "width": 4}))


def register_files(client, name: str, files: dict[str, bytes], folder: Path) -> str:
    """A new version of ``name`` (created when missing) whose ``runs:/RUN/model`` folder holds ``files``, tagged
    with the sha256 of its weights as the pipeline tags its versions; its version number."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException:
        pass
    experiment = client.get_experiment_by_name(f"{name}-runs")
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(f"{name}-runs")
    run = client.create_run(experiment_id)
    model_folder = folder / run.info.run_id / "model"
    model_folder.mkdir(parents=True)
    for file_name, data in files.items():
        (model_folder / file_name).write_bytes(data)
    client.log_artifacts(run.info.run_id, str(model_folder), "model")
    client.set_terminated(run.info.run_id)
    tags = {"sha256": hashlib.sha256(files[WEIGHTS_FILE]).hexdigest()} if WEIGHTS_FILE in files else {}
    return str(client.create_model_version(name, f"runs:/{run.info.run_id}/model", run.info.run_id, tags=tags).version)


__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "register_files", "tiny_model_files"]
