"""AdvBCT-ER: adversarial backward-compatible training (Pan et al., CVPR 2023) with replay
(objective: pipelines.methods.advbct)."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class AdvBCTParams(MethodParams):
    lam_influence: float = Field(1.0, ge=0.0)
    lam_adv: float = Field(0.1, ge=0.0)
    lam_boundary: float = Field(1.0, ge=0.0)
    elasticity: float = Field(0.1, ge=0.0)
    discriminator_hidden: int = Field(256, ge=1)


PAPER = (
    "NOT AdvBCT as its paper defines it (Pan et al., CVPR 2023, whose text is not in the project's paper set): an "
    "approximation of its two ideas, an adversarial alignment of new and old feature distributions (gradient "
    "reversal) and an elastic boundary around each old class, on top of the BCT influence term",
    "its weights are this project's choices, not the paper's: lam_influence 1, lam_adv 0.1 (constant), "
    "lam_boundary 1, elasticity 0.1 (a fixed enlargement of the mean cosine radius), discriminator d -> 256 -> 1, "
    "gradient-reversal scale 1",
    "known differences from the authors' released code (Ashespt/AdvBCT trainer/trainer.py, compatible loss "
    "'bct_limit' with ELASTIC_BOUNDARY, configs/new_AdvBct.yml): there the total is CE + boundary + adversarial x "
    "(E - e + 1) / E (epoch e of E, 0-based), no BCT influence term; the gradient reversal follows the DANN schedule "
    "2 / (1 + exp(-10 p)) - 1 over training progress p; the boundary is the Euclidean distance of the unit new "
    "feature to the old class centre beyond the class's largest old distance, moved by a learned elastic term "
    "towards the threshold 1.0, averaged over the violating samples only",
)

ADVBCT_ER = register_method(MethodCard(
    name="advbct-er", Params=AdvBCTParams, classifier="learnable", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.advbct:AdvBCTER", paper=PAPER))
