"""The compatible model: backbone -> bias-free junction Linear(m, K-1) -> classifier (SPEC §3).

Classifier kinds:
- ``"simplex"``: the fixed d-Simplex prototypes ``(K, K-1)``. They are never built: the logits
  ``projection @ prototypes.T`` are computed in closed form (``compat_core.simplex.dsimplex_logits``, O(B*K)), so a
  K=22000 model holds no 1.9 GB matrix in memory, in a checkpoint, in a registered model or in a pickle, and its
  forward/backward costs O(B*K) instead of O(B*K^2). Logits are fp32 (fp64 for an fp64 model) ``(B, K)`` of the *unnormalised* junction
  output; ``prototype_rows`` gives individual prototypes.
- ``"learnable"``: a bias-free ``nn.Linear(d, n_active)`` for baselines (ER, BCT, ...) that grows with
  ``expand_classes``; logits ``(B, n_active)``.

Heads: ``"junction"`` puts the bias-free ``Linear(m, K-1)`` between backbone and classifier (d = K-1; required by
the d-Simplex); ``"backbone"`` (learnable classifiers only) has no junction, so the feature is the backbone output
(d = m) and the classifier sits on it, as the papers' and the public reference's ER / BCT baselines.

The retrieval feature is the L2-normalised junction output (the backbone output with the ``"backbone"`` head). ``model.config`` holds everything ``create_model``
needs to rebuild the model and travels with the weights (``save_model`` / ``load_model``).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pyarrow.fs import LocalFileSystem
from torch import nn

from compat_core import io as cio
from compat_core.kinds import CLASSIFIERS
from compat_core.models.backbones import create_backbone
from compat_core.models.weight_checks import check_head_against_header, check_weight_values, safetensors_header
from compat_core.simplex import NORMS as SIMPLEX_NORMS
from compat_core.simplex import dsimplex_logits, dsimplex_rows
from compat_core.validation import check_int

HEADS = ("junction", "backbone")
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FORMAT_VERSION = 1


@dataclass
class ModelOutput:
    """Everything one forward pass produces (B = batch size, m = backbone width, K = slots)."""

    embedding: torch.Tensor  # (B, m) backbone output
    projection: torch.Tensor  # (B, K-1) junction output, unnormalised
    features: torch.Tensor  # (B, K-1) L2-normalised projection (the retrieval feature)
    logits: torch.Tensor  # (B, K) simplex or (B, n_active) learnable


class CompatModel(nn.Module):
    """Backbone + junction + classifier; see the module docstring for shapes."""

    def __init__(
        self,
        backbone: nn.Module,
        num_slots: int,
        classifier: str = "simplex",
        config: dict | None = None,
        num_active_classes: int = 0,
        simplex_norm: str = "row",
        head: str = "junction",
    ) -> None:
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {head!r}")
        if head == "backbone" and classifier == "simplex":
            raise ValueError("head='backbone' needs classifier='learnable': the d-Simplex classifier needs the junction "
                             "to K-1 dimensions")
        num_slots = check_int("num_slots (K)", num_slots, 2)
        if classifier not in CLASSIFIERS:
            raise ValueError(f"classifier must be one of {CLASSIFIERS}, got {classifier!r}")
        embed_dim = getattr(backbone, "embed_dim", None)
        if not isinstance(embed_dim, int) or embed_dim <= 0:
            raise ValueError(f"backbone must expose a positive int attribute embed_dim (m), got {embed_dim!r}")
        num_active_classes = check_int("num_active_classes", num_active_classes, 0)
        if classifier == "simplex" and num_active_classes:
            raise ValueError("num_active_classes applies only to classifier='learnable' (simplex uses all K slots)")
        self.backbone = backbone
        self.num_slots = num_slots
        self.classifier_kind = classifier
        self.embed_dim = embed_dim
        self.head = head
        if head == "junction":
            self.feature_dim = num_slots - 1
            self.junction: nn.Module = nn.Linear(embed_dim, self.feature_dim, bias=False)
        else:
            self.feature_dim = embed_dim
            self.junction = nn.Identity()
        self.classifier: nn.Linear | None = None
        self.simplex_norm = simplex_norm
        if simplex_norm not in SIMPLEX_NORMS:
            raise ValueError(f"simplex_norm must be one of {SIMPLEX_NORMS}, got {simplex_norm!r}")
        if classifier == "learnable":
            self.classifier = nn.Linear(self.feature_dim, num_active_classes, bias=False)
        self.config: dict[str, Any] = dict(config or {})
        self.config.update(num_slots=num_slots, classifier=classifier, simplex_norm=simplex_norm)
        if head != "junction":  # absent means junction: configs saved before heads existed load unchanged
            self.config["head"] = head
        if classifier == "learnable":
            self.config["num_active_classes"] = num_active_classes

    @property
    def num_active_classes(self) -> int:
        """Number of logits: K for simplex, the current classifier rows for learnable."""
        return self.num_slots if self.classifier is None else self.classifier.out_features

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Backbone embedding ``(B, m)`` of images ``(B, C, H, W)``."""
        return self.backbone(x)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Unnormalised junction output ``(B, K-1)``."""
        return self.junction(self.embed(x))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """L2-normalised junction output ``(B, K-1)`` (unit rows): the retrieval feature."""
        return F.normalize(self.project(x), dim=1)

    def logits_from_projection(self, projection: torch.Tensor) -> torch.Tensor:
        """Logits for a given junction output ``(B, K-1)``: ``(B, K)`` simplex or ``(B, n_active)`` learnable."""
        if self.classifier is not None:
            return self.classifier(projection)
        # at least fp32 whatever the autocast dtype: the closed form sums K-1 entries per row (fp64 stays fp64)
        wide = projection if projection.dtype == torch.float64 else projection.float()
        return dsimplex_logits(wide, self.num_slots, norm=self.simplex_norm)

    def prototype_rows(self, rows) -> torch.Tensor:
        """Prototypes of the slots ``rows`` (0-based), fp32 ``(len(rows), K-1)`` on the junction's device, built
        from their closed form (d-Simplex classifier only)."""
        if self.classifier_kind != "simplex":
            raise ValueError("prototype_rows needs classifier='simplex'; a learnable classifier has weights instead")
        device = self.junction.weight.device if isinstance(self.junction, nn.Linear) else None
        return dsimplex_rows(self.num_slots, rows, norm=self.simplex_norm, device=device)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores of images ``(B, C, H, W)``; see ``logits_from_projection`` for the shape."""
        return self.logits_from_projection(self.project(x))

    def forward(self, x: torch.Tensor) -> ModelOutput:
        """All outputs of images ``(B, C, H, W)`` from one backbone pass; see :class:`ModelOutput` for the shapes."""
        embedding = self.embed(x)
        projection = self.junction(embedding)
        return ModelOutput(
            embedding=embedding,
            projection=projection,
            features=F.normalize(projection, dim=1),
            logits=self.logits_from_projection(projection),
        )

    def expand_classes(self, n_total: int) -> None:
        """Grow the learnable classifier to ``n_total`` rows, keeping rows ``0..n_old-1`` unchanged.

        New rows get nn.Linear's default initialisation. The classifier is a new Parameter: rebuild the optimiser.
        """
        if self.classifier is None:
            raise ValueError("expand_classes needs classifier='learnable'; the simplex classifier is fixed at K slots")
        old = self.classifier
        n_total = check_int("n_total (at least the current classes)", n_total, old.out_features)
        if n_total == old.out_features:
            return
        grown = nn.Linear(self.feature_dim, n_total, bias=False, device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            grown.weight[: old.out_features].copy_(old.weight)
        self.classifier = grown
        self.config["num_active_classes"] = n_total


def create_model(
    backbone: str,
    num_slots: int,
    classifier: str = "simplex",
    backbone_config: dict | None = None,
    num_active_classes: int = 0,
    simplex_norm: str = "row",
    head: str = "junction",
    **extra_config: Any,
) -> CompatModel:
    """Build a CompatModel with a registered backbone (random weights).

    ``extra_config`` entries (JSON-serialisable, e.g. ``pretrained_slots``) are stored in ``model.config`` as is.
    """
    backbone_config = dict(backbone_config or {})
    module = create_backbone(backbone, **backbone_config)
    config = {"backbone": backbone, "backbone_config": backbone_config, **extra_config}
    return CompatModel(
        module,
        num_slots,
        classifier=classifier,
        config=config,
        num_active_classes=num_active_classes,
        simplex_norm=simplex_norm,
        head=head,
    )


def model_from_config(config: dict) -> CompatModel:
    """Rebuild a (randomly initialised) CompatModel from ``model.config``; raises KeyError naming a missing field."""
    for field in ("backbone", "num_slots"):
        if field not in config:
            raise KeyError(f"model config lacks {field!r}; got fields {sorted(config)}")
    rest = {k: v for k, v in config.items() if k not in ("backbone", "num_slots", "classifier", "backbone_config",
                                                         "num_active_classes", "simplex_norm", "format_version", "head")}
    return create_model(
        config["backbone"],
        int(config["num_slots"]),
        classifier=config.get("classifier", "simplex"),
        backbone_config=config.get("backbone_config") or {},
        num_active_classes=int(config.get("num_active_classes", 0)),
        simplex_norm=config.get("simplex_norm", "row"),
        head=config.get("head", "junction"),
        **rest,
    )


def learnable_from_simplex(model: CompatModel, num_classes: int, head: str = "backbone") -> CompatModel:
    """A learnable-classifier model computing exactly the logits of a d-Simplex model on its first ``num_classes``
    slots: the third-party model published once (d-Simplex head), adopted by a learnable-classifier method.

    The backbone is copied. head "junction": the junction is copied and the classifier rows are the prototypes of
    slots 0..num_classes-1, shape (num_classes, K-1). head "backbone": no junction; the rows are those prototypes
    composed with the junction, ``P[:n] @ J`` of shape (num_classes, m), since ``(x J^T) P^T = x (P J)^T``. The result
    is a new model on the same device; ``model`` is left unchanged.
    """
    if not isinstance(model, CompatModel) or model.classifier_kind != "simplex":
        kind = getattr(model, "classifier_kind", type(model).__name__)
        raise ValueError(f"learnable_from_simplex needs a d-Simplex CompatModel, got classifier {kind!r}")
    num_classes = check_int("num_classes (pre-trained slots to keep)", num_classes, 1)
    if num_classes > model.num_slots:
        raise ValueError(f"num_classes {num_classes} exceeds the model's K={model.num_slots} slots")
    keep = {k: v for k, v in model.config.items()
            if k not in ("num_slots", "classifier", "simplex_norm", "num_active_classes", "head")}
    converted = CompatModel(copy.deepcopy(model.backbone), model.num_slots, classifier="learnable", config=keep,
                            num_active_classes=num_classes, simplex_norm=model.config.get("simplex_norm", "row"),
                            head=head)
    prototypes = model.prototype_rows(np.arange(num_classes)).double()
    junction = model.junction.weight.detach().double()
    with torch.no_grad():
        if head == "junction":
            converted.junction.weight.copy_(junction)
            rows = prototypes
        else:
            rows = prototypes @ junction
        converted.classifier.weight.copy_(rows.to(converted.classifier.weight.dtype))
    return converted.to(junction.device)


def frozen_copy(model: nn.Module) -> nn.Module:
    """Deep copy in eval mode with every parameter ``requires_grad=False`` (the "old model" of a training step)."""
    old = copy.deepcopy(model)
    old.eval()
    old.requires_grad_(False)
    return old


def _state_for_saving(model: nn.Module) -> dict[str, torch.Tensor]:
    # safetensors rejects views into shared storage and non-contiguous tensors; clone only those that need it.
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        pointer = tensor.untyped_storage().data_ptr() if tensor.numel() else -1
        if not tensor.is_contiguous() or pointer in seen:
            tensor = tensor.contiguous().clone()
        if pointer != -1:
            seen.add(pointer)
        state[name] = tensor
    return state


def save_model(model: CompatModel, uri: str) -> str:
    """Write ``model.safetensors`` + ``config.json`` into the folder ``uri`` (local path or ``s3://``).

    Returns ``uri``. The d-Simplex prototypes are not stored: ``load_model`` rebuilds them from ``num_slots``.
    """
    files = model_to_bytes(model)
    fs, path = cio.resolve(uri)
    if isinstance(fs, LocalFileSystem):
        # Object stores have no folders (a prefix exists once an object is written under it).
        fs.create_dir(path, recursive=True)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        with fs.open_output_stream(f"{path}/{name}") as handle:
            handle.write(files[name])
    return str(uri)


def model_to_bytes(model: CompatModel) -> dict[str, bytes]:
    """The files ``save_model`` writes, in memory: {config.json: ..., model.safetensors: ...} (a run store commits
    them as blobs; ``model_from_bytes`` reads them back)."""
    from safetensors.torch import save as save_safetensors

    if not isinstance(model, CompatModel):
        raise TypeError(f"save_model expects a CompatModel, got {type(model).__name__}")
    config = dict(model.config, format_version=FORMAT_VERSION)
    try:
        config_text = json.dumps(config, indent=2, sort_keys=True)
    except TypeError as error:
        raise ValueError(f"model.config must be JSON-serialisable to save it: {error}") from error
    return {CONFIG_FILE: config_text.encode("utf-8"),
            WEIGHTS_FILE: save_safetensors(_state_for_saving(model), metadata={"format": "pt"})}


def load_model(uri: str, map_location: str | torch.device = "cpu") -> CompatModel:
    """Rebuild a model saved by ``save_model`` from the folder ``uri``; every saved tensor must match by name/shape."""
    config_uri = cio.join(str(uri), CONFIG_FILE)
    weights_uri = cio.join(str(uri), WEIGHTS_FILE)
    for needed in (config_uri, weights_uri):
        if not cio.exists(needed):
            raise FileNotFoundError(f"model folder {uri} lacks {needed.rsplit('/', 1)[-1]} (expected "
                                    f"{WEIGHTS_FILE} and {CONFIG_FILE}, as written by save_model)")
    return model_from_bytes(cio.read_bytes(config_uri), cio.read_bytes(weights_uri), str(uri), map_location)


def model_from_bytes(config_bytes: bytes, weights_bytes: bytes, where: str = "<bytes>",
                     map_location: str | torch.device = "cpu") -> CompatModel:
    """Rebuild a model from the contents of its config.json and model.safetensors (e.g. blobs already read and
    verified by a run store); ``where`` names them in errors. The head's shapes in the weights' header are checked
    against the config before anything is built (a config with a huge ``num_slots`` allocates nothing), and every
    tensor must be floating point and finite."""
    from safetensors.torch import load as load_safetensors

    config_uri = cio.join(where, CONFIG_FILE)
    weights_uri = cio.join(where, WEIGHTS_FILE)
    try:
        config = json.loads(config_bytes.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_uri} is not valid JSON: {error}") from error
    version = config.get("format_version", FORMAT_VERSION)
    if version > FORMAT_VERSION:
        raise ValueError(f"{config_uri} has format_version {version}; this code reads up to {FORMAT_VERSION}")
    for field in ("backbone", "num_slots"):
        if field not in config:
            raise KeyError(f"{config_uri} lacks {field!r}; got fields {sorted(config)}")
    check_head_against_header(config, safetensors_header(weights_bytes, weights_uri), config_uri, weights_uri)
    state = load_safetensors(weights_bytes)
    model = model_from_config(config)
    check_weight_values(state, weights_uri, {k: v.is_floating_point() for k, v in model.state_dict().items()})
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"{weights_uri} does not match its config: missing {result.missing_keys[:10]}, "
            f"unexpected {result.unexpected_keys[:10]}"
        )
    return model.to(map_location)
