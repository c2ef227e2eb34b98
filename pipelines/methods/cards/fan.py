"""FAN: feature adaptation network (Iscen et al., ECCV 2020) as adapted by CL2R / IAM-CL2R
(objective: pipelines.methods.fan). Entries map gallery features through the adapters it trains."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class FANParams(MethodParams):
    lam_distill: float = Field(1.0, ge=0.0, description="weight of the cosine feature distillation of the update")
    adapter_hidden: int = Field(512, ge=1, description="hidden width of the adaptation MLP")
    adapter_epochs: int = Field(30, ge=1, description="epochs of the adapter's fit after the update (Adam)")
    adapter_lr: float = Field(1e-3, gt=0.0, description="learning rate of the adapter's fit")


PAPER = (
    "FAN (Iscen et al., ECCV 2020; its text is not in the project's paper set): the adaptation network is a "
    "Linear-ReLU-Linear MLP fitted after the model update on pairs of features of the original and the updated "
    "network on the training images (here the task's images and the replay memory), mapping old features into the "
    "updated model's space",
    "lifelong adaptation as CL2R (TOMM 2023): \"We adapted FAN so that the learned adaptation functions are used to "
    "transform the features into compatible features.\" (adapters compose from the gallery model to the query model)",
    "choices (values the papers do not give here): the update's loss CE + lam_distill (1) x cosine feature "
    "distillation; adapter hidden width 512, fitted with Adam for 30 epochs at lr 1e-3 (weight decay 1e-4, batch "
    "256, seeded by the task) on L2-normalised features",
)

FAN = register_method(MethodCard(
    name="fan", Params=FANParams, classifier="learnable", uses_replay=True, needs_old_model=True,
    adapts_gallery=True, objective="pipelines.methods.fan:FAN", paper=PAPER))
