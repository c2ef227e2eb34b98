"""LCE-ER: Learning Compatible Embeddings (Meng et al., ICCV 2021) with replay (objective: pipelines.methods.lce)."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class LCEParams(MethodParams):
    lam_align: float = Field(100.0, ge=0.0, description="weight of the alignment loss (official LCE code: 100)")
    lam_boundary: float = Field(1.0, ge=0.0, description="weight of the boundary loss (official LCE code: 1)")


PAPER = (
    "LCE (Meng et al., ICCV 2021): CE + lam_align * L_align + lam_boundary * L_boundary. L_align: the mean squared "
    "difference between the new classifier's L2-normalised prototypes of the old classes and the old model's class "
    "centres (the identity mapping; the 2026 paper: \"The authors of LCE [15] achieved compatibility by aligning the "
    "class prototypes across models by learning transformations or through a direct comparison using an identity "
    "mapping.\"); L_boundary: a new feature of an old class is pulled inside that class's old boundary, the cosine "
    "of the class's farthest old feature to its centre, hinge on the cosine. LCE's text is not in the project's "
    "paper set: the terms and weights (lam_align 100, lam_boundary 1) follow the authors' released core modules "
    "(IrvingMeng/LCE main.py --lambda_a 100 --lambda_b 1; centres = renormalised means of L2-normalised old features)",
    "choice (the lifelong setting LCE does not have): centres and boundaries from the old model over the replay "
    "memory only (the old data this scenario keeps), computed once per task with evaluation transforms; classes "
    "without memory samples take no part; the boundary hinge averages over the batch's old-class samples",
)

LCE_ER = register_method(MethodCard(
    name="lce-er", Params=LCEParams, classifier="learnable", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.lce:LCEER", paper=PAPER))
