"""AdvBCT-ER: adversarial backward-compatible training (Pan et al., CVPR 2023) adapted to replay fine-tuning."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compat_core.losses import bct_influence_loss
from pipelines.methods.objective import (
    Batch,
    ClassStatistics,
    Method,
    TaskContext,
    boundary_hinge,
    classification_cross_entropy,
    classifier_input,
    learnable_classifier,
    old_class_statistics,
    old_features,
    reverse_gradient,
)
from pipelines.methods.cards import advbct as cards


class AdvBCTER(Method):
    """``CE + lam_influence * BCT influence + lam_adv * adversarial + lam_boundary * elastic boundary``.

    - adversarial: a discriminator (MLP d -> hidden -> 1, trained jointly) tells old-model features (label 1) from
      new-model features (label 0) of the same images; a gradient-reversal layer makes the new model minimise the
      discriminator's success, aligning the two feature distributions (AdvBCT Sec. 3.2). The discriminator sees
      L2-normalised features.
    - elastic boundary: new features of old classes must fall inside the old class boundary enlarged by
      ``1 + elasticity`` (AdvBCT's boundary may stretch so that the new model keeps room to become more
      discriminative); centres/radii from the old model over the replay memory, as in lce-er.
    - influence: the BCT term AdvBCT builds on (old frozen head on new features, old-class samples).
    Choices (the paper's schedules are not reproduced): unit weights, lam_adv 0.1, elasticity 0.1, discriminator
    hidden width 256, gradient-reversal scale 1. Without a previous model the loss is the CE alone.
    """

    card = cards.ADVBCT_ER

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.stats: ClassStatistics | None = None
        self.discriminator: nn.Module | None = None

    def setup(self, ctx: TaskContext) -> list[nn.Module]:
        self.stats = None
        self.discriminator = None
        if ctx.old_model is None:
            return []
        old_head = learnable_classifier(ctx.old_model, "old model of advbct-er")
        self.stats = old_class_statistics(ctx, old_head.out_features)
        hidden = self.hparams.discriminator_hidden
        self.discriminator = nn.Sequential(
            nn.Linear(old_head.in_features, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, 1)
        ).to(ctx.device)
        return [self.discriminator]

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        ce = classification_cross_entropy(output.logits, batch.targets)
        if ctx.old_model is None or self.discriminator is None:
            return ce, {"ce": ce.detach()}
        hp = self.hparams
        previous_features = old_features(ctx, batch.images)
        old_head = learnable_classifier(ctx.old_model, "old model of advbct-er")
        influence = bct_influence_loss(classifier_input(output), batch.targets, old_head.weight, old_head.bias)
        new_unit = F.normalize(output.features.float(), dim=1)
        old_unit = F.normalize(previous_features.float(), dim=1)
        scores = self.discriminator(torch.cat([old_unit, reverse_gradient(new_unit)], dim=0)).squeeze(1)
        labels = torch.cat([torch.ones(old_unit.shape[0]), torch.zeros(new_unit.shape[0])]).to(scores.device)
        adversarial = F.binary_cross_entropy_with_logits(scores, labels)
        boundary = (
            boundary_hinge(output.features, batch.targets, self.stats, scale=1.0 + hp.elasticity)
            if self.stats is not None
            else torch.zeros((), device=ce.device)
        )
        total = ce + hp.lam_influence * influence + hp.lam_adv * adversarial + hp.lam_boundary * boundary
        parts = {
            "ce": ce.detach(),
            "influence": influence.detach(),
            "adversarial": adversarial.detach(),
            "boundary": boundary.detach(),
        }
        return total, parts
