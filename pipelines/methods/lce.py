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

    - L_align: the new classifier's prototypes of old classes are aligned with the old model's class centres,
      ``mean_c (1 - cos(W_new[c], centre_old[c]))``. LCE learns a transformation between the two spaces; here both
      live in the same (K-1)-dim junction space and the new model starts from the old one, so the identity
      mapping is used (the variant the 2026 paper mentions: "direct comparison using an identity mapping").
    - L_boundary: a new feature of an old class must fall inside that class's old boundary,
      ``relu((1 - cos(new_i, centre_{y_i})) - r_{y_i})`` with ``r`` the old features' mean cosine distance to their
      centre.
    Centres and radii are computed once per task with the frozen old model over the replay memory (the only old
    data available). Defaults lam_align 1, lam_boundary 1 (LCE uses unit weights). Without a previous model or
    memory the loss is the CE alone.
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
        align = ((1.0 - (prototypes * stats.centres).sum(dim=1)) * present).sum() / present.sum().clamp_min(1.0)
        boundary = boundary_hinge(output.features, batch.targets, stats)
        hp = self.hparams
        total = ce + hp.lam_align * align + hp.lam_boundary * boundary
        return total, {"ce": ce.detach(), "align": align.detach(), "boundary": boundary.detach()}
