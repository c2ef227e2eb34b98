"""BCT-ER: Backward Compatible Training (Shen et al., CVPR 2020) with replay (objective: pipelines.methods.bct)."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class BCTParams(MethodParams):
    lam: float = Field(1.0, ge=0.0)


PAPER = (
    "BCT (Shen et al., CVPR 2020), its influence loss: CE(new classifier) + lam * CE(old frozen classifier applied to "
    "the new features); for classes of the new training set the old classifier does not have, BCT synthesises the "
    "old classifier's rows from the old model's features of those classes, so the influence term covers every "
    "sample: implemented, lam = 1 as BCT. BCT's text is not in the project's paper set, so it is not quoted: the "
    "formula follows the CL2R paper's account (\"an influence loss that encourages the feature representation towards "
    "one that can be used by the old classifier\") and the first author's re-implementation (openBCT: influence loss "
    "with weight 1, pseudo old classifier generated from class-mean features)",
    "lifelong adaptation as CL2R (TOMM 2023): \"At each task, the model is initialized with the parameters of the "
    "model of the previous task and the data of the previous tasks can be accessed only through the episodic "
    "memory.\"",
    "choice (BCT leaves it open here): a synthesised row is the mean of the old model's unnormalised classifier "
    "inputs (its junction output) over the class's images of the task data and the replay memory, evaluation "
    "transforms, bias 0, computed once per task; after a replacement every fine-tuning class gets one (the loaded "
    "model's head holds only its pre-training classes)",
)

BCT_ER = register_method(MethodCard(
    name="bct-er", Params=BCTParams, classifier="learnable", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.bct:BCTER", paper=PAPER))
