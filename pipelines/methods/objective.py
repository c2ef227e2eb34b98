"""The method (training recipe) strategy interface and helpers shared by several methods.

A method is a small object that turns a batch into a loss. The training loop (:mod:`pipelines.training.loop`) owns the
model, the frozen old model, the optimiser, the schedule and the batches; it calls ``setup`` once per task (the
returned modules are trained together with the model) and ``loss`` once per step, inside the autocast context.

Conventions shared by every method:

- ``Batch.targets`` are class *slots*: d-Simplex slot indices in ``[0, K)`` for ``classifier == "simplex"``, output
  indices of the learnable classifier for ``classifier == "learnable"``. Old classes are the ones the old model's
  classifier can score.
- The first task of a sequence has no previous model (``ctx.old_model is None``) and no replay memory: every
  method then reduces to its plain classification term, since its compatibility terms compare against something
  that does not exist yet.
- At a replacement the stage passes the newly loaded model both as ``model`` (to fine-tune) and, frozen, as
  ``old_model``: the reference anchors to the loaded model, not to the model it replaces (``replacements[].anchor:
  replaced`` passes the replaced model instead, for d-Simplex methods). The first task of a
  line that starts from ``initial_model`` is treated alike (anchored to the loaded third-party model); a line that
  starts from a random initialisation has no old model at its first task.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from compat_core.kinds import CLASSIFIERS, ClassifierFamily
from pipelines.config.method_params import MethodParams, error_lines
from pipelines.methods.card import MethodCard


# what a Method class takes from its card
_CARD_TRAITS = ("name", "classifier", "uses_replay", "needs_old_model", "retrain_from_scratch",
                "requires_initial_state", "independent_init", "training_free", "adapts_gallery", "Params")


@dataclass
class Batch:
    """One training batch on the device.

    images: float (B, C, H, W), already transformed and normalised (only ``rows`` of them under data-parallel
    training, see the field's comment). targets: (B,) int64 class slots (see module
    docstring). is_memory: (B,) bool, True for samples drawn from the replay memory.
    """

    images: torch.Tensor
    targets: torch.Tensor
    is_memory: torch.Tensor
    # data-parallel training (pipelines.training.distributed): images hold only rows [start, stop) of the batch, and the
    # context's model and old model return the outputs of the whole batch, which targets/is_memory describe
    rows: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.images, torch.Tensor) or self.images.ndim != 4 or not self.images.is_floating_point():
            raise ValueError("Batch.images must be a float tensor (B, C, H, W)")
        batch = self.images.shape[0]
        if self.rows is not None:
            if self.rows[1] - self.rows[0] != batch:
                raise ValueError(f"Batch.rows {self.rows} must span the {batch} local images")
            batch = int(getattr(self.targets, "shape", (batch,))[0])
        if not isinstance(self.targets, torch.Tensor) or self.targets.shape != (batch,):
            raise ValueError(f"Batch.targets must be an int tensor of shape ({batch},)")
        if not isinstance(self.is_memory, torch.Tensor) or self.is_memory.shape != (batch,) or self.is_memory.dtype != torch.bool:
            raise ValueError(f"Batch.is_memory must be a bool tensor of shape ({batch},)")


@dataclass
class TaskContext:
    """What a method may look at during one task.

    model: the model being trained (a ``CompatModel``). old_model: frozen previous model (eval mode, no grads) or
    None. task: 0-based task index. num_old_classes: classes seen before this task (count); num_new_classes:
    classes introduced by this task (count). hparams: the method's validated hyper-parameters. device: where the
    batches live. iterate_memory: None, or a callable returning an iterator of :class:`Batch` over the replay
    memory with evaluation transforms (each memory sample once), for methods that summarise old classes in
    ``setup``. iterate_task: the same over the task's own samples (each once), for methods that summarise the
    task's new classes in ``setup`` (BCT's synthesised old-classifier rows).
    """

    model: nn.Module
    old_model: nn.Module | None
    task: int
    num_old_classes: int
    num_new_classes: int
    hparams: Any
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    iterate_memory: Callable[[], Iterator[Batch]] | None = None
    iterate_task: Callable[[], Iterator[Batch]] | None = None
    step: int = 0  # optimiser steps taken in this task before the current batch (the trainer sets it)
    steps_per_epoch: int = 0
    epochs: int = 0

    def progress(self) -> tuple[int, float]:
        """(0-based epoch, fraction of the task's steps done) of the current batch; (0, 0.0) outside a trainer."""
        if self.steps_per_epoch <= 0 or self.epochs <= 0:
            return 0, 0.0
        return self.step // self.steps_per_epoch, self.step / (self.steps_per_epoch * self.epochs)


class Method:
    """Base class of every training recipe; see the module docstring for the contract.

    A subclass sets ``card`` (its :class:`pipelines.methods.card.MethodCard`: name, ``Params``, classifier family and
    traits, copied onto the class) and implements ``loss``; ``method.params`` of a config is validated against
    ``Params`` at load time, and again here. ``setup`` returns the extra trainable modules (adapters,
    discriminators), already on the context's device. ``export_state`` returns the adapters that must outlive
    training, by name (:class:`compat_core.upgrades.adapters.Adapter`; FAN's psi_t); the stage stores them next to
    the model. A class without a card (a test's recording method) sets the traits it needs itself.
    """

    card: ClassVar[MethodCard | None] = None
    name: ClassVar[str] = ""
    classifier: ClassVar[ClassifierFamily] = "simplex"
    uses_replay: ClassVar[bool] = False
    needs_old_model: ClassVar[bool] = False
    retrain_from_scratch: ClassVar[bool] = False
    requires_initial_state: ClassVar[bool] = False
    independent_init: ClassVar[bool] = False
    training_free: ClassVar[bool] = False
    adapts_gallery: ClassVar[bool] = False

    Params: ClassVar[type[MethodParams]] = MethodParams

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        card = cls.__dict__.get("card")
        if card is not None:
            for trait in _CARD_TRAITS:
                setattr(cls, trait, getattr(card, trait))

    def __init__(self, **hparams: Any) -> None:
        try:
            self.hparams = self.Params.model_validate(hparams)
        except ValidationError as error:
            raise ValueError(f"method {self.name!r}: " + "; ".join(error_lines(error, hparams, self.Params))) from None

    def setup(self, ctx: TaskContext) -> list[nn.Module]:
        return []

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """(loss, parts): parts are detached 0-d tensors (or floats); the loop reads them at log intervals only."""
        raise NotImplementedError(f"method {self.name!r} does not implement loss()")

    def export_state(self) -> dict[str, Any]:
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.hparams})"


