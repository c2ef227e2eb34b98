"""The models a search service serves: registry URIs resolved to versions, weights loaded from safetensors, the
adapter the gate installed with a version, and query embedding of images."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cluster.model_registry.versions import pinned_model_uri
from compat_core.data.transforms import make_transforms
from compat_core.models.compat_model import load_model
from compat_core.models.precision import prepare_batch
from compat_core.upgrades.adapters import load_adapter_bytes
from pipelines.config.model_uri import ModelUri, parse_model_uri

__all__ = ["DEFAULT_ALIAS", "resolve_model_ref", "load_served_model", "installed_adapter", "embed_images"]

DEFAULT_ALIAS = "champion"


def resolve_model_ref(client: Any, uri: str | ModelUri) -> ModelUri:
    """``models:/NAME@ALIAS`` | ``models:/NAME/VERSION`` | ``models:/NAME/latest`` -> the pinned ModelUri of the
    version behind it now."""
    return pinned_model_uri(client, uri if isinstance(uri, ModelUri) else parse_model_uri(uri, "--model"))


def load_served_model(resolver: Any, ref: ModelUri, device: str | torch.device = "cpu"):
    """The CompatModel of ``ref`` in eval mode (safetensors + JSON config, sha256-checked by the resolver)."""
    return load_model(resolver(ref.uri), map_location=device).eval()


def installed_adapter(client: Any, ref: ModelUri, alias: str = DEFAULT_ALIAS) -> tuple[str, str, Any] | None:
    """(adapter kind, version it maps to/from, Adapter) that ``compat gate --adapter`` installed when it moved
    ``alias`` to ``ref``, or None. The adapter file is the one logged with that gate run."""
    import tempfile
    from pathlib import Path

    version = client.get_model_version(ref.name, ref.version)
    tags = version.tags or {}
    kind = tags.get(f"gate.{alias}.adapter")
    run_id = tags.get(f"gate.{alias}.run_id")
    if not kind or not run_id:
        return None
    run = client.get_run(run_id)
    old_version = run.data.tags.get("previous_version")
    if not old_version:
        return None
    with tempfile.TemporaryDirectory(prefix="compat-serve-adapter-") as folder:
        path = client.download_artifacts(run_id, f"gate/adapter-{kind}.safetensors", folder)
        adapter = load_adapter_bytes(Path(path).read_bytes())
    return kind, str(old_version), adapter


def embed_images(model, images: np.ndarray, mean, std, device: str | torch.device = "cpu") -> torch.Tensor:
    """(B, D) fp32 features of uint8 images (B, H, W, C): the evaluation transform (normalise by mean/std), fp32."""
    transform = make_transforms((tuple(mean), tuple(std)), train=False)
    with torch.no_grad():
        batch = torch.from_numpy(np.ascontiguousarray(images)).to(device)
        inputs = prepare_batch(transform(batch), model)
        return model(inputs).features.float().cpu()
