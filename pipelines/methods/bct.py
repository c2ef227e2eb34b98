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
    """``CE(new classifier) + lam * CE(old classifier, extended to the new classes, applied to new features)``.

    The influence term (BCT's influence loss) uses the old model's learnable classifier as a fixed head on the new
    model's classifier input (the junction output the old head was trained on). Classes the old classifier does not
    have (the task's new classes; after a replacement, every fine-tuning class) get synthesised rows, as BCT does
    for new classes: the mean of the old model's classifier inputs over that class's images of this task (task data
    and replay memory, evaluation transforms), computed once in ``setup``, bias 0. So the influence loss covers every
    sample of the batch. lam = 1 as in BCT. Choices: fine-tuned from the previous model (not retrained), batches
    half memory / half task data; without a previous model the loss is the CE alone.
    """

    card = cards.BCT_ER

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.old_head: tuple[torch.Tensor, torch.Tensor] | None = None

    def setup(self, ctx: TaskContext) -> list[torch.nn.Module]:
        self.old_head = None if ctx.old_model is None else synthesised_old_classifier(ctx)
        return []

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        ce = classification_cross_entropy(output.logits, batch.targets)
        if ctx.old_model is None:
            return ce, {"ce": ce.detach()}
        if self.old_head is None:
            raise ValueError("bct-er: setup(ctx) builds the extended old classifier before the first loss")
        weight, bias = self.old_head
        influence = bct_influence_loss(classifier_input(output), batch.targets, weight, bias)
        total = ce + self.hparams.lam * influence
        return total, {"ce": ce.detach(), "influence": influence.detach()}


@torch.no_grad()
def synthesised_old_classifier(ctx: TaskContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The old model's classifier extended to every class of this task's data (weight (C, d), bias (C,), fp32).

    Rows 0..C_old-1 are the old head's (bias 0 when it has none); row c >= C_old is the mean of the old model's
    classifier inputs (unnormalised junction outputs) over the images of class c in the task data and the replay
    memory. A class between C_old and the largest target with no image in either gets bias -inf (it takes no
    probability mass; no batch of this task can hold it)."""
    head = learnable_classifier(ctx.old_model, "old model of bct-er")
    weight = head.weight.detach().double()
    num_old, dim = weight.shape
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    for iterate in (ctx.iterate_task, ctx.iterate_memory):
        if iterate is None:
            continue
        for batch in iterate():
            inputs = classifier_input(ctx.old_model(batch.images)).double()
            for target in torch.unique(batch.targets[batch.targets >= num_old]).tolist():
                rows = inputs[batch.targets == target]
                sums[target] = sums.get(target, torch.zeros(dim, dtype=torch.float64, device=weight.device)) + rows.sum(0)
                counts[target] = counts.get(target, 0) + int(rows.shape[0])
    total = max([num_old - 1, *sums]) + 1
    extended = torch.zeros(total, dim, dtype=torch.float64, device=weight.device)
    extended[:num_old] = weight
    bias = torch.zeros(total, dtype=torch.float64, device=weight.device)
    if head.bias is not None:
        bias[:num_old] = head.bias.detach().double()
    bias[num_old:] = float("-inf")
    for target, summed in sums.items():
        extended[target] = summed / counts[target]
        bias[target] = 0.0
    return extended.float(), bias.float()
