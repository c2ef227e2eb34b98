"""Matrix entries through the exact linear-head bridge (SPEC §7): store m-dim embeddings, never the d-dim features.

A d-Simplex model's retrieval feature is f = A h / ||A h|| with h the backbone embedding (m) and A the bias-free
junction (d x m, d = K-1). When d > m (CelebA: d = 21,999, m = 768) storing and comparing h is d/m times cheaper,
and nothing is lost: cos(A_t q, A_k g) = q^T (A_t^T A_k) g / (||A_t q|| ||A_k g||).

``evaluation.features``: ``direct`` stores f (fp16 by default); ``bridge`` stores h (same dtype) and references A in
the model's own weights (``model.safetensors`` of the model stage, read once per process); ``auto`` (default) picks
the bridge where it is exact and cheaper (:mod:`pipelines.stages.feature_way`). The extract record's ``layout.way``
and each entry record's ``features`` say which way was used.

Entries from two bridge extracts, by metric:
- ``recall_at_1`` (gallery ``instances``): ``compat_core.retrieval.bridge.bridged_recall_at_1``, the exact top-1 kernel.
- every other metric/gallery (``map``, ``verification``, ``tar_at_far``, ``class_means``): isometric coordinates.
  With B = [A_t A_k] and its Gram G = B^T B = V diag(w) V^T (fp64, (m_t + m_k) square), L = diag(sqrt(w)) V^T
  satisfies (L x).(L y) = (B x).(B y) for all x, y, so q' = L [q; 0] and g' = L [0; g] have exactly the cosines
  of the d-dim features (up to fp64 rounding) in at most m_t + m_k dimensions, and the entry runs through the same
  ``entry_metric`` as direct features. Class means are linear in the unit features, so they carry over too.
Fallback to d-dim features materialised from the embeddings (A h, fp32), recorded as way ``materialized``: when a
feature adapter applies to the entry (FAN's psi, issue-16 adapters map d-dim features non-linearly), or when only
one side of the entry was stored as embeddings. Any other reader of a bridge extract (``read_features``) gets the
materialised features as well.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from compat_core.retrieval.bridge import bridged_recall_at_1
from pipelines.stages.feature_way import feature_way
from pipelines.records.payloads import EntryFeatures, FeatureLayout, JunctionRef
from pipelines.records.stage_records import FeatureRecord
from pipelines.stages.entry_metrics import entry_metric
from pipelines.stages.feature_store import cached_features, junction_gram, junction_head, read_embeddings
from pipelines.stages.inputs import EntryRules
from pipelines.store.run_store import RunStore, feature_blobs

WEIGHTS_BLOB = "model.safetensors"
JUNCTION_TENSOR = "junction.weight"


# ---- which way (the rules: pipelines.stages.feature_way) ---------------------------------------------------
def model_feature_way(requested: str, method: str, model) -> tuple[str, str]:
    """:func:`feature_way` of a loaded CompatModel."""
    head = "junction" if isinstance(model.junction, torch.nn.Linear) else "backbone"
    return feature_way(requested, method, head, int(model.feature_dim), int(model.embed_dim))


# ---- storing -------------------------------------------------------------------------------------------------------
def bridge_blobs(embeddings: np.ndarray, model_stage_key: str, feature_dim: int, labels: np.ndarray,
                 coarse_labels: np.ndarray | None, dtype: str) -> tuple[dict[str, bytes], FeatureLayout]:
    """Blobs + layout of a bridge extract: embeddings (N, m) as ``dtype`` shards and a reference to the junction
    weights in the model stage's own ``model.safetensors`` (verified by that stage's manifest when read)."""
    blobs, layout = feature_blobs(embeddings, labels, coarse_labels, dtype=dtype, prefix="embeddings")
    layout.way, layout.embed_dim, layout.feature_dim = "bridge", int(embeddings.shape[1]), int(feature_dim)
    layout.head = JunctionRef(model_stage_key, WEIGHTS_BLOB, JUNCTION_TENSOR)
    return blobs, layout


# ---- entries -------------------------------------------------------------------------------------------------------
def isometric_coordinates(store: RunStore, query_head: JunctionRef,
                          gallery_head: JunctionRef) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_t (r, m_t), L_k (r, m_k)) fp64 with (L_t q).(L_k g) = (A_t q).(A_k g) and ||L_t q|| = ||A_t q||,
    ||L_k g|| = ||A_k g|| for every q, g (module docstring); r <= m_t + m_k."""
    same = query_head.stage_key == gallery_head.stage_key
    gram_t = junction_gram(store, query_head)
    if same:
        gram = gram_t
    else:
        gram_k = junction_gram(store, gallery_head)
        cross = junction_head(store, query_head).double().t() @ junction_head(store, gallery_head).double()
        gram = torch.cat([torch.cat([gram_t, cross], 1), torch.cat([cross.t(), gram_k], 1)], 0)
    values, vectors = torch.linalg.eigh(gram)
    # directions with eigenvalue at the rounding level of G carry no part of any feature (G is PSD)
    keep = values > values.max() * gram.shape[0] * torch.finfo(torch.float64).eps
    coordinates = torch.sqrt(values[keep])[:, None] * vectors[:, keep].t()
    m_t = gram_t.shape[0]
    return (coordinates, coordinates) if same else (coordinates[:, :m_t], coordinates[:, m_t:])


