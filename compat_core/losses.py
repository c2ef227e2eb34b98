"""Training losses for compatible representation learning (SPEC §4).

All losses return a 0-dim tensor averaged over the samples they use (natural-log units, i.e. nats). Old-model
quantities (features, classifier) are treated as constants: they are detached inside, so a caller cannot
accidentally train the frozen model through them. Similarities and log-sum-exps are evaluated in at least fp32
with autocast disabled, because bf16 logsumexp over a batch loses the small differences the contrastive term needs.
"""
from __future__ import annotations

import math
import numbers
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from compat_core.kinds import INFO_NCE_MASKINGS


# ----------------------------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------------------------


def _no_autocast(tensor: torch.Tensor):
    device_type = tensor.device.type
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return nullcontext()


def _at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _check_features(name: str, features: torch.Tensor) -> None:
    if not isinstance(features, torch.Tensor) or features.ndim != 2:
        shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
        raise ValueError(f"{name} must be a 2-D tensor (B, d), got {shape}")
    if features.shape[0] == 0:
        raise ValueError(f"{name} must contain at least one sample, got shape {tuple(features.shape)}")


def _check_pair(new_features: torch.Tensor, old_features: torch.Tensor) -> None:
    _check_features("new_features", new_features)
    _check_features("old_features", old_features)
    if new_features.shape != old_features.shape:
        raise ValueError(
            f"new_features and old_features must have the same shape (B, d), got {tuple(new_features.shape)} "
            f"and {tuple(old_features.shape)}"
        )


def _check_labels(labels: torch.Tensor, batch: int, name: str = "labels") -> None:
    if not isinstance(labels, torch.Tensor) or labels.shape != (batch,):
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"{name} must be a 1-D integer tensor of shape ({batch},), got {shape}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.dtype.is_complex:
        raise ValueError(f"{name} must hold integer class indices, got dtype {labels.dtype}")


def _is_bool_vector(mask, batch: int) -> bool:
    return isinstance(mask, torch.Tensor) and mask.shape == (batch,) and mask.dtype == torch.bool


def _check_rho(rho: float) -> float:
    if not (isinstance(rho, (int, float)) and math.isfinite(rho) and rho > 0):
        raise ValueError(f"rho (cosine-similarity scale) must be a finite number > 0, got {rho!r}")
    return float(rho)


def _check_masking(masking: str) -> str:
    if masking not in INFO_NCE_MASKINGS:
        raise ValueError(f"masking must be one of {INFO_NCE_MASKINGS}, got {masking!r}")
    return masking


# ----------------------------------------------------------------------------------------------------------------
# d-Simplex cross-entropy
# ----------------------------------------------------------------------------------------------------------------


def simplex_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """d-Simplex cross-entropy (2026 paper Eq. 3; CL2R Eq. 7): mean softmax CE over **all K** slots.

    logits: (B, K) scores against every pre-allocated slot, including slots no class uses yet (their share of the
    softmax is what reserves room for future classes). labels: (B,) int slot indices in [0, K). Returns the batch
    mean in nats.
    """
    _check_features("logits", logits)
    _check_labels(labels, logits.shape[0])
    num_slots = logits.shape[1]
    out_of_range = (labels < 0) | (labels >= num_slots)
    if labels.device.type == "cpu":  # host memory: checking costs no device sync
        if out_of_range.numpy().any():
            values = labels.numpy()
            raise ValueError(
                f"labels must be slot indices in [0, {num_slots}) (K = logits.shape[1]), got range "
                f"[{int(values.min())}, {int(values.max())}]"
            )
    else:  # on an accelerator the check runs asynchronously, so a training step never waits for it
        torch._assert_async(~out_of_range.any(), f"labels must be slot indices in [0, {num_slots})")
    with _no_autocast(logits):
        return F.cross_entropy(_at_least_fp32(logits), labels.to(logits.device).long())


# ----------------------------------------------------------------------------------------------------------------
# Higher-order compatibility (InfoNCE between old and new features)
# ----------------------------------------------------------------------------------------------------------------


