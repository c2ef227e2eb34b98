"""One matrix entry M(Q, G) from stored features (:func:`entry_metric`: retrieval or verification metrics, the
training-free methods' projection, gallery adapters) and the seeded verification pairs it draws."""
from __future__ import annotations

import numpy as np
import torch

from compat_core.evaluation import verification
from compat_core.retrieval import search as retrieval
from compat_core.upgrades.adapters import apply_chain
from pipelines.config.schema import ScenarioConfig
from pipelines.methods import configured_method
from pipelines.stages.inputs import EntryRules, MatrixProtocol


def verification_pairs(query_labels: np.ndarray, gallery_labels: np.ndarray, count: int,
                       seed: int, same_pool: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded cross-set 1:1 pairs: side a a query sample (model t), side b a gallery sample (model k).

    ``count`` positive (same label) and ``count`` negative pairs, each drawn uniformly among the pairs of its kind
    (with replacement when fewer exist). ``same_pool``: query and gallery are the same images (CoReS draws its 3,000
    + 3,000 pairs from the CIFAR-10 test set), so a positive pair never pairs an image with itself.
    Returns (query index (2n,), gallery index (2n,), same (2n,) bool), shuffled.
    """
    rng = np.random.default_rng(seed)
    query_labels = np.asarray(query_labels)
    gallery_labels = np.asarray(gallery_labels)
    if same_pool and not np.array_equal(query_labels, gallery_labels):
        raise ValueError("verification_pairs: same_pool needs identical query and gallery label arrays")
    classes = np.intersect1d(query_labels, gallery_labels)
    if classes.size == 0:
        raise ValueError("evaluation.metric: verification needs labels shared by the query and gallery sets")
    q_members = [np.flatnonzero(query_labels == c) for c in classes]
    g_members = [np.flatnonzero(gallery_labels == c) for c in classes]
    weights = np.asarray([a.size * (b.size - 1 if same_pool else b.size) for a, b in zip(q_members, g_members)],
                         dtype=np.float64)
    if weights.sum() == 0:
        raise ValueError("evaluation.metric: verification needs a class with two images to form a positive pair")
    chosen = rng.choice(classes.size, size=count, p=weights / weights.sum())
    pos_a = np.asarray([q_members[c][rng.integers(q_members[c].size)] for c in chosen], dtype=np.int64)
    if same_pool:  # the partner is another image of the class: skip a's own position among the members
        picks = []
        for c, a in zip(chosen, pos_a):
            others = g_members[c][g_members[c] != a]
            picks.append(others[rng.integers(others.size)])
        pos_b = np.asarray(picks, dtype=np.int64)
    else:
        pos_b = np.asarray([g_members[c][rng.integers(g_members[c].size)] for c in chosen], dtype=np.int64)
    neg_a, neg_b = [], []
    while len(neg_a) < count:
        a = rng.integers(query_labels.size, size=2 * count)
        b = rng.integers(gallery_labels.size, size=2 * count)
        keep = query_labels[a] != gallery_labels[b]
        neg_a.extend(a[keep].tolist())
        neg_b.extend(b[keep].tolist())
    index_a = np.concatenate([pos_a, np.asarray(neg_a[:count], dtype=np.int64)])
    index_b = np.concatenate([pos_b, np.asarray(neg_b[:count], dtype=np.int64)])
    same = np.concatenate([np.ones(count, dtype=bool), np.zeros(count, dtype=bool)])
    order = rng.permutation(index_a.size)
    return index_a[order], index_b[order], same[order]


def _to_device(features, device: torch.device) -> torch.Tensor:
    """(N, D) float32 features on ``device``: half/float rows cross as stored and are widened there; on the CPU
    exactly the float32 array the host makes."""
    array = np.asarray(features)
    if device.type == "cpu" or array.dtype not in (np.float16, np.float32):
        return torch.from_numpy(np.asarray(array, dtype=np.float32)).to(device)
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True).float()


def compute_entry(query: tuple, gallery: tuple, protocol: dict, config: ScenarioConfig,
                  query_classes: int = 0, gallery_classes: int = 0, adapters: list | None = None,
                  device: torch.device | str = "cpu") -> float:
    """:func:`entry_metric` under ``protocol`` (protocol fields; the config's evaluation gives the ones left out)
    and the rest of a scenario config's entry rules (commands that hold a config: ``compat gate``, serving)."""
    rules = EntryRules.of(config)
    fields = {**rules.protocol.model_dump(), **protocol}
    rules = rules.model_copy(update={"protocol": MatrixProtocol.model_validate(fields)})
    return entry_metric(query, gallery, rules, query_classes, gallery_classes, adapters, device)


def entry_metric(query: tuple, gallery: tuple, rules: EntryRules, query_classes: int = 0, gallery_classes: int = 0,
                 adapters: list | None = None, device: torch.device | str = "cpu") -> float:
    """One matrix entry M(Q, G) from stored features; ``query``/``gallery`` = (features, labels, coarse labels).

    rules: the protocol (metric recall_at_1 | map | verification | tar_at_far, gallery instances | class_means,
    label_level fine | coarse, far, verification_pairs), the method (PSP/LSP project the query into the gallery
    model's space), the seed of the verification pairs and whether query and gallery are the same images.
    query_classes / gallery_classes: classifier outputs of the two models. adapters: gallery adapters
    (compat_core.upgrades.adapters, FAN's psi) that map the gallery model's features into the query model's space,
    oldest first (see :func:`pipelines.stages.entries.entry_adapters`), applied by
    :func:`compat_core.upgrades.adapters.apply_chain`. device: where the retrieval metrics search (the entry stage's
    device: a GPU where the stage has one); their rows cross to it once as stored and are widened and normalised
    there (no host round trip); the top-1 is exact on every device. Returns a fraction in [0, 1].
    """
    protocol = rules.protocol
    q_features, q_labels, q_coarse = query
    g_features, g_labels, g_coarse = gallery
    if protocol.label_level == "coarse":
        if q_coarse is None or g_coarse is None:
            raise ValueError("evaluation.label_level: 'coarse' needs a dataset with coarse labels (this one has none)")
        q_labels, g_labels = q_coarse, g_coarse
    method = configured_method(rules.method)
    metric = protocol.metric
    # the retrieval metrics search on ``device``: the stored rows (fp16 as stored: half the bytes) cross to it once
    # and are widened and normalised there; projections, adapters and the verification pairs stay on the host
    on_device = metric in ("recall_at_1", "map") and not adapters and not getattr(method, "training_free", False)
    where = torch.device(device) if on_device else torch.device("cpu")
    q = _to_device(q_features, where)
    g = _to_device(g_features, where)
    if getattr(method, "training_free", False):
        # features are logits; PSP/LSP project both into the class space of the older (gallery) model
        q = method.extract_features(q, num_classes_old=gallery_classes or None)
        g = method.extract_features(g, num_classes_old=gallery_classes or None)
    if adapters:
        g = apply_chain(g, adapters)
    q = torch.nn.functional.normalize(q.float(), dim=1)
    g = torch.nn.functional.normalize(g.float(), dim=1)
    q_labels = np.asarray(q_labels, dtype=np.int64)
    g_labels = np.asarray(g_labels, dtype=np.int64)
    if metric in ("recall_at_1", "map"):
        q, g = q.to(device), g.to(device)
        if protocol.gallery == "class_means":
            g, g_labels = retrieval.class_mean_gallery(g, g_labels)
    if metric == "recall_at_1":
        value = retrieval.recall_at_1(q, q_labels, g, g_labels)
    elif metric == "map":
        value = retrieval.mean_average_precision(q, q_labels, g, g_labels)
    else:
        index_a, index_b, same = verification_pairs(q_labels, g_labels, int(protocol.verification_pairs),
                                                    rules.seed, same_pool=rules.same_pool)
        if metric == "verification":
            value = verification.verification_accuracy(q[index_a], g[index_b], same)[0]
        else:
            scores = (q[index_a].double() * g[index_b].double()).sum(dim=1).numpy()
            value = verification.tar_at_far(scores, same, far=protocol.far)
    return float(value)
