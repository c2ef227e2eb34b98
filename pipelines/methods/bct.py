"""BCT-ER: Backward Compatible Training (Shen et al., CVPR 2020) adapted to replay fine-tuning (CL2R's l-BCT)."""
from __future__ import annotations

import torch

from compat_core.losses import bct_influence_loss
from pipelines.methods.objective import (
    Batch,
    Method,
    TaskContext,
    classification_cross_entropy,
    classifier_input,
    learnable_classifier,
)
from pipelines.methods.cards import bct as cards


class BCTER(Method):
    """``CE(new classifier) + lam * CE(old frozen classifier applied to new features)`` on old-class samples.

    The influence term (BCT Eq. 3) uses the old model's learnable classifier as a fixed head on the new model's
    junction output (the input the old head was trained on); only samples whose class the old head can score count
    (in practice the replay samples). lam = 1 as in BCT. Choices: fine-tuned from the previous model (not
    retrained), batches half memory / half task data; without a previous model the loss is the CE alone.
    """

    card = cards.BCT_ER

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        ce = classification_cross_entropy(output.logits, batch.targets)
        if ctx.old_model is None:
            return ce, {"ce": ce.detach()}
        old_head = learnable_classifier(ctx.old_model, "old model of bct-er")
        influence = bct_influence_loss(classifier_input(output), batch.targets, old_head.weight, old_head.bias)
        total = ce + self.hparams.lam * influence
        return total, {"ce": ce.detach(), "influence": influence.detach()}
