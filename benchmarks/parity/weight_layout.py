"""Our model's weights in the public IAM-CL2R code's key layout (``Incremental_ResNet``), and back.

Ours (``CompatModel`` with ``backbone: resnet18``) and the public ResNet18 share the backbone's names
(``backbone.conv1.weight`` ...); the public ``fc1`` (the bias-free Linear to K-1, d-Simplex models only) is our
``junction`` and its ``fc2`` our learnable ``classifier`` (the public d-Simplex ``fc2`` is the fixed prototype matrix,
which ours computes in closed form and does not store). The way back is the product's own reader
(``compat_core.models.weights.load_external_weights``, layout ``iamcl2r``).
"""
from __future__ import annotations

from typing import Mapping

import torch

OURS_TO_PUBLIC = {"junction.weight": "fc1.weight", "classifier.weight": "fc2.weight"}


def public_state(ours: Mapping[str, torch.Tensor], fc2_rows: int = 1, fc2_width: int | None = None
                 ) -> dict[str, torch.Tensor]:
    """``ours`` renamed to the public layout. The public loader deletes ``fc2.weight`` from every file whose path
    holds "pretrained" (src/iamcl2r/models/__init__.py:181) and fails when it is absent, so a model without a
    learnable classifier gets a zero ``fc2.weight`` of ``fc2_rows`` x ``fc2_width`` (the junction's or the
    backbone's width when None); it is never used."""
    out = {OURS_TO_PUBLIC.get(name, name): value.detach().clone() for name, value in ours.items()}
    if "fc2.weight" not in out:
        width = fc2_width
        if width is None:
            width = out["fc1.weight"].shape[0] if "fc1.weight" in out else 512
        reference = next(v for v in out.values() if v.is_floating_point())
        out["fc2.weight"] = torch.zeros(fc2_rows, width, dtype=reference.dtype)
    return out


def ours_name(public_name: str) -> str:
    """Our parameter name of a public one (``fc1.weight`` -> ``junction.weight``, ...)."""
    back = {value: key for key, value in OURS_TO_PUBLIC.items()}
    return back.get(public_name, public_name)
