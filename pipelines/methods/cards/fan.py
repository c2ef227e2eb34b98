"""FAN: feature adaptation network (Iscen et al., ECCV 2020) as adapted by CL2R / IAM-CL2R
(objective: pipelines.methods.fan). Entries map gallery features through the adapters it trains."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class FANParams(MethodParams):
    lam_distill: float = Field(1.0, ge=0.0)
    lam_adapter: float = Field(1.0, ge=0.0)
    adapter_hidden: int = Field(512, ge=1)


FAN = register_method(MethodCard(
    name="fan", Params=FANParams, classifier="learnable", uses_replay=True, needs_old_model=True,
    adapts_gallery=True, objective="pipelines.methods.fan:FAN"))
