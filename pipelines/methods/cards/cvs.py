"""CVS: continual learning for visual search with backward-consistent embeddings (Wan et al., CVPR 2022)
(objective: pipelines.methods.cvs)."""
from __future__ import annotations

from pydantic import Field

from pipelines.methods.card import MethodCard, MethodParams, register_method


class CVSParams(MethodParams):
    lam_model: float = Field(10.0, ge=0.0, description="weight of the neighbour-session model coherence (authors' "
                             "scripts/cifar.sh: --alpha 10.0)")
    lam_data: float = Field(1.0, ge=0.0, description="weight of the inter-session data coherence (authors' "
                            "train.py: --beta default 1.0)")
    margin: float = Field(0.1, ge=0.0, description="triplet margin of the model coherence (authors' code: 0.1)")
    temperature: float = Field(0.05, gt=0.0, description="temperature of the normalised softmax (authors' code: "
                               "0.05)")


_CODE = "ivclab/CVS@51aee4238675cc43f243844091d1b3f696ae7f14"

PAPER = (
    f"CVS (Wan et al., CVPR 2022) as the authors' released code defines it ({_CODE}: train.py, "
    "models/normlayer.py, utils/train_utils.py, scripts/cifar.sh; the paper's text is not in the project's paper "
    "set, so its sentences are not quoted): L_c + lam_model x L_m + lam_data x L_d with lam_model 10 "
    "(scripts/cifar.sh:20 --alpha 10.0, the authors' CVS run) and lam_data 1 (train.py:54 --beta default), "
    "train.py:305-307",
    "intra-session discrimination L_c: cross-entropy of the normalised softmax, logits cos(f_i, w_c) / 0.05 with "
    "f_i the embedding and w_c the bias-free class weight, both L2-normalised (train.py:80-81, 243-244; "
    "models/normlayer.py:19-23); in every session, the first included; old classes keep their weight rows "
    "(train.py:184-189; here the growing learnable head, whose rows serve as w_c)",
    "neighbour-session model coherence L_m (two samples, three embeddings): triplet margin loss, Euclidean, margin "
    "0.1, anchor the new model's unit embedding of image i, positive the old model's unit embedding of the same "
    "image, negative the old model's unit embedding of the batch image j with another label nearest to the anchor "
    "(hardest negative by Euclidean distance), mean over the batch (train.py:204, 252-268)",
    "inter-session data coherence L_d: for each batch sample of an old class, the squared Euclidean distance "
    "between its new unit embedding and its class's attractor, the mean of the class's unit gallery features "
    "(not renormalised), averaged over those samples (train.py:157-159, 298-302; utils/train_utils.py:105-130)",
    "choice (cross-session memory): the authors' attractors average the stored gallery features, each extracted by "
    "the model of the session that introduced the class and never re-extracted; here the mean of the frozen old "
    "model's unit embeddings over the replay memory (the old data this scenario keeps), computed once per task "
    "with evaluation transforms; old classes without memory samples take no part in L_d",
    "choice (left open by the code): a batch of a single label has no negative and L_m is 0 (the authors' loop "
    "then keeps a negative index left from an earlier batch, train.py:261-266); the embedding is the "
    "classifier's input and retrieval feature (the backbone output under model.head auto, the junction output "
    "under model.head junction; the authors': a Linear(512, 128) embedding layer, models/cifar.py:198, 227-231)",
    "the authors' training recipe is the config's, not the method's (their values, for a reviewer comparing runs): "
    "ResNet-18, embedding 128, batch 16 drawn from the task data with the memory appended (train.py:28, 153-156; "
    "here the config's replay batches), "
    "SGD lr 0.03 momentum 0.9 Nesterov weight decay 1e-4 (utils/train_utils.py:19), one warm-up epoch at lr/10 "
    "then cosine warm restarts T_0 1, T_mult 2 to lr/100 (train.py:221-232, utils/train_utils.py:24), 256 epochs, "
    "herding memory of 2000 (utils/train_utils.py:132-178), the epoch with the best validation recall@1 kept "
    "(train.py:341-343)",
)

CVS = register_method(MethodCard(
    name="cvs", Params=CVSParams, classifier="learnable", uses_replay=True, needs_old_model=True,
    objective="pipelines.methods.cvs:CVS", paper=PAPER))
