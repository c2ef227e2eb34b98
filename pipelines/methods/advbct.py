"""AdvBCT-ER: adversarial backward-compatible training (Pan et al., CVPR 2023) adapted to replay fine-tuning."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.methods.objective import (
    Batch,
    ClassStatistics,
    Method,
    TaskContext,
    classification_cross_entropy,
    classifier_input,
    learnable_classifier,
    old_class_statistics,
    reverse_gradient,
)
from pipelines.methods.cards import advbct as cards


class ElasticWeights(nn.Module):
    """One learned weight per old class; sigmoid(w_c) scales how far the class's boundary moves (AdvBCT)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_classes).uniform_(-1.0, 1.0))


class AdvBCTER(Method):
    """``CE + lam_boundary * elastic boundary + lam_adv * (E - e + 1) / E * adversarial``, as the authors' code.

    - adversarial: a discriminator (Linear(d, hidden)-BatchNorm-ReLU-Linear(hidden, 2)-LogSoftmax, trained with the
      model) scores the old model's embeddings (label 1) and the new model's (label 0) of the same images, the new
      ones through a gradient reversal scaled by ``2 / (1 + exp(-10 p)) - 1`` at training progress ``p``; the loss is
      the sum of the two mean NLLs, and the new model learns to make its embeddings indistinguishable.
    - elastic boundary: a new embedding of an old class (one with more than one old feature) should lie within
      ``r_y`` of the old unit class centre (Euclidean, unit features): ``r_y = r_max + s_y`` if ``r_max < threshold``
      else ``r_max - s_y``, ``s_y = sigmoid(w_y) |r_max - threshold|`` with a learned ``w_y`` per class, ``r_max``
      the class's largest old distance; the hinge is averaged over the violating samples only.
    Centres and radii come from the old model over the replay memory (computed once per task). Embeddings are the
    junction outputs (the learnable classifier's input). Without a previous model the loss is the CE alone.
    """

    card = cards.ADVBCT_ER

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.stats: ClassStatistics | None = None
        self.discriminator: nn.Module | None = None
        self.elastic: ElasticWeights | None = None

    def setup(self, ctx: TaskContext) -> list[nn.Module]:
        self.stats, self.discriminator, self.elastic = None, None, None
        if ctx.old_model is None:
            return []
        old_head = learnable_classifier(ctx.old_model, "old model of advbct-er")
        self.stats = old_class_statistics(ctx, old_head.out_features)
        hidden = self.hparams.discriminator_hidden
        self.discriminator = nn.Sequential(
            nn.Linear(old_head.in_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, 2), nn.LogSoftmax(dim=1),
        ).to(ctx.device)
        self.elastic = ElasticWeights(old_head.out_features).to(ctx.device)
        return [self.discriminator, self.elastic]

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        ce = classification_cross_entropy(output.logits, batch.targets)
        if ctx.old_model is None or self.discriminator is None:
            return ce, {"ce": ce.detach()}
        hp = self.hparams
        epoch, progress = ctx.progress()
        alpha = 2.0 / (1.0 + math.exp(-10.0 * progress)) - 1.0
        with torch.no_grad():
            old_embedding = classifier_input(ctx.old_model(batch.images)).float()
        new_embedding = classifier_input(output).float()
        size = new_embedding.shape[0]
        new_scores = self.discriminator(reverse_gradient(new_embedding, alpha))
        old_scores = self.discriminator(old_embedding)
        adversarial = (F.nll_loss(new_scores, torch.zeros(size, dtype=torch.long, device=new_scores.device))
                       + F.nll_loss(old_scores, torch.ones(size, dtype=torch.long, device=old_scores.device)))
        decay = (ctx.epochs - epoch + 1) / ctx.epochs if ctx.epochs > 0 else 1.0
        boundary = self.elastic_boundary(output.features, batch.targets)
        total = ce + hp.lam_boundary * boundary + hp.lam_adv * decay * adversarial
        return total, {"ce": ce.detach(), "adversarial": adversarial.detach(), "boundary": boundary.detach()}

    def elastic_boundary(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean over violating samples of ``max(||unit(f_i) - c_y|| - r_y, 0)`` (0 when none violates)."""
        stats = self.stats
        zero = features.new_zeros((), dtype=torch.float32)
        if stats is None or stats.farthest is None or stats.count is None:
            return zero
        num_old = stats.centres.shape[0]
        valid = targets < num_old
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        valid = valid & (stats.count[safe] > 1)
        r_max = torch.sqrt(2.0 * stats.farthest.clamp_min(0.0))  # Euclidean distance of unit vectors: sqrt(2 - 2 cos)
        shift = torch.sigmoid(self.elastic.weight) * (r_max - self.hparams.threshold).abs()
        radius = torch.where(r_max < self.hparams.threshold, r_max + shift, r_max - shift)
        distance = (F.normalize(features.float(), dim=1) - stats.centres[safe]).norm(dim=1)
        hinge = F.relu(distance - radius[safe]) * valid.float()
        violating = (hinge > 0).float()
        return hinge.sum() / violating.sum().clamp_min(1.0)
