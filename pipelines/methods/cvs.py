"""CVS: continual learning for visual search with backward-consistent embeddings (Wan et al., CVPR 2022)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pipelines.methods.objective import (
    Batch,
    Method,
    TaskContext,
    classification_cross_entropy,
    old_features,
)
from pipelines.methods.cards import cvs as cards


class CVS(Method):
    """``CE + lam_neighbour * L_model + lam_relation * L_data`` between consecutive models.

    - L_model (CVS "neighbouring-session model coherence"): mean squared distance between the new and the old
      model's L2-normalised features of every batch image.
    - L_data (CVS "inter-session data coherence", on replayed samples): the new model must reproduce the old
      model's similarity structure among the replayed samples, KL(softmax(old_i . old_j / tau) || softmax(new_i .
      new_j / tau)) over the memory samples of the batch (self-pairs excluded).
    Choices: the composition of the paper's terms is reduced to these two distillations (as the 2026 paper
    summarises CVS: distillation between consecutive models on replayed embeddings); lam_neighbour 1,
    lam_relation 1, tau 0.1. Without a previous model the loss is the CE alone.
    """

    card = cards.CVS

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        ce = classification_cross_entropy(output.logits, batch.targets)
        if ctx.old_model is None:
            return ce, {"ce": ce.detach()}
        hp = self.hparams
        previous_features = old_features(ctx, batch.images)
        new_unit = F.normalize(output.features.float(), dim=1)
        old_unit = F.normalize(previous_features.float(), dim=1)
        neighbour = (new_unit - old_unit).pow(2).sum(dim=1).mean()
        relation = relation_distillation(new_unit[batch.is_memory], old_unit[batch.is_memory], hp.tau)
        total = ce + hp.lam_neighbour * neighbour + hp.lam_relation * relation
        return total, {"ce": ce.detach(), "neighbour": neighbour.detach(), "relation": relation.detach()}


def relation_distillation(new_unit: torch.Tensor, old_unit: torch.Tensor, tau: float) -> torch.Tensor:
    """Mean over anchors of KL(p_old || p_new), p = softmax over the other samples of cos / tau; 0 with < 3 rows.

    new_unit, old_unit: (n, d) unit features of the same n samples. Returns nats (a 0-dim tensor on the graph).
    """
    count = new_unit.shape[0]
    if count < 3:
        return new_unit.sum() * 0.0
    self_pairs = torch.eye(count, dtype=torch.bool, device=new_unit.device)
    new_logits = (new_unit @ new_unit.T / tau).masked_fill(self_pairs, float("-inf"))
    old_logits = (old_unit @ old_unit.T / tau).masked_fill(self_pairs, float("-inf"))
    old_log_probs = F.log_softmax(old_logits, dim=1).masked_fill(self_pairs, 0.0)
    new_log_probs = F.log_softmax(new_logits, dim=1).masked_fill(self_pairs, 0.0)
    return (old_log_probs.exp() * (old_log_probs - new_log_probs)).sum(dim=1).mean()