# ----------------------------------------------------------------------------------------------------------------
# helpers shared by several methods
# ----------------------------------------------------------------------------------------------------------------


def learnable_classifier(model: nn.Module, role: str) -> nn.Linear:
    """The growing ``nn.Linear(K-1, n_active)`` head of a learnable-classifier model (ValueError otherwise)."""
    head = getattr(model, "classifier", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"the {role} needs a learnable classifier (model.classifier an nn.Linear), got {type(head).__name__}; "
            f"build it with create_model(..., classifier='learnable')"
        )
    return head


def classification_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean softmax cross-entropy in fp32 (nats); raises ValueError when a target has no classifier output."""
    if bool((targets >= logits.shape[1]).any()) or bool((targets < 0).any()):
        raise ValueError(
            f"targets must be classifier outputs in [0, {logits.shape[1]}), got range "
            f"[{int(targets.min())}, {int(targets.max())}]; expand the classifier to the task's classes first"
        )
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), targets.long())


@torch.no_grad()
def old_features(ctx: TaskContext, images: torch.Tensor) -> torch.Tensor:
    """The frozen old model's L2-normalised features ``(B, d)`` of ``images`` (no graph). Only the backbone and the
    junction run: no method reads the old model's logits, which cost O(B*K) more at K=22000."""
    if ctx.old_model is None:
        raise ValueError("this method needs the previous model (ctx.old_model) but none was given")
    return ctx.old_model.features(images)


