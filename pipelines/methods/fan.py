"""FAN: feature adaptation network (Iscen et al., ECCV 2020) as adapted for compatibility by CL2R / IAM-CL2R."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from pydantic import Field
import torch.nn.functional as F
from torch import nn

from pipelines.methods.base import (
    MethodParams,
    Batch,
    Method,
    TaskContext,
    classification_cross_entropy,
    old_outputs,
)


def make_adapter(dim: int, hidden: int) -> nn.Module:
    """The adaptation network psi: (B, dim) old features -> (B, dim) features in the new model's space."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, dim))


class FAN(Method):
    """``CE + lam_distill * (1 - cos(new, old)) + lam_adapter * ||psi(old) - new||^2`` per batch.

    The model is fine-tuned with cross-entropy plus the cosine feature distillation FAN inherits from LUCIR; an
    adapter psi_t (2-layer MLP, hidden width ``adapter_hidden``) learns to map the old model's L2-normalised
    features onto the new model's (targets detached, so the adapter term does not move the model). For retrieval
    the adapters compose: a gallery feature of model k is compared with a query of model t after
    ``psi_t(...psi_{k+1}(f_k))`` (CL2R: "the learned adaptation functions are used to transform the features into
    compatible features"); :func:`adapt_features` does that and ``export_state()`` hands psi_t to the stage.
    Choices: adapter trained jointly with the model (FAN trains it after the model), on all batch samples;
    lam_distill 1, lam_adapter 1, hidden 512. Without a previous model the loss is the CE alone and no adapter exists.
    """

    name = "fan"
    classifier = "learnable"
    uses_replay = True
    needs_old_model = True

    class Params(MethodParams):
        lam_distill: float = Field(1.0, ge=0.0)
        lam_adapter: float = Field(1.0, ge=0.0)
        adapter_hidden: int = Field(512, ge=1)

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.adapter: nn.Module | None = None

    def setup(self, ctx: TaskContext) -> list[nn.Module]:
        self.adapter = None
        if ctx.old_model is None:
            return []
        dim = getattr(ctx.model, "feature_dim", None)
        if not isinstance(dim, int):
            raise ValueError(f"fan needs a CompatModel (attribute feature_dim = K - 1), got {type(ctx.model).__name__}")
        self.adapter = make_adapter(dim, self.hparams.adapter_hidden).to(ctx.device)
        return [self.adapter]

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        ce = classification_cross_entropy(output.logits, batch.targets)
        if ctx.old_model is None or self.adapter is None:
            return ce, {"ce": ce.detach()}
        hp = self.hparams
        old = old_outputs(ctx, batch.images)
        new_unit = F.normalize(output.features.float(), dim=1)
        old_unit = F.normalize(old.features.float(), dim=1)
        distill = (1.0 - (new_unit * old_unit).sum(dim=1)).mean()
        adapted = self.adapter(old_unit).float()
        adapter_loss = (adapted - new_unit.detach()).pow(2).sum(dim=1).mean()
        total = ce + hp.lam_distill * distill + hp.lam_adapter * adapter_loss
        return total, {"ce": ce.detach(), "distill": distill.detach(), "adapter": adapter_loss.detach()}

    def export_state(self) -> dict[str, dict[str, torch.Tensor]]:
        if self.adapter is None:
            return {}
        return {"adapter": {k: v.detach().cpu().clone() for k, v in self.adapter.state_dict().items()}}


def adapt_features(features: torch.Tensor, adapters: Sequence[nn.Module]) -> torch.Tensor:
    """Map gallery features of model k into model t's space: apply psi_{k+1}, ..., psi_t in order, L2-normalise.

    features: (N, d) features of the older model; adapters: the adapters trained at tasks k+1..t (oldest first).
    Returns (N, d) float unit vectors; with no adapter it just normalises.
    """
    if features.ndim != 2:
        raise ValueError(f"features must have shape (N, d), got {tuple(features.shape)}")
    mapped = F.normalize(features.float(), dim=1)
    with torch.no_grad():
        for adapter in adapters:
            mapped = F.normalize(adapter(mapped).float(), dim=1)
    return mapped


def load_adapter(state: dict[str, torch.Tensor]) -> nn.Module:
    """Rebuild an adapter from ``FAN.export_state()["adapter"]`` (sizes read from the weights)."""
    try:
        first, last = state["0.weight"], state["2.weight"]
    except KeyError as error:
        raise KeyError(f"FAN adapter state lacks {error}; expected keys 0.weight, 0.bias, 2.weight, 2.bias") from None
    adapter = make_adapter(int(first.shape[1]), int(first.shape[0]))
    if tuple(last.shape) != (first.shape[1], first.shape[0]):
        raise ValueError(f"FAN adapter state has inconsistent shapes {tuple(first.shape)} and {tuple(last.shape)}")
    adapter.load_state_dict(state)
    return adapter.eval()
