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
    """The model update ``CE + lam_distill * (1 - cos(new, old))``, then the adapter psi_t fitted after it.

    The model is fine-tuned with cross-entropy plus the cosine feature distillation FAN inherits from LUCIR. After
    the update (the selected epoch's weights), psi_t (:class:`compat_core.upgrades.adapters.FanAdapter`, the ``fan``
    kind of the common adapter interface: Linear-ReLU-Linear, hidden width ``adapter_hidden``) is fitted on feature
    pairs of the original (old) and the updated network on the task's training images and the replay memory
    (evaluation transforms, L2-normalised), as FAN trains its adaptation network: Adam, ``adapter_epochs`` at
    ``adapter_lr``, seeded by the task. For retrieval the adapters compose: a gallery feature of model k is compared
    with a query of model t after ``psi_t(...psi_{k+1}(f_k))`` (CL2R: "the learned adaptation functions are used to
    transform the features into compatible features"); ``export_state()`` fits and hands psi_t to the stage, which
    stores it like every adapter. Without a previous model the loss is the CE alone and no adapter exists.
    """

    card = cards.FAN

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.adapter: FanAdapter | None = None
        self.pairs_from: TaskContext | None = None

    def setup(self, ctx: TaskContext) -> list[nn.Module]:
        self.adapter, self.pairs_from = None, None
        if ctx.old_model is None:
            return []
        if not isinstance(getattr(ctx.model, "feature_dim", None), int):
            raise ValueError(f"fan needs a CompatModel (attribute feature_dim = K - 1), got {type(ctx.model).__name__}")
        # the models as set up (data-parallel training wraps ctx.model afterwards), for the pairs after training
        self.pairs_from = TaskContext(model=ctx.model, old_model=ctx.old_model, task=ctx.task,
                                      num_old_classes=ctx.num_old_classes, num_new_classes=ctx.num_new_classes,
                                      hparams=ctx.hparams, device=ctx.device, iterate_memory=ctx.iterate_memory,
                                      iterate_task=ctx.iterate_task)
        return []

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        ce = classification_cross_entropy(output.logits, batch.targets)
        if ctx.old_model is None:
            return ce, {"ce": ce.detach()}
        previous_features = old_features(ctx, batch.images)
        new_unit = F.normalize(output.features.float(), dim=1)
        old_unit = F.normalize(previous_features.float(), dim=1)
        distill = (1.0 - (new_unit * old_unit).sum(dim=1)).mean()
        total = ce + self.hparams.lam_distill * distill
        return total, {"ce": ce.detach(), "distill": distill.detach()}

    def export_state(self) -> dict[str, FanAdapter]:
        """``{"adapter": psi_t}`` fitted on (old, updated) feature pairs once training is over (empty without an old
        model); the stage stores it with :func:`compat_core.upgrades.adapters.save_adapter`."""
        if self.pairs_from is None:
            return {}
        if self.adapter is None:
            old, new = feature_pairs(self.pairs_from)
            hp = self.hparams
            adapter = FanAdapter(hidden=hp.adapter_hidden, epochs=hp.adapter_epochs, lr=hp.adapter_lr,
                                 seed=self.pairs_from.task)
            with torch.enable_grad():
                adapter.fit(old, new)
            self.adapter = adapter
        return {"adapter": self.adapter}


@torch.no_grad()
def feature_pairs(ctx: TaskContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Old and updated models' L2-normalised features ``(N, d)`` (fp32) of the task's images and the replay memory,
    row i of both for the same image (the models in eval mode, evaluation transforms)."""
    was_training = ctx.model.training
    ctx.model.eval()
    old_rows, new_rows = [], []
    for iterate in (ctx.iterate_task, ctx.iterate_memory):
        if iterate is None:
            continue
        for batch in iterate():
            old_rows.append(F.normalize(ctx.old_model(batch.images).features.float(), dim=1))
            new_rows.append(F.normalize(ctx.model(batch.images).features.float(), dim=1))
    ctx.model.train(was_training)
    if not old_rows:
        raise ValueError("fan: no task or memory images to fit the adapter on (TaskContext.iterate_task is None)")
    return torch.cat(old_rows), torch.cat(new_rows)
