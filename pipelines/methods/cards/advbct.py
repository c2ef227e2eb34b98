"""AdvBCT-ER: adversarial backward-compatible training (Pan et al., CVPR 2023) with replay
(objective: pipelines.methods.advbct)."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class AdvBCTParams(MethodParams):
    lam_boundary: float = Field(1.0, ge=0.0, description="weight of the elastic boundary loss (authors' code: 1)")
    lam_adv: float = Field(1.0, ge=0.0, description="weight of the adversarial loss before its epoch decay "
                           "(E - e + 1) / E (authors' code: 1)")
    threshold: float = Field(1.0, gt=0.0, description="the radius the elastic boundary moves towards (authors' "
                             "code: TRAIN.THRESHOLD 1.0)")
    discriminator_hidden: int = Field(100, ge=1, description="hidden width of the discriminator (authors' code: 100)")


PAPER = (
    "AdvBCT (Pan et al., CVPR 2023) as the authors' released code defines it (Ashespt/AdvBCT: trainer/trainer.py, "
    "models/base_model.py, models/modules.py, configs/new_AdvBct.yml; the paper's text is not in the project's "
    "paper set, so its sentences are not quoted): CE + lam_boundary x elastic boundary + lam_adv x (E - e + 1) / E x "
    "adversarial, at epoch e (0-based) of E, without a BCT influence term",
    "adversarial: a discriminator Linear(d, 100)-BatchNorm-ReLU-Linear(100, 2)-LogSoftmax tells the old model's "
    "embeddings (label 1) from the new model's (label 0, through a gradient reversal scaled by 2 / (1 + exp(-10 p)) "
    "- 1 at training progress p), NLL of each, summed",
    "elastic boundary: for a sample of an old class with more than one old feature, max(||unit(new) - c_y|| - r_y, "
    "0) with c_y the old unit class centre and r_y = r_max +- sigmoid(w_y) |r_max - threshold| (+ when r_max < "
    "threshold), r_max the largest Euclidean distance of the class's unit old features to c_y and w_y a learned "
    "weight per class (initialised uniform in [-1, 1]); averaged over the violating samples only",
    "choices (the lifelong setting the paper does not have): class centres and radii from the old model over the "
    "replay memory, computed once per task with evaluation transforms; softmax cross-entropy on the learnable "
    "classifier (the authors' landmark runs use ArcFace); embeddings are the junction outputs (the authors' are the "
    "BatchNorm-ed projection)",
)

ADVBCT_ER = register_method(MethodCard(
    name="advbct-er", Params=AdvBCTParams, classifier="learnable", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.advbct:AdvBCTER", paper=PAPER))
