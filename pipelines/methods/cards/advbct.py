"""AdvBCT-ER: adversarial backward-compatible training (Pan et al., CVPR 2023) with replay
(objective: pipelines.methods.advbct)."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class AdvBCTParams(MethodParams):
    lam_influence: float = Field(1.0, ge=0.0)
    lam_adv: float = Field(0.1, ge=0.0)
    lam_boundary: float = Field(1.0, ge=0.0)
    elasticity: float = Field(0.1, ge=0.0)
    discriminator_hidden: int = Field(256, ge=1)


ADVBCT_ER = register_method(MethodCard(
    name="advbct-er", Params=AdvBCTParams, classifier="learnable", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.advbct:AdvBCTER"))
