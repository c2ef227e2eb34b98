"""PSP / LSP ("The Probability Simplex is Compatible"): independently trained models made compatible at extraction
from their classifier outputs (objectives: pipelines.methods.training_free)."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class ProjectionParams(MethodParams):
    top_k: int = Field(0, ge=0, description="0: no sparsification")
    # The paper (App. G) scales logits by "a temperature factor of 12" in the training cross-entropy without
    # saying which way; we use the usual temperature convention, CE(z / T). 1 = plain cross-entropy.
    temperature: float = Field(1.0, gt=0.0)


_TRAITS = dict(Params=ProjectionParams, classifier="learnable", retrain_from_scratch=True, independent_init=True,
               training_free=True)
PSP = register_method(MethodCard(name="psp", objective="pipelines.methods.training_free:PSP", **_TRAITS))
LSP = register_method(MethodCard(name="lsp", objective="pipelines.methods.training_free:LSP", **_TRAITS))
