"""LCE-ER: Learning Compatible Embeddings (Meng et al., ICCV 2021) adapted to replay fine-tuning."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pipelines.methods.objective import (
    Batch,
    ClassStatistics,
    Method,
    TaskContext,
    boundary_hinge,
    classification_cross_entropy,
    learnable_classifier,
    old_class_statistics,
)
from pipelines.methods.cards import lce as cards


class LCEER(Method):
    """``CE + lam_align * L_align + lam_boundary * L_boundary`` (LCE's alignment + compatible-boundary terms).

    - L_align: the new classifier's L2-normalised prototypes of old classes against the old model's class centres,
      ``mean over classes and dimensions of (W_new[c] / ||W_new[c]|| - centre_old[c])^2`` (= mean_c (2 - 2 cos) / d),
      with the identity mapping (both live in the same junction space and the new model starts from the old one).
    - L_boundary: a new feature of an old class must fall inside that class's old boundary,
      ``relu(min_j cos(old_j, c_y) - cos(new_i, c_y))``: the farthest old member of the class sets the boundary.
    Centres and boundaries are computed once per task with the frozen old model over the replay memory (the only old
    data available). Defaults lam_align 100, lam_boundary 1 (the authors' released code). Without a previous model
    or memory the loss is the CE alone.
    """

    card = cards.LCE_ER

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.stats: ClassStatistics | None = None

    def setup(self, ctx: TaskContext) -> list[torch.nn.Module]:
        self.stats = None
        if ctx.old_model is not None:
            old_head = learnable_classifier(ctx.old_model, "old model of lce-er")
            self.stats = old_class_statistics(ctx, old_head.out_features)
        return []

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        ce = classification_cross_entropy(output.logits, batch.targets)
        if self.stats is None:
            return ce, {"ce": ce.detach()}
        stats = self.stats
        head = learnable_classifier(ctx.model, "model of lce-er")
        num_old = stats.centres.shape[0]
        prototypes = F.normalize(head.weight[:num_old].float(), dim=1)
        present = stats.present.float()
        squared = ((prototypes - stats.centres) ** 2).sum(dim=1)
        align = (squared * present).sum() / (present.sum().clamp_min(1.0) * prototypes.shape[1])
        boundary = boundary_hinge(output.features, batch.targets, stats, radius=stats.farthest)
        hp = self.hparams
        total = ce + hp.lam_align * align + hp.lam_boundary * boundary
        return total, {"ce": ce.detach(), "align": align.detach(), "boundary": boundary.detach()}
