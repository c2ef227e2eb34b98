"""BCT-ER: Backward Compatible Training (Shen et al., CVPR 2020) with replay (objective: pipelines.methods.bct)."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class BCTParams(MethodParams):
    lam: float = Field(1.0, ge=0.0)


BCT_ER = register_method(MethodCard(
    name="bct-er", Params=BCTParams, classifier="learnable", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.bct:BCTER"))
