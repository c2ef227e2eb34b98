"""CVS: continual learning for visual search with backward-consistent embeddings (Wan et al., CVPR 2022)
(objective: pipelines.methods.cvs)."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class CVSParams(MethodParams):
    lam_neighbour: float = Field(1.0, ge=0.0)
    lam_relation: float = Field(1.0, ge=0.0)
    tau: float = Field(0.1, gt=0.0)


CVS = register_method(MethodCard(
    name="cvs", Params=CVSParams, classifier="learnable", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.cvs:CVS"))
