"""The pyfunc model's input contract: normalised float NCHW images give the model's own L2-normalised features;
uint8 pixels or channels-last arrays are refused with the expected layout and how to convert."""
from __future__ import annotations

import importlib
import warnings

import numpy as np
import pytest
import torch

from cluster.model_registry import pyfunc
from cluster.model_registry.pyfunc import CompatPyfuncModel
from compat_core.models.compat_model import create_model


@pytest.fixture
def pyfunc_model() -> CompatPyfuncModel:
    torch.manual_seed(0)
    wrapper = CompatPyfuncModel()
    wrapper.model = create_model("cnn4", 12, backbone_config={"width": 4}).eval()
    return wrapper


def test_float_nchw_images_give_the_models_features(pyfunc_model):
    images = np.random.default_rng(0).normal(size=(3, 3, 32, 32)).astype(np.float32)
    features = pyfunc_model.predict(None, images)
    with torch.no_grad():
        expected = pyfunc_model.model.features(torch.from_numpy(images)).numpy()
    assert features.shape == expected.shape and features.dtype == np.float32
    np.testing.assert_array_equal(features, expected)
    np.testing.assert_allclose(np.linalg.norm(features, axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("images, shown", [
    (np.zeros((2, 32, 32, 3), dtype=np.uint8), "uint8 (2, 32, 32, 3)"),
    (np.zeros((2, 32, 32, 3), dtype=np.float32), "float32 (2, 32, 32, 3)"),
    (np.zeros((32, 32), dtype=np.float32), "float32 (32, 32)"),
])
def test_other_layouts_are_refused_naming_the_expected_one(pyfunc_model, images, shown):
    with pytest.raises(ValueError) as refused:
        pyfunc_model.predict(None, images)
    message = str(refused.value)
    assert "(B, C, H, W)" in message and shown in message and "transpose(0, 3, 1, 2) / 255" in message


def test_defining_the_model_raises_no_type_hint_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.reload(pyfunc)  # the PythonModel subclass is defined (and its predict inspected) again
    assert not [w for w in caught if "type hint" in str(w.message).lower()], [str(w.message) for w in caught]
