"""CoReS (Biondi et al., TPAMI 2023): retrain from the same initial weights at every step, d-Simplex SCE."""
from __future__ import annotations

import torch

from compat_core.losses import simplex_cross_entropy
from pipelines.methods.objective import Batch, Method, TaskContext
from pipelines.methods.cards import cores as cards


class CoReS(Method):
    """d-Simplex cross-entropy over all K slots, model re-initialised to the same weights before every task.

    The training loop loads ``TaskData.initial_state`` (required: the weights drawn once, with one seed, for the
    whole sequence; CoReS Sec. 7.3 / 8.3) into the model before training, and the stage gives it every sample seen
    so far as task data (no replay memory: CoReS has access to the whole data at each upgrade). Compatibility
    comes from the fixed classifier alone; the old model is used only by ``model_selection: compatibility``
    (Sec. 8.2), which the loop implements.
    """

    card = cards.CORES  # no hyper-parameters

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        sce = simplex_cross_entropy(output.logits, batch.targets)
        return sce, {"sce": sce.detach()}
