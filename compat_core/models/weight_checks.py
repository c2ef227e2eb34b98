"""Checks of weights before they reach a model: the values of every tensor (a floating-point dtype where the
model holds floats, every value finite) and, for a saved compatible model, the head's shapes in the safetensors
header against its config.json (read before anything is allocated, so a config with a huge ``num_slots`` is refused
at the cost of reading a few kB). Errors name the file and the tensor key."""
from __future__ import annotations

import json
import struct
from typing import Any, Mapping

import torch

from compat_core.models.backbones import embedding_width

_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def check_weight_values(state: Mapping[str, torch.Tensor], where: str,
                        floating: Mapping[str, bool] | None = None) -> None:
    """ValueError naming ``where`` and the key of the first tensor that is not floating point where a float is
    expected (``floating[key]``, default: every tensor but integer buffers such as BatchNorm's counter) or holds
    NaN / inf values (with their count)."""
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        wants_float = floating.get(key, True) if floating is not None else not key.endswith("num_batches_tracked")
        if not wants_float:
            continue
        if not (value.is_floating_point() or value.is_complex()):
            raise ValueError(f"{where}: tensor {key!r} has dtype {str(value.dtype).removeprefix('torch.')}; "
                             f"expected floating-point weights (float32, float16 or bfloat16), not quantised or "
                             f"integer values")
        bad = int((~torch.isfinite(value)).sum()) if value.numel() else 0
        if bad:
            raise ValueError(f"{where}: tensor {key!r} holds {bad} non-finite value(s) (NaN or inf) of "
                             f"{value.numel()}; the weights file is corrupt or comes from a diverged training run")


def safetensors_header(data: bytes, where: str) -> dict[str, Any]:
    """Tensor name -> {"dtype", "shape"} from the header of safetensors bytes, without reading any tensor;
    ValueError naming ``where`` when the bytes are not a safetensors file."""
    if len(data) < 8:
        raise ValueError(f"{where}: {len(data)} bytes, too short for a safetensors file")
    (size,) = struct.unpack("<Q", data[:8])
    if size == 0 or size > min(_HEADER_LIMIT, len(data) - 8):
        raise ValueError(f"{where}: not a safetensors file (header length {size} in a file of {len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + size].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where}: not a safetensors file (header is not JSON: {error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: not a safetensors file (header is a {type(header).__name__})")
    return {name: entry for name, entry in header.items() if name != "__metadata__" and isinstance(entry, dict)}


def head_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shapes of the head tensors a model built from ``config`` holds (junction ``(K-1, m)``, learnable
    classifier ``(n_active, d)``), from the numbers in the config and the backbone card only."""
    slots = int(config["num_slots"])
    head = config.get("head", "junction")
    width = embedding_width(config["backbone"], config.get("backbone_config") or {})
    feature_dim = slots - 1 if head == "junction" else width
    shapes: dict[str, tuple[int, ...]] = {}
    if head == "junction":
        shapes["junction.weight"] = (slots - 1, width)
    if config.get("classifier", "simplex") == "learnable":
        shapes["classifier.weight"] = (int(config.get("num_active_classes", 0)), feature_dim)
    return shapes


def check_head_against_header(config: Mapping[str, Any], header: Mapping[str, Any], config_uri: str,
                              weights_uri: str) -> None:
    """ValueError when the head ``config`` describes (its ``num_slots``, classifier size, backbone width) is not
    the one the weights file holds: refused before the model is built, so a wrong K allocates nothing."""
    for name, shape in head_shapes(config).items():
        entry = header.get(name)
        stored = tuple(entry.get("shape", ())) if entry else None
        if stored != shape:
            raise ValueError(
                f"{config_uri}: num_slots={config['num_slots']} (classifier {config.get('classifier', 'simplex')}, "
                f"backbone {config['backbone']}) makes {name} of shape {shape}, but {weights_uri} holds "
                f"{'no ' + name if stored is None else 'shape ' + str(stored)}; the config does not belong to these "
                f"weights")


__all__ = ["check_head_against_header", "check_weight_values", "head_shapes", "safetensors_header"]
