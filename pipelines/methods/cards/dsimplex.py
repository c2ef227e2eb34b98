"""d-Simplex methods: fixed d-Simplex classifier + HOC (IAM-CL2R) or + feature distillation on memory (CL2R)
(objectives: pipelines.methods.dsimplex)."""
from __future__ import annotations

from pydantic import Field, field_validator

from pipelines.methods.card import MethodCard, MethodParams, register_method

# the InfoNCE maskings compat_core.losses.compatibility_info_nce implements (a test checks both lists agree)
MASKINGS = ("standard", "reference", "paper")


class HOCParams(MethodParams):
    lam: float = Field(0.1, ge=0.0, le=1.0)
    rho: float = Field(10.0, gt=0.0)
    masking: str = "standard"

    @field_validator("masking")
    @classmethod
    def _known_masking(cls, value: str) -> str:
        if value not in MASKINGS:
            raise ValueError(f"must be one of {MASKINGS}, got {value!r}")
        return value


class FDParams(MethodParams):
    w_base: float = Field(5.0, ge=0.0)


DSIMPLEX_HOC = register_method(MethodCard(
    name="dsimplex-hoc", Params=HOCParams, classifier="simplex", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.dsimplex:DSimplexHOC"))
DSIMPLEX_FD = register_method(MethodCard(
    name="dsimplex-fd", Params=FDParams, classifier="simplex", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.dsimplex:DSimplexFD"))
