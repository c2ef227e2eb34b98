"""ER: experience-replay fine-tuning with a learnable, growing classifier (the baseline of every table)."""
from __future__ import annotations

import torch

from pipelines.methods.objective import Batch, Method, TaskContext, classification_cross_entropy
from pipelines.methods.cards import er as cards


class ER(Method):
    """Cross-entropy over the active outputs of a learnable classifier, on task data + replay memory.

    Choices: the classifier grows by one output per new class (the loop expands it before the task); batches are
    half memory, half task data (the public reference's sampler) when a memory exists. No compatibility term.
    """

    card = cards.ER  # no hyper-parameters

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        ce = classification_cross_entropy(output.logits, batch.targets)
        return ce, {"ce": ce.detach()}
