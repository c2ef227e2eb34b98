"""d-Simplex methods: fixed d-Simplex classifier + HOC (IAM-CL2R) or + feature distillation on memory (CL2R)
(objectives: pipelines.methods.dsimplex)."""
from __future__ import annotations

from pydantic import Field

from compat_core.kinds import InfoNceMasking
from pipelines.methods.card import MethodCard, MethodParams, register_method


class HOCParams(MethodParams):
    lam: float = Field(0.1, ge=0.0, le=1.0)
    rho: float = Field(10.0, gt=0.0)
    masking: InfoNceMasking = "standard"  # the one list of maskings (compat_core.kinds), also the loss's check


class FDParams(MethodParams):
    w_base: float = Field(5.0, ge=0.0)


DSIMPLEX_HOC = register_method(MethodCard(
    name="dsimplex-hoc", Params=HOCParams, classifier="simplex", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.dsimplex:DSimplexHOC"))
DSIMPLEX_FD = register_method(MethodCard(
    name="dsimplex-fd", Params=FDParams, classifier="simplex", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.dsimplex:DSimplexFD"))
