"""Which way an extract stores features (``evaluation.features``: the d-dim features, or the m-dim embeddings the
exact linear-head bridge compares, :mod:`pipelines.stages.bridge_features`) and what ``compat plan`` says about it.

Decided from the config, the method's card and the backbone's card alone (no model is built, no torch), so the
graph compiler refuses an impossible ``bridge`` before anything trains and ``compat plan`` prints the storage and
similarity cost of both ways. It decides what an extract stage stores, so it lives with the stages (its source is
part of every stage key).
"""
from __future__ import annotations

from compat_core.models.backbones import embedding_width
from pipelines.config.schema import resolved_head
from pipelines.config.validate import bridge_obstacle
from pipelines.methods import METHODS

FEATURE_WAYS = ("auto", "direct", "bridge")


def _transforms_features(method: str) -> str | None:
    """Why entries of ``method`` map stored features through an adapter (None when they never do)."""
    if METHODS.get(method).adapts_gallery:
        return f"method {method} applies its feature adapters to gallery features"
    return None


def feature_way(requested: str, method: str, head: str, feature_dim: int, embed_dim: int) -> tuple[str, str]:
    """(way, reason) for an extract of a model of ``method`` with ``head`` (junction | backbone), d =
    ``feature_dim`` and m = ``embed_dim`` under ``requested`` (``evaluation.features``: auto | direct | bridge).
    Raises ValueError when ``bridge`` is asked for a model the bridge cannot represent (configs that ask for it
    are refused at load, ``pipelines.config.validate``)."""
    if requested == "direct":
        return "direct", "evaluation.features: direct"
    impossible = bridge_obstacle(method, head)
    if impossible is not None:
        if requested == "bridge":
            raise ValueError(f"evaluation.features: 'bridge' is not possible here: {impossible}; use auto or direct")
        return "direct", impossible
    if requested == "bridge":
        return "bridge", "evaluation.features: bridge"
    if feature_dim <= embed_dim:
        return "direct", f"d={feature_dim} <= m={embed_dim}: the embedding is not smaller than the feature"
    transforms = _transforms_features(method)
    if transforms is not None:
        return "direct", f"{transforms} (entries would materialise the d-dim features anyway)"
    return "bridge", f"d={feature_dim} > m={embed_dim}"


# ---- plan ------------------------------------------------------------------------------------------------------------
def plan_lines(config, query_rows: int | None, gallery_rows: int | None, entries: int) -> list[str]:
    """`compat plan` lines: which way ``evaluation.features`` takes, storage per image per model and the similarity
    cost of an entry both ways (FLOPs count multiply-adds as 2)."""
    d = config.model.num_slots - 1
    try:
        m = embedding_width(config.model.backbone, config.model.backbone_config)
    except (KeyError, TypeError, ValueError) as error:  # a plan prints even when the options are not the card's
        return [f"features: evaluation.features={config.evaluation.features}; embedding width unknown ({error})"]
    try:
        head = resolved_head(config, METHODS.get(config.method.name).classifier)
        way, reason = feature_way(config.evaluation.features, config.method.name, head, d, m)
    except ValueError as error:
        way, reason = "invalid", str(error)
    value_bytes = 2 if config.evaluation.feature_dtype == "float16" else 4
    lines = [f"features: {way} ({reason}); evaluation.features={config.evaluation.features}",
             f"  storage per image per model: direct {d * value_bytes} B (d={d}), bridge {m * value_bytes} B "
             f"(m={m}; the head A, {d * m * 4 / 2**20:.1f} MiB fp32, is read from the model weights)"]
    if query_rows is not None and gallery_rows is not None:
        direct = 2.0 * query_rows * gallery_rows * d
        # A_t^T A_k and A_k^T A_k (2 d m^2), the gallery map (2 Ng m^2), the m-dim search (2 Nq Ng m)
        bridge = 2.0 * 2 * d * m * m + 2.0 * gallery_rows * m * m + 2.0 * query_rows * gallery_rows * m
        lines.append(f"  similarity cost per entry: direct {direct:.3e} FLOPs, bridge {bridge:.3e} FLOPs "
                     f"({direct / bridge:.1f}x less); {entries} entries")
    else:
        lines.append(f"  similarity cost per entry: direct 2*Nq*Ng*{d} FLOPs, bridge 2*Nq*Ng*{m} + 2*Ng*{m}^2 + "
                     f"{4.0 * d * m * m:.3e} (the m x m head products) FLOPs; {entries} entries")
    return lines


__all__ = ["FEATURE_WAYS", "feature_way", "plan_lines"]