def compatibility_info_nce(
    new_features: torch.Tensor,
    old_features: torch.Tensor,
    labels: torch.Tensor,
    rho: float = 10.0,
    masking: str = "standard",
) -> torch.Tensor:
    """InfoNCE between the frozen old model's features and the new model's (2026 paper Eq. 4-5), batch mean.

    new_features, old_features: (B, d) features of the same B images from the new and the old model (any scale:
    both are L2-normalised inside; ``old_features`` is detached). labels: (B,) int class labels (only equality
    matters). With ``s_ij = cos(old_i, new_j)`` and ``rho`` the similarity scale (unitless; 5 for CL2R CIFAR,
    10 for IAM-CL2R / CelebA), per anchor ``i``:

    - ``"standard"``: ``-log( e^{rho s_ii} / (e^{rho s_ii} + sum_{j: y_j != y_i} e^{rho s_ij}) )``. The positive
      stays in the denominator and same-class pairs (other than i itself) are dropped, so the loss is >= 0 and
      tends to 0 as the positive dominates.
    - ``"reference"`` (the public IAM-CL2R code): ``-rho s_ii + log sum_j e^{rho s_ij * 1[y_j != y_i]}``. Same-class
      entries, the positive included, are multiplied by zero instead of removed, so each contributes ``e^0 = 1``:
      the denominator holds ``n_same(i)`` ones in place of ``e^{rho s_ii}``. The positive's gradient never
      saturates (always ``-rho`` per unit of ``s_ii``) and the loss can be negative (down to ``-rho + log n``).

    - ``"paper"`` (the 2026 paper's Eq. 4 as printed): ``-rho s_ii + log sum_{j != i} e^{rho s_ij}``. The positive
      is left out of the denominator and every other sample is a negative, same class included (pulling apart two
      images of one class works against the classifier term). The loss can be negative and needs ``B >= 2``
      (with one sample the denominator is empty).

    Eq. 4 prints a sum over the batch; every mode returns the batch mean (a constant factor the learning rate
    absorbs). Returns nats.
    """
    _check_pair(new_features, old_features)
    batch = new_features.shape[0]
    _check_labels(labels, batch)
    rho = _check_rho(rho)
    masking = _check_masking(masking)
    if masking == "paper" and batch < 2:
        raise ValueError(f"masking 'paper' (Eq. 4: denominator over j != i) needs a batch of at least 2 samples, "
                         f"got {batch}")
    with _no_autocast(new_features):
        new_unit = F.normalize(_at_least_fp32(new_features), dim=1)
        old_unit = F.normalize(_at_least_fp32(old_features.detach()), dim=1).to(new_unit.dtype)
        scaled = rho * (old_unit @ new_unit.T)  # scaled[i, j] = rho * cos(old_i, new_j)
        positive = scaled.diagonal()
        labels = labels.to(scaled.device)
        same_class = labels.reshape(-1, 1) == labels.reshape(1, -1)
        if masking == "standard":
            keep = ~same_class
            keep.fill_diagonal_(True)
            denominator_terms = scaled.masked_fill(~keep, float("-inf"))
        elif masking == "paper":
            others = ~torch.eye(batch, dtype=torch.bool, device=scaled.device)
            denominator_terms = scaled.masked_fill(~others, float("-inf"))
        else:
            denominator_terms = scaled.masked_fill(same_class, 0.0)
        return (torch.logsumexp(denominator_terms, dim=1) - positive).mean()


def hoc_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    new_features: torch.Tensor,
    old_features: torch.Tensor,
    lam: float = 0.1,
    rho: float = 10.0,
    masking: str = "standard",
) -> torch.Tensor:
    """d-Simplex-HOC: ``lam * simplex_cross_entropy + (1 - lam) * compatibility_info_nce`` (2026 paper Eq. 2).

    logits: (B, K) d-Simplex logits of the new model; labels: (B,) slot indices in [0, K) (also used as the class
    identity for InfoNCE masking); new_features/old_features: (B, d). ``lam`` in [0, 1] (0.1 in the papers).
    Returns nats.
    """
    if not (isinstance(lam, (int, float)) and 0.0 <= lam <= 1.0):
        raise ValueError(f"lam (weight of the cross-entropy term) must be a number in [0, 1], got {lam!r}")
    _check_features("logits", logits)
    _check_features("new_features", new_features)
    if logits.shape[0] != new_features.shape[0]:
        raise ValueError(
            f"logits and new_features must share the batch size, got {logits.shape[0]} and {new_features.shape[0]}"
        )
    sce = simplex_cross_entropy(logits, labels)
    nce = compatibility_info_nce(new_features, old_features, labels, rho=rho, masking=masking)
    return lam * sce + (1.0 - lam) * nce


# ----------------------------------------------------------------------------------------------------------------
# Feature distillation on replay memory (CL2R)
# ----------------------------------------------------------------------------------------------------------------


