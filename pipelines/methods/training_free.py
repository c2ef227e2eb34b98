"""PSP / LSP ("The Probability Simplex is Compatible"): compatible features of independently trained models.

Nothing compatibility-specific happens during training: every step trains a model independently (from scratch, on
all data seen so far, plain cross-entropy with a learnable classifier whose outputs keep the class order, older
classes first). Compatibility comes at extraction time from the classifier outputs: ``extract_features`` maps a
newer model's logits into an older model's class space (PSP: centred softmax, LSP: normalised logits).
"""
from __future__ import annotations

import torch

from compat_core.evaluation.psp_lsp import lsp, psp_from_logits
from pipelines.methods.objective import Batch, Method, TaskContext, classification_cross_entropy
from pipelines.methods.cards import training_free as cards


class _TrainingFree(Method):
    """Shared by PSP and LSP: plain cross-entropy (logits / temperature) of an independently initialised model; every
    step draws its own initial weights (the paper trains independent models, card trait independent_init)."""

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        ce = classification_cross_entropy(output.logits / self.hparams.temperature, batch.targets)
        return ce, {"ce": ce.detach()}

    def _top_k(self, top_k: int | None) -> int | None:
        value = self.hparams.top_k if top_k is None else top_k
        return None if not value else int(value)


class PSP(_TrainingFree):
    """Probability Simplex Projection features ``P_{t,k} softmax(z) / ||.||`` of independently trained models.

    Choices: the models are trained from scratch with a fresh initialisation chosen by the stage (independent
    training, as in the paper); top_k 0 means no sparsification (the paper's App. K uses 128).
    """

    card = cards.PSP

    def extract_features(self, model_output, num_classes_old: int | None = None, top_k: int | None = None) -> torch.Tensor:
        """(N, C_t) logits (or a ModelOutput) of the newer model -> (N, C_k) PSP unit features in the older space.

        num_classes_old: C_k, the class count of the gallery model (None: the model's own space). top_k: None uses
        the method's hyper-parameter (0 = off).
        """
        # the softmax the model was trained with: logits divided by the training temperature
        return psp_from_logits(_logits(model_output) / self.hparams.temperature, num_classes_old, self._top_k(top_k))


class LSP(_TrainingFree):
    """Logit Simplex Projection features ``z / ||z||`` (first C_k logits) of independently trained models.

    Choices as for PSP; no centring (the paper's Eq. 6; compat_core.evaluation.psp_lsp.lsp can centre).
    """

    card = cards.LSP

    def extract_features(self, model_output, num_classes_old: int | None = None, top_k: int | None = None) -> torch.Tensor:
        """(N, C_t) logits (or a ModelOutput) -> (N, C_k) LSP unit features; arguments as ``PSP.extract_features``."""
        return lsp(_logits(model_output), num_classes_old, self._top_k(top_k))


def _logits(model_output) -> torch.Tensor:
    logits = getattr(model_output, "logits", model_output)
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"model_output must be a ModelOutput or a logits tensor (N, C), got {type(model_output).__name__}")
    return logits
