"""CVS: continual learning for visual search with backward-consistent embeddings (Wan et al., CVPR 2022)
(objective: pipelines.methods.cvs)."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class CVSParams(MethodParams):
    lam_neighbour: float = Field(1.0, ge=0.0)
    lam_relation: float = Field(1.0, ge=0.0)
    tau: float = Field(0.1, gt=0.0)


PAPER = (
    "NOT CVS as its paper defines it (Wan et al., CVPR 2022, whose text is not in the project's paper set): CVS "
    "combines inter-session data coherence (replayed embeddings as attractors), neighbour-session model coherence "
    "(a 2-sample-3-embedding triplet distillation) and intra-session discrimination with L2-normalised embeddings; "
    "here two distillations between consecutive models (MSE of unit features, relation KL among replayed samples) "
    "and an unnormalised learnable classifier",
    "the 2026 paper's account: \"In CVS [7], a composition of distillation functions was applied to the network "
    "output to align the updated model with the old model while being coherent with all previous "
    "representations.\"",
    "weights are this project's choices: lam_neighbour 1, lam_relation 1, tau 0.1",
)

CVS = register_method(MethodCard(
    name="cvs", Params=CVSParams, classifier="learnable", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.cvs:CVS", paper=PAPER))
