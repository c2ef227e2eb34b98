"""d-Simplex methods: fixed d-Simplex classifier + HOC (IAM-CL2R) or + feature distillation on memory (CL2R)."""
from __future__ import annotations

import torch

from compat_core.losses import (
    compatibility_info_nce,
    feature_distillation_loss,
    feature_distillation_weight,
    simplex_cross_entropy,
)
from pipelines.methods.objective import Batch, Method, TaskContext, old_features
from pipelines.methods.cards import dsimplex as cards


class DSimplexHOC(Method):
    """d-Simplex-HOC (2026 paper Eq. 2-5): ``lam * SCE(all K slots) + (1 - lam) * InfoNCE(new, old)``.

    Defaults from SPEC: lam 0.1, rho 10 (IAM-CL2R / CelebA; use 5 for CL2R CIFAR), masking "standard" (positive kept
    in the denominator, same-class negatives dropped; "reference" multiplies them by zero as the public code does;
    "paper" is Eq. 4 as printed: positive out of the denominator, every other sample in, same class included).
    Choices: the InfoNCE runs over the whole batch (task and memory samples); features are the model's
    L2-normalised junction output; without a previous model (first task) the loss is the SCE alone (weight 1, not
    lam). At a replacement the old model is the newly loaded one (the stage passes it), as in the reference, or the
    model it replaces with ``replacements[].anchor: replaced`` (InfoNCE then pulls the new model onto the features the
    index holds: what the upgrade gate M(new, old) > M(old, old) asks for); so is
    the loaded ``initial_model`` at the first task (the public IAM-CL2R code's behaviour: it counts task 1 among the
    replacement tasks, so the first task's old model is the pre-trained one; the papers do not say). The
    total equals ``compat_core.losses.hoc_loss`` on the same tensors; its two terms are computed once each so they
    can be logged.
    """

    card = cards.DSIMPLEX_HOC

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        if ctx.old_model is None:
            sce = simplex_cross_entropy(output.logits, batch.targets)
            return sce, {"sce": sce.detach()}
        previous_features = old_features(ctx, batch.images)
        hp = self.hparams
        sce = simplex_cross_entropy(output.logits, batch.targets)
        info_nce = compatibility_info_nce(output.features, previous_features, batch.targets, rho=hp.rho, masking=hp.masking)
        total = hp.lam * sce + (1.0 - hp.lam) * info_nce
        return total, {"sce": sce.detach(), "info_nce": info_nce.detach()}


class DSimplexFD(Method):
    """d-Simplex-FD (CL2R Eq. 7-9): ``SCE(all K slots) + w * FD``, FD = mean(1 - cos(new, old)) on memory samples.

    ``w = w_base * sqrt(new classes / old classes)`` (CL2R Sec. 7), w_base 5 (CIFAR, SPEC default) or 10. Choices:
    "old classes" are the classes seen before this task (those in the replay memory); with no previous model or no
    old class (first task) the loss is the SCE alone.
    """

    card = cards.DSIMPLEX_FD

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        sce = simplex_cross_entropy(output.logits, batch.targets)
        if ctx.old_model is None or ctx.num_old_classes <= 0:
            return sce, {"sce": sce.detach()}
        previous_features = old_features(ctx, batch.images)
        distillation = feature_distillation_loss(output.features, previous_features, batch.is_memory)
        weight = feature_distillation_weight(ctx.num_new_classes, ctx.num_old_classes, self.hparams.w_base)
        total = sce + weight * distillation
        return total, {"sce": sce.detach(), "fd": distillation.detach(), "fd_weight": weight}
