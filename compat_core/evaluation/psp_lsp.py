"""Training-free compatible features from a classifier's outputs: PSP and LSP (SPEC §4).

From "The Probability Simplex is Compatible" (Eq. 2-4, 6 and Alg. 1). A model at step t knows C_t classes and an
older model at step k knows C_k <= C_t of them, **in the same order** (the older model's classes are the first
C_k outputs of the newer one: nested class lists, the paper's stated limitation). Features of the newer model are
mapped into the older model's space with

    P_{t,k} = [P_{k,k} | 0]   (C_k x C_t),   P_{k,k} = I_{C_k} - J_{C_k} / C_k

i.e. keep the first C_k outputs and subtract their mean (centring uses C_k, not C_t), then L2-normalise. With
C_t = C_k it is the plain self-feature of Eq. 2.

Top-k sparsification (paper App. K) is applied to the finished feature vector, "setting all entries of a PSP feature
representation vector to zero except for the top-k": the k largest *values* (the most probable classes) survive;
the result is re-normalised to unit length so cosine similarity stays a dot product. The paper does not say
whether it re-normalised; ranking by cosine similarity is unaffected for the query side, not for the gallery side.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from compat_core.validation import check_int

# Row sums of probabilities may drift from 1 in fp16/bf16 softmax over many classes; logits almost never sum to 1.
_PROBABILITY_SUM_TOLERANCE = 1e-2


def _as_float_tensor(values, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(values) if not isinstance(values, torch.Tensor) else values
    if tensor.ndim not in (1, 2):
        raise ValueError(f"{name} must have shape (C,) or (N, C), got {tuple(tensor.shape)}")
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    if tensor.shape[-1] == 0:
        raise ValueError(f"{name} must have at least one class column, got shape {tuple(tensor.shape)}")
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _resolve_num_old(num_classes_old, num_classes: int) -> int:
    if num_classes_old is None:
        return num_classes
    return check_int("num_classes_old", num_classes_old, 2, num_classes)


def _keep_top_k(features: torch.Tensor, top_k: int | None) -> torch.Tensor:
    if top_k is None:
        return features
    top_k = check_int("top_k", top_k, 1)
    if top_k >= features.shape[-1]:
        return features
    kept = torch.topk(features, top_k, dim=-1).indices
    sparse = torch.zeros_like(features).scatter(-1, kept, features.gather(-1, kept))
    return F.normalize(sparse, dim=-1)


def psp(probs, num_classes_old: int | None = None, top_k: int | None = None) -> torch.Tensor:
    """Probability Simplex Projection feature: ``P_{t,k} p / ||P_{t,k} p||`` (paper Eq. 2-4).

    probs: (N, C_t) or (C_t,) softmax **probabilities** of the newer model (rows sum to 1; use
    :func:`psp_from_logits` for logits). num_classes_old: C_k, the class count of the older model whose space the
    features must live in (2 <= C_k <= C_t; None means C_t, the model's own space). top_k: keep only the k largest
    entries (see module docstring). Returns float (N, C_k) or (C_k,) unit vectors; an exactly uniform
    distribution over the first C_k classes maps to the zero vector (it has no direction).
    """
    probabilities = _as_float_tensor(probs, "probs")
    if bool((probabilities < 0).any()) or bool(
        ((probabilities.sum(dim=-1) - 1.0).abs() > _PROBABILITY_SUM_TOLERANCE).any()
    ):
        raise ValueError(
            "probs must be softmax probabilities (non-negative, each row summing to 1 over all C_t classes); "
            "pass logits to psp_from_logits or lsp instead"
        )
    num_old = _resolve_num_old(num_classes_old, probabilities.shape[-1])
    known = probabilities[..., :num_old]
    centred = known - known.mean(dim=-1, keepdim=True)
    return _keep_top_k(F.normalize(centred, dim=-1), top_k)


def psp_from_logits(logits, num_classes_old: int | None = None, top_k: int | None = None) -> torch.Tensor:
    """:func:`psp` of ``softmax(logits)`` (softmax over all C_t outputs, computed in at least fp32)."""
    scores = _as_float_tensor(logits, "logits")
    return psp(torch.softmax(scores, dim=-1), num_classes_old, top_k)


def lsp(
    logits, num_classes_old: int | None = None, top_k: int | None = None, center: bool = False
) -> torch.Tensor:
    """Logit Simplex Projection feature: ``z / ||z||`` (paper Eq. 6).

    logits: (N, C_t) or (C_t,) raw classifier outputs. num_classes_old: C_k, keep only the first C_k logits so
    features of a newer model live in the older model's space (None: all C_t). center: also subtract the mean of
    the kept logits, i.e. apply P_{t,k} exactly as Alg. 1 does (the paper's Eq. 6 does not centre; default off,
    as in SPEC). top_k: keep only the k largest entries, then re-normalise. Returns float (N, C_k) unit vectors.
    """
    scores = _as_float_tensor(logits, "logits")
    kept = scores[..., : _resolve_num_old(num_classes_old, scores.shape[-1])]
    if center:
        kept = kept - kept.mean(dim=-1, keepdim=True)
    return _keep_top_k(F.normalize(kept, dim=-1), top_k)


__all__ = ["lsp", "psp", "psp_from_logits"]