def feature_distillation_loss(
    new_features: torch.Tensor, old_features: torch.Tensor, memory_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Memory-only feature distillation (CL2R Eq. 8): mean of ``1 - cos(new_i, old_i)`` over replay samples.

    new_features, old_features: (B, d) features of the same images (``old_features`` detached). memory_mask: (B,)
    bool, True for samples drawn from the replay memory; None means every sample counts. Result in [0, 2]. With no
    memory sample in the batch the loss is exactly 0 yet still connected to the graph (zero gradients), so a
    training step never needs a special case.
    """
    _check_pair(new_features, old_features)
    batch = new_features.shape[0]
    with _no_autocast(new_features):
        new32 = _at_least_fp32(new_features)
        cosine = F.cosine_similarity(new32, _at_least_fp32(old_features.detach()).to(new32.dtype), dim=1, eps=1e-12)
        distance = 1.0 - cosine
        if memory_mask is None:
            return distance.mean()
        if not _is_bool_vector(memory_mask, batch):
            shape = tuple(memory_mask.shape) if isinstance(memory_mask, torch.Tensor) else type(memory_mask).__name__
            dtype = getattr(memory_mask, "dtype", None)
            raise ValueError(f"memory_mask must be a bool tensor of shape ({batch},), got shape {shape} dtype {dtype}")
        weights = memory_mask.to(device=distance.device, dtype=distance.dtype)
        # clamp keeps 0/0 away when no memory sample is present; the numerator is then exactly 0
        return (distance * weights).sum() / weights.sum().clamp_min(1.0)


def feature_distillation_weight(new_classes: int, old_classes: int, w_base: float = 5.0) -> float:
    """CL2R weight of the FD term (Sec. 7, Eq. 9's lambda): ``w_base * sqrt(new_classes / old_classes)``.

    new_classes: classes of the current task (count); old_classes: classes already in the replay memory (count,
    > 0). ``w_base`` is 5 for CIFAR in SPEC, 10 elsewhere.
    """
    for name, value in (("new_classes", new_classes), ("old_classes", old_classes)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an int count of classes, got {value!r}")
    if new_classes < 0:
        raise ValueError(f"new_classes must be >= 0, got {new_classes}")
    if old_classes <= 0:
        raise ValueError(f"old_classes must be > 0 (FD needs classes in the replay memory), got {old_classes}")
    if not (isinstance(w_base, (int, float)) and math.isfinite(w_base) and w_base >= 0):
        raise ValueError(f"w_base must be a finite number >= 0, got {w_base!r}")
    return float(w_base) * math.sqrt(int(new_classes) / int(old_classes))


# ----------------------------------------------------------------------------------------------------------------
# BCT influence loss
# ----------------------------------------------------------------------------------------------------------------


def bct_influence_loss(
    new_features: torch.Tensor,
    labels: torch.Tensor,
    old_classifier_weight: torch.Tensor,
    old_classifier_bias: torch.Tensor | None = None,
    old_class_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """BCT influence loss (Shen et al., CVPR 2020): CE of the **old frozen classifier** applied to **new** features.

    new_features: (B, d) new-model features, in the form the old classifier consumed during its own training.
    labels: (B,) int indices into the old classifier's outputs. old_classifier_weight: (C_old, d) (``nn.Linear``
    layout), old_classifier_bias: (C_old,) or None; both are detached. Only samples of old classes count:
    by default those with ``labels < C_old``; ``old_class_mask`` (B,) bool selects them explicitly (e.g. replay
    samples only, for BCT-ER) and every selected label must then be < C_old. Mean over the selected samples, in
    nats; exactly 0 (still differentiable) when none is selected.
    """
    _check_features("new_features", new_features)
    batch, dim = new_features.shape
    _check_labels(labels, batch)
    if not isinstance(old_classifier_weight, torch.Tensor) or old_classifier_weight.ndim != 2:
        raise ValueError("old_classifier_weight must be a 2-D tensor (C_old, d)")
    num_old, weight_dim = old_classifier_weight.shape
    if weight_dim != dim:
        raise ValueError(
            f"old_classifier_weight has feature size {weight_dim} but new_features has {dim} "
            f"(expected weight shape ({num_old}, {dim}))"
        )
    if old_classifier_bias is not None and tuple(old_classifier_bias.shape) != (num_old,):
        raise ValueError(f"old_classifier_bias must have shape ({num_old},), got {tuple(old_classifier_bias.shape)}")
    if bool((labels < 0).any()):
        raise ValueError(f"labels must be non-negative class indices, got minimum {int(labels.min())}")
    if old_class_mask is None:
        selected = labels < num_old
    else:
        if not _is_bool_vector(old_class_mask, batch):
            raise ValueError(f"old_class_mask must be a bool tensor of shape ({batch},)")
        selected = old_class_mask
        if bool((selected & (labels >= num_old)).any()):
            bad = sorted(set(labels[selected & (labels >= num_old)].tolist()))
            raise ValueError(
                f"old_class_mask selects samples with labels {bad} that the old classifier ({num_old} classes) "
                f"does not have"
            )
    with _no_autocast(new_features):
        features = _at_least_fp32(new_features)
        weight = _at_least_fp32(old_classifier_weight.detach()).to(features.dtype)
        bias = None if old_classifier_bias is None else _at_least_fp32(old_classifier_bias.detach()).to(features.dtype)
        logits = F.linear(features, weight, bias)
        # out-of-range labels of unselected samples would crash cross_entropy; they are zero-weighted anyway
        selected = selected.to(logits.device)
        safe_labels = torch.where(selected, labels.to(logits.device), 0).long()
        per_sample = F.cross_entropy(logits, safe_labels, reduction="none")
        weights = selected.to(per_sample.dtype)
        return (per_sample * weights).sum() / weights.sum().clamp_min(1.0)


__all__ = [
    "INFO_NCE_MASKINGS",
    "bct_influence_loss",
    "compatibility_info_nce",
    "feature_distillation_loss",
    "feature_distillation_weight",
    "hoc_loss",
    "simplex_cross_entropy",
]
