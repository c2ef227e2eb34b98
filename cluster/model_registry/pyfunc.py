"""MLflow ``pyfunc`` flavour of a pipeline model, written as code (MLflow's models-from-code): no pickle anywhere.

A registered version holds ``artifacts/model.safetensors`` + ``artifacts/config.json`` (the weights the pipeline
trained, byte for byte) and this file. Loading it rebuilds the model from its config (the d-Simplex head is a closed
form of K, never stored) and reads the weights as safetensors::

    model = mlflow.pyfunc.load_model("models:/demo-dsimplex-hoc@task-4")
    features = model.predict(images)                   # float32 (B, C, H, W) normalised images -> (B, d) features
    compat_model = model.unwrap_python_model().model   # the CompatModel itself (``.features(x)``, ``.logits(x)``)

Needs the ``compat-learning`` package installed where it is loaded.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import torch
from mlflow.pyfunc import PythonModel

from cluster.model_registry.versions import CONFIG_ARTIFACT, WEIGHTS_ARTIFACT
from compat_core.models.compat_model import model_from_bytes


class CompatPyfuncModel(PythonModel):
    """Loads the model from its safetensors artifacts; ``predict`` returns L2-normalised retrieval features."""

    model: Any = None

    def load_context(self, context) -> None:
        weights = Path(context.artifacts[WEIGHTS_ARTIFACT])
        config = Path(context.artifacts[CONFIG_ARTIFACT])
        self.model = model_from_bytes(config.read_bytes(), weights.read_bytes(), where=str(weights.parent)).eval()

    def predict(self, context, model_input, params: dict | None = None) -> np.ndarray:
        """Features ``(B, d)`` float32 of images ``(B, C, H, W)`` (float, normalised as the model was trained)."""
        images = torch.as_tensor(np.asarray(model_input, dtype=np.float32))
        with torch.no_grad():
            return self.model.features(images).numpy()


mlflow.models.set_model(CompatPyfuncModel())