@dataclass
class ClassStatistics:
    """Old-model class summaries over the replay memory, in the old model's L2-normalised feature space.

    centres: (C_old, d) unit class-mean directions (zero rows for classes without memory samples); radius:
    (C_old,) mean cosine distance (1 - cos) of the class's old features to its centre; farthest: (C_old,) the
    largest such distance (the class's farthest member, LCE's boundary); present: (C_old,) bool.
    """

    centres: torch.Tensor
    radius: torch.Tensor
    present: torch.Tensor
    farthest: torch.Tensor | None = None
    count: torch.Tensor | None = None  # (C_old,) old features summarised per class


@torch.no_grad()
def old_class_statistics(ctx: TaskContext, num_classes: int) -> ClassStatistics | None:
    """Class centres and radii of the old model on the replay memory (None without old model or memory).

    num_classes: number of old-class slots to summarise (targets >= num_classes are ignored).
    """
    if ctx.old_model is None or ctx.iterate_memory is None or num_classes <= 0:
        return None
    sums: torch.Tensor | None = None
    counts = torch.zeros(num_classes, dtype=torch.float64, device=ctx.device)
    stored: list[tuple[torch.Tensor, torch.Tensor]] = []
    for batch in ctx.iterate_memory():
        features = F.normalize(ctx.old_model(batch.images).features.double(), dim=1)
        keep = batch.targets < num_classes
        features, targets = features[keep], batch.targets[keep]
        if sums is None:
            sums = torch.zeros(num_classes, features.shape[1], dtype=torch.float64, device=ctx.device)
        sums.index_add_(0, targets, features)
        counts.index_add_(0, targets, torch.ones_like(targets, dtype=torch.float64))
        stored.append((features, targets))
    if sums is None or not bool((counts > 0).any()):
        return None
    centres = F.normalize(sums, dim=1)
    distance_sums = torch.zeros(num_classes, dtype=torch.float64, device=ctx.device)
    farthest = torch.zeros(num_classes, dtype=torch.float64, device=ctx.device)
    for features, targets in stored:
        distances = 1.0 - (features * centres[targets]).sum(dim=1)
        distance_sums.index_add_(0, targets, distances)
        farthest.scatter_reduce_(0, targets, distances, reduce="amax")
    present = counts > 0
    radius = torch.where(present, distance_sums / counts.clamp_min(1.0), torch.zeros_like(distance_sums))
    return ClassStatistics(centres=centres.float(), radius=radius.float(), present=present,
                           farthest=farthest.float(), count=counts.long())


def boundary_hinge(
    new_features: torch.Tensor, targets: torch.Tensor, stats: ClassStatistics, scale: float = 1.0,
    radius: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean ``relu((1 - cos(new_i, c_{y_i})) - scale * r_{y_i})`` over samples of classes in ``stats`` (0 if none).

    Pulls a new feature inside the old class's boundary: ``r`` is ``radius`` (C_old,) when given (LCE: the
    farthest member's distance), else the mean distance of the old features to their centre.
    """
    num_classes = stats.centres.shape[0]
    valid = targets < num_classes
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    valid = valid & stats.present[safe]
    new_unit = F.normalize(new_features.float(), dim=1)
    distance = 1.0 - (new_unit * stats.centres[safe]).sum(dim=1)
    bound = stats.radius if radius is None else radius
    hinge = F.relu(distance - scale * bound[safe]) * valid.float()
    return hinge.sum() / valid.float().sum().clamp_min(1.0)


def classifier_input(output) -> torch.Tensor:
    """What a learnable classifier head consumes in a ``ModelOutput``: the unnormalised junction output."""
    return output.projection


class GradientReversal(torch.autograd.Function):
    """Identity forward, ``-scale * grad`` backward (Ganin & Lempitsky, 2015)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return -ctx.scale * grad, None


def reverse_gradient(tensor: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return GradientReversal.apply(tensor, scale)


__all__ = [
    "Batch",
    "CLASSIFIERS",
    "ClassStatistics",
    "Method",
    "MethodParams",
    "TaskContext",
    "boundary_hinge",
    "classification_cross_entropy",
    "classifier_input",
    "learnable_classifier",
    "old_class_statistics",
    "old_features",
    "reverse_gradient",
]
