"""LCE-ER: Learning Compatible Embeddings (Meng et al., ICCV 2021) with replay (objective: pipelines.methods.lce)."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class LCEParams(MethodParams):
    lam_align: float = Field(1.0, ge=0.0)
    lam_boundary: float = Field(1.0, ge=0.0)


LCE_ER = register_method(MethodCard(
    name="lce-er", Params=LCEParams, classifier="learnable", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.lce:LCEER"))
