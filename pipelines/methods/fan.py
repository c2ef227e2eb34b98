"""FAN: feature adaptation network (Iscen et al., ECCV 2020) as adapted for compatibility by CL2R / IAM-CL2R."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compat_core.upgrades.adapters import FanAdapter
from pipelines.methods.objective import (
    Batch,
    Method,
    TaskContext,
    classification_cross_entropy,
    old_features,
)
from pipelines.methods.cards import fan as cards


class FAN(Method):
    """``CE + lam_distill * (1 - cos(new, old)) + lam_adapter * ||psi(old) - new||^2`` per batch.

    The model is fine-tuned with cross-entropy plus the cosine feature distillation FAN inherits from LUCIR; an
    adapter psi_t (:class:`compat_core.upgrades.adapters.FanAdapter`, the ``fan`` kind of the common adapter interface:
    Linear-ReLU-Linear, hidden width ``adapter_hidden``) learns to map the old model's L2-normalised features onto
    the new model's (targets detached, so the adapter term does not move the model). For retrieval the adapters
    compose: a gallery feature of model k is compared with a query of model t after ``psi_t(...psi_{k+1}(f_k))``
    (CL2R: "the learned adaptation functions are used to transform the features into compatible features");
    :func:`compat_core.upgrades.adapters.apply_chain` does that and ``export_state()`` hands psi_t to the stage, which stores
    it like every adapter (safetensors with kind metadata).
    Choices: adapter trained jointly with the model (FAN trains it after the model), on all batch samples;
    lam_distill 1, lam_adapter 1, hidden 512. Without a previous model the loss is the CE alone and no adapter exists.
    """

    card = cards.FAN

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.adapter: FanAdapter | None = None

    def setup(self, ctx: TaskContext) -> list[nn.Module]:
        self.adapter = None
        if ctx.old_model is None:
            return []
        dim = getattr(ctx.model, "feature_dim", None)
        if not isinstance(dim, int):
            raise ValueError(f"fan needs a CompatModel (attribute feature_dim = K - 1), got {type(ctx.model).__name__}")
        self.adapter = FanAdapter(hidden=self.hparams.adapter_hidden)
        return [self.adapter.build(dim, dim).to(ctx.device)]

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        ce = classification_cross_entropy(output.logits, batch.targets)
        if ctx.old_model is None or self.adapter is None:
            return ce, {"ce": ce.detach()}
        hp = self.hparams
        previous_features = old_features(ctx, batch.images)
        new_unit = F.normalize(output.features.float(), dim=1)
        old_unit = F.normalize(previous_features.float(), dim=1)
        distill = (1.0 - (new_unit * old_unit).sum(dim=1)).mean()
        adapter_loss = self.adapter.objective(old_unit, new_unit.detach())
        total = ce + hp.lam_distill * distill + hp.lam_adapter * adapter_loss
        return total, {"ce": ce.detach(), "distill": distill.detach(), "adapter": adapter_loss.detach()}

    def export_state(self) -> dict[str, FanAdapter]:
        """``{"adapter": psi_t}`` after training (empty without an old model); the stage stores it with
        :func:`compat_core.upgrades.adapters.save_adapter`."""
        if self.adapter is None:
            return {}
        self.adapter.net.eval()
        return {"adapter": self.adapter}