def bridge_entry(store: RunStore, query_key: str, gallery_key: str, rules: EntryRules,
                 device: torch.device | str = "cpu") -> tuple[float, str]:
    """Entry M(Q, G) of two bridge extracts (no adapter applies), searched on ``device``: (value, kernel used)."""
    protocol = rules.protocol
    q_embed, q_labels, q_coarse, q_layout = read_embeddings(store, query_key)
    g_embed, g_labels, g_coarse, g_layout = read_embeddings(store, gallery_key)
    if protocol.metric == "recall_at_1" and protocol.gallery == "instances":
        if protocol.label_level == "coarse":
            if q_coarse is None or g_coarse is None:
                raise ValueError("evaluation.label_level: 'coarse' needs a dataset with coarse labels "
                                 "(this one has none)")
            q_labels, g_labels = q_coarse, g_coarse
        value = bridged_recall_at_1(torch.from_numpy(q_embed.astype(np.float32)).to(device),
                                    junction_head(store, q_layout.head),
                                    torch.from_numpy(g_embed.astype(np.float32)).to(device),
                                    junction_head(store, g_layout.head), np.asarray(q_labels, np.int64),
                                    np.asarray(g_labels, np.int64))
        return float(value), "bridged_recall_at_1"
    to_query, to_gallery = isometric_coordinates(store, q_layout.head, g_layout.head)
    q_coords = (torch.from_numpy(q_embed).double() @ to_query.t()).numpy()
    g_coords = (torch.from_numpy(g_embed).double() @ to_gallery.t()).numpy()
    value = entry_metric((q_coords, q_labels, q_coarse), (g_coords, g_labels, g_coarse), rules, device=device)
    return float(value), f"isometric coordinates (r={to_query.shape[0]})"


def entry_value(store: RunStore, rules: EntryRules, query_record: FeatureRecord, gallery_record: FeatureRecord,
                adapters: list, device: torch.device | str = "cpu") -> tuple[float, EntryFeatures]:
    """The value of one matrix entry under ``rules``, searched on ``device``, and how its features were used (way
    "bridge" | "direct" | "materialized", kernel or reason, device, seconds). Direct extracts (and fallbacks) go
    through ``entry_metric`` on d-dim features."""
    started = time.perf_counter()
    query_key, gallery_key = query_record.stage_key, gallery_record.stage_key
    ways = (query_record.layout.feature_way, gallery_record.layout.feature_way)
    if ways == ("bridge", "bridge") and not adapters:
        value, kernel = bridge_entry(store, query_key, gallery_key, rules, device)
        how = EntryFeatures("bridge", kernel=kernel)
    else:
        value = entry_metric(cached_features(store, query_key), cached_features(store, gallery_key), rules,
                             query_record.num_classes_model, gallery_record.num_classes_model, adapters=adapters,
                             device=device)
        if "bridge" not in ways:
            how = EntryFeatures("direct")
        elif adapters:
            how = EntryFeatures("materialized", reason="a feature adapter applies to the gallery features")
        else:
            how = EntryFeatures("materialized", reason=f"query extract {ways[0]}, gallery extract {ways[1]}")
    how.seconds = time.perf_counter() - started
    how.device = str(device)
    return value, how
