"""FAN: feature adaptation network (Iscen et al., ECCV 2020) as adapted by CL2R / IAM-CL2R
(objective: pipelines.methods.fan). Entries map gallery features through the adapters it trains."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class FANParams(MethodParams):
    lam_distill: float = Field(1.0, ge=0.0)
    lam_adapter: float = Field(1.0, ge=0.0)
    adapter_hidden: int = Field(512, ge=1)


PAPER = (
    "NOT FAN as its paper defines it (Iscen et al., ECCV 2020, whose text is not in the project's paper set): FAN "
    "fits its feature-adaptation MLP after the model update, on pairs of old and updated features of the training "
    "images; here the adapter is trained jointly with the model, on every batch",
    "lifelong adaptation as CL2R (TOMM 2023): \"We adapted FAN so that the learned adaptation functions are used to "
    "transform the features into compatible features.\" (adapters compose from the gallery model to the query model)",
    "weights are this project's choices: lam_distill 1 (cosine feature distillation), lam_adapter 1, adapter "
    "hidden width 512",
)

FAN = register_method(MethodCard(
    name="fan", Params=FANParams, classifier="learnable", uses_replay=True, needs_old_model=True,
    adapts_gallery=True, objective="pipelines.methods.fan:FAN", paper=PAPER))
