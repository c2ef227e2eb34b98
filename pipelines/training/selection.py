"""Features of a model under evaluation transforms, and compatibility-based model selection (CoReS Sec. 8.2):
which epoch's weights a training task keeps."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from compat_core.data.source import ImageSource
from compat_core.data.stream import stream_batches
from compat_core.data.transforms import make_transforms
from compat_core.evaluation.metrics import upgrade_verdict
from compat_core.models.precision import prepare_batch
from compat_core.retrieval.search import recall_at_1
from compat_core.upgrades.adapters import apply_chain
from pipelines.methods.objective import Method
from pipelines.training.autocast import precision_context
from pipelines.training.settings import TrainConfig
from pipelines.training.task_data import SelectionSplit


def snapshot_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``model.state_dict()`` (for initial weights and model selection)."""
    return {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()}


@torch.no_grad()
def extract_features(model: nn.Module, source: ImageSource, indices: np.ndarray, device: torch.device,
                     config: TrainConfig, feature_fn: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """``feature_fn(model output)`` of ``source[indices]`` with evaluation transforms, float32 on the CPU, in
    batches of ``config.eval_batch_size`` under ``config.autocast`` (the model's mode is the caller's)."""
    transform = make_transforms(source, train=False)
    chunks = []
    batches = [np.arange(start, min(start + config.eval_batch_size, indices.size))
               for start in range(0, indices.size, config.eval_batch_size)]
    for _, images in stream_batches(source, indices, batches, workers=config.input_workers,
                                    prefetch=config.prefetch_batches, pin_memory=device.type == "cuda"):
        with precision_context(device, config.autocast):
            output = model(prepare_batch(transform(images.to(device, non_blocking=True)), model))
        chunks.append(feature_fn(output).float().cpu())
    return torch.cat(chunks)


def compute_features(model: nn.Module, source: ImageSource, indices: np.ndarray, config: TrainConfig) -> torch.Tensor:
    """L2-normalised features (n, K-1), float32 on the CPU, of ``source[indices]`` with evaluation transforms.

    Batches of ``config.eval_batch_size`` on ``config.device`` under ``config.autocast``; the model is put in
    eval mode for the call and its previous mode restored (used for herding replay selection).
    """
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    was_training = model.training
    model.eval()
    try:
        return extract_features(model, source, indices, torch.device(config.device), config,
                                lambda output: output.features)
    finally:
        model.train(was_training)


class CompatibilitySelector:
    """CoReS Sec. 8.2: among epochs whose cross-test beats the previous model's self-test, keep the best self-test.

    All tests are 1:N Recall@1 (fractions) on the held-out split; the previous model's features and self-test are
    computed once. Only the best snapshot so far is kept in memory. With no previous model every epoch qualifies;
    when no epoch qualifies, the last epoch is kept (the paper does not say; "last" is the default anyway). An
    epoch qualifies by the compatibility criterion of :func:`compat_core.evaluation.metrics.upgrade_verdict`
    (strict unless ``config.selection_strict`` is False).
    """

    def __init__(self, split: SelectionSplit, old_model: nn.Module | None, method: Method, device: torch.device,
                 config: TrainConfig) -> None:
        self.split, self.method, self.device, self.config = split, method, device, config
        self.query_labels = torch.from_numpy(np.asarray(split.source.labels)[split.query_indices])
        self.gallery_labels = torch.from_numpy(np.asarray(split.source.labels)[split.gallery_indices])
        self.old_model = old_model
        self.old_classes = None if old_model is None else int(old_model.num_active_classes)
        self.old_gallery = self.old_self = None
        if old_model is not None:
            old_query = self._features(old_model, split.query_indices, None)
            self.old_gallery = self._features(old_model, split.gallery_indices, None)
            self.old_self = self._recall(old_query, self.old_gallery)
        self.best_state: dict[str, torch.Tensor] | None = None
        self.best_epoch: int | None = None
        self.best_self = -math.inf
        self.history: list[dict[str, float]] = []

    def _features(self, model: nn.Module, indices: np.ndarray, num_classes_old: int | None) -> torch.Tensor:
        if self.method.training_free:
            feature_fn = lambda output: self.method.extract_features(output, num_classes_old)  # noqa: E731
        else:
            feature_fn = lambda output: output.features  # noqa: E731
        return extract_features(model, self.split.source, indices, self.device, self.config, feature_fn)

    def _recall(self, query: torch.Tensor, gallery: torch.Tensor) -> float:
        return float(recall_at_1(query, self.query_labels, gallery, self.gallery_labels))

    def _cross_test(self, model: nn.Module, query: torch.Tensor) -> float:
        """Recall@1 of the new model's queries against the old model's gallery (adapted by the method's adapter)."""
        old_gallery = self.old_gallery
        adapter = getattr(self.method, "adapter", None)
        if adapter is not None:  # FAN compares a new query with the adapted old gallery
            old_gallery = apply_chain(old_gallery.to(self.device), [adapter]).cpu()
        if self.method.training_free:
            query = self._features(model, self.split.query_indices, self.old_classes)
        return self._recall(query, old_gallery)

    def observe(self, epoch: int, model: nn.Module) -> dict[str, float]:
        """Test ``model`` after ``epoch`` (0-based), keep its weights when it is the best qualifying epoch so far;
        returns the epoch's selection metrics (Recall@1 fractions, ``selection_compatible`` 0.0 or 1.0)."""
        was_training = model.training
        model.eval()
        query = self._features(model, self.split.query_indices, None)
        gallery = self._features(model, self.split.gallery_indices, None)
        metrics = {"selection_self": self._recall(query, gallery)}
        qualifies = True
        if self.old_model is not None:
            metrics["selection_cross"] = self._cross_test(model, query)
            metrics["selection_old_self"] = self.old_self
            verdict = upgrade_verdict(metrics["selection_cross"], self.old_self, strict=self.config.selection_strict)
            qualifies = verdict["compatible"]
        metrics["selection_compatible"] = float(qualifies)
        if qualifies and metrics["selection_self"] > self.best_self:
            self.best_self = metrics["selection_self"]
            self.best_epoch = epoch
            self.best_state = snapshot_state(model)
        self.history.append({"epoch": float(epoch), **metrics})
        model.train(was_training)
        return metrics


__all__ = ["CompatibilitySelector", "compute_features", "extract_features", "snapshot_state"]
