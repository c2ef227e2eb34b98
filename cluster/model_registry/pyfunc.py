"""MLflow ``pyfunc`` flavour of a pipeline model, written as code (MLflow's models-from-code): no pickle anywhere.

A registered version holds ``artifacts/model.safetensors`` + ``artifacts/config.json`` (the weights the pipeline
trained, byte for byte) and this file. Loading it rebuilds the model from its config (the d-Simplex head is a closed
form of K, never stored) and reads the weights as safetensors::

    model = mlflow.pyfunc.load_model("models:/demo-dsimplex-hoc@task-4")
    features = model.predict(images)                   # float32 (B, C, H, W) normalised images -> (B, d) features
    compat_model = model.unwrap_python_model().model   # the CompatModel itself (``.features(x)``, ``.logits(x)``)

Loading verifies ``model.safetensors`` and ``config.json`` against the sha256 digests written into its ``MLmodel``
(``model_config``: ``files_sha256`` and ``content_sha256``, the same values as the registered version's tags) and
raises ``IntegrityError`` naming the file that differs. Needs the ``compat-learning`` package installed where it is
loaded. No postponed annotations here: MLflow reads
the ``predict`` type hint as an object (an ndarray: no schema inferred, no warning).
"""

from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import torch
from mlflow.pyfunc import PythonModel

from cluster.model_registry.model_cache import expected_files, first_mismatch, mismatch_error
from cluster.model_registry.versions import CONFIG_ARTIFACT, WEIGHTS_ARTIFACT
from compat_core.models.compat_model import model_from_bytes


class CompatPyfuncModel(PythonModel):
    """Loads the model from its safetensors artifacts; ``predict`` returns L2-normalised retrieval features."""

    model: Any = None

    def load_context(self, context) -> None:
        """Verify the files against the digests recorded when the model was written (the ones the registered
        version's ``files_sha256`` / ``content_sha256`` tags carry; IntegrityError naming the file that differs),
        then build the model."""
        weights = Path(context.artifacts[WEIGHTS_ARTIFACT])
        config = Path(context.artifacts[CONFIG_ARTIFACT])
        recorded = dict(getattr(context, "model_config", None) or {})
        expected = expected_files(recorded, f"MLflow model at {weights.parent.parent}")
        if expected is not None:
            mismatch = first_mismatch(weights.parent, expected)
            if mismatch is not None:
                raise mismatch_error(f"MLflow model at {weights.parent.parent}", weights.parent, mismatch)
        self.model = model_from_bytes(config.read_bytes(), weights.read_bytes(), where=str(weights.parent)).eval()

    def predict(self, context, model_input: np.ndarray, params: dict | None = None) -> np.ndarray:
        """Features ``(B, d)`` float32, L2-normalised, of images ``(B, C, H, W)``: floating point, already normalised as
        the model was trained (the run's data transform: scaled to [0, 1], then mean/std of its dataset); this
        method does not normalise. Anything else (uint8 pixels, ``(B, H, W, C)``) is refused naming the layout."""
        images = np.asarray(model_input)
        channels_last = images.ndim == 4 and images.shape[-1] in (1, 3) and images.shape[1] not in (1, 3)
        if images.ndim != 4 or not np.issubdtype(images.dtype, np.floating) or channels_last:
            raise ValueError(f"model_input: expected normalised float images (B, C, H, W) (NCHW), got "
                             f"{images.dtype} {tuple(images.shape)}; convert uint8 (B, H, W, C) pixels with "
                             f"x.transpose(0, 3, 1, 2) / 255, then normalise with the mean and std of the run's data")
        with torch.no_grad():
            return self.model.features(torch.as_tensor(images, dtype=torch.float32)).numpy()


mlflow.models.set_model(CompatPyfuncModel())
