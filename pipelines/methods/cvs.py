"""CVS: continual learning for visual search with backward-consistent embeddings (Wan et al., CVPR 2022)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipelines.methods.objective import (
    Batch,
    Method,
    TaskContext,
    classifier_input,
    learnable_classifier,
    old_class_statistics,
    old_features,
)
from pipelines.methods.cards import cvs as cards


@dataclass
class Attractors:
    """Per old class: the mean of the old model's unit embeddings over the replay memory (not renormalised).

    means: (C_old, d); present: (C_old,) bool, False for classes without a memory sample.
    """

    means: torch.Tensor
    present: torch.Tensor


class CVS(Method):
    """``L_c + lam_model * L_m + lam_data * L_d``, as the authors' released code computes them.

    - L_c (intra-session discrimination): cross-entropy of the normalised softmax, logits
      ``cos(f_i, w_c) / temperature`` over the learnable head's (bias-free) rows; in every task, the first included.
    - L_m (neighbour-session model coherence): triplet margin loss with anchor the new unit embedding of image i,
      positive the old unit embedding of image i, negative the old unit embedding of the batch image with another
      label nearest (Euclidean) to the anchor.
    - L_d (inter-session data coherence): squared Euclidean distance of the new unit embedding of an old-class
      sample to its class attractor (the mean of old unit embeddings over the memory), averaged over those samples.
    Without a previous model the loss is L_c alone.
    """

    card = cards.CVS

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.attractors: Attractors | None = None

    def setup(self, ctx: TaskContext) -> list[torch.nn.Module]:
        self.attractors = None
        if ctx.old_model is not None:
            old_head = learnable_classifier(ctx.old_model, "old model of cvs")
            self.attractors = memory_attractors(ctx, old_head.out_features)
        return []

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hp = self.hparams
        output = ctx.model(batch.images)
        head = learnable_classifier(ctx.model, "model of cvs")
        embedding = classifier_input(output)
        discrimination = normalised_softmax_cross_entropy(embedding, head.weight, batch.targets, hp.temperature)
        if ctx.old_model is None:
            return discrimination, {"ce": discrimination.detach()}
        new_unit = F.normalize(embedding.float(), dim=1)
        old_unit = old_features(ctx, batch.images).float()
        model_term = model_coherence(new_unit, old_unit, batch.targets, hp.margin)
        data_term = data_coherence(new_unit, batch.targets, self.attractors)
        total = discrimination + hp.lam_model * model_term + hp.lam_data * data_term
        return total, {"ce": discrimination.detach(), "model": model_term.detach(), "data": data_term.detach()}


def normalised_softmax_cross_entropy(
    embedding: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
) -> torch.Tensor:
    """Mean CE (nats) of logits ``unit(embedding) @ unit(weight).T / temperature``; embedding (B, d), weight (C, d)."""
    if bool((targets >= weight.shape[0]).any()) or bool((targets < 0).any()):
        raise ValueError(f"targets must be classifier rows in [0, {weight.shape[0]}), got range "
                         f"[{int(targets.min())}, {int(targets.max())}]; expand the classifier to the task's classes")
    cosines = F.normalize(embedding.float(), dim=1) @ F.normalize(weight.float(), dim=1).T
    return F.cross_entropy(cosines / temperature, targets.long())


def model_coherence(
    new_unit: torch.Tensor, old_unit: torch.Tensor, targets: torch.Tensor, margin: float,
) -> torch.Tensor:
    """Mean triplet margin loss (new_i, old_i, old_j*), j* = the other-label image whose old unit embedding is
    nearest (Euclidean) to new_i. A batch of a single label has no negative: 0."""
    same_label = targets[:, None] == targets[None, :]
    if bool(same_label.all()):
        return new_unit.sum() * 0.0
    distances = torch.cdist(new_unit.detach(), old_unit).masked_fill(same_label, float("inf"))
    hardest = distances.argmin(dim=1)
    return F.triplet_margin_loss(new_unit, old_unit, old_unit[hardest], margin=margin)


def data_coherence(new_unit: torch.Tensor, targets: torch.Tensor, attractors: Attractors | None) -> torch.Tensor:
    """Mean over batch samples of old classes with an attractor of ``||new_i - a_{y_i}||^2`` (0 when none)."""
    if attractors is None:
        return new_unit.sum() * 0.0
    num_old = attractors.means.shape[0]
    valid = targets < num_old
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    valid = valid & attractors.present[safe]
    if not bool(valid.any()):
        return new_unit.sum() * 0.0
    return (new_unit[valid] - attractors.means[safe[valid]]).pow(2).sum(dim=1).mean()


def memory_attractors(ctx: TaskContext, num_classes: int) -> Attractors | None:
    """Per old class, the mean of the frozen old model's unit embeddings over the replay memory (None without one).

    From the shared class statistics: the mean m of unit vectors has the direction of the centre c and the length
    ``m . c = 1 - mean(1 - f . c)``, i.e. ``m = c * (1 - radius)``.
    """
    stats = old_class_statistics(ctx, num_classes)
    if stats is None:
        return None
    return Attractors(means=stats.centres * (1.0 - stats.radius)[:, None], present=stats.present)
