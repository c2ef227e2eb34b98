"""Loading third-party weights into a backbone or a CompatModel, with a report of what matched.

Sources: a local path, an object-store URI (``s3://``, through ``compat_core.io``), a URI whose scheme has a
registered resolver (``register_uri_resolver("models", fn)``: the cluster layer maps MLflow ``models:/`` and
``runs:/`` URIs to local files; compat_core never imports mlflow), a folder holding ``model.safetensors``, or an
in-memory state dict. Files are read with safetensors or ``torch.load(weights_only=True)`` only.

Key handling, in order:
1. unwrap checkpoint containers (``state_dict``, ``model``, ``net``, ``module``, ``teacher``, ``model_ema``);
2. strip wrapper prefixes shared by every key (``module.`` from DDP, ``_orig_mod.`` from torch.compile, ``model.``);
3. remap a known layout (auto-detected, or forced with ``key_map``):
   - ``meta_dinov3``: Meta's DINOv3 -> timm Eva names (``storage_tokens`` -> ``reg_token``, ``ls1.gamma`` ->
     ``gamma_1``, ``ls2.gamma`` -> ``gamma_2``; ``qkv.bias`` split into timm's ``q_bias``/``v_bias`` when the target
     has them, else dropped when its q and v parts are zero (Meta's distilled ViTs) and listed as unexpected when
     not; ``rope_embed.periods`` dropped because timm recomputes it; ``mask_token``, ``*.bias_mask``,
     ``local_cls_norm.*`` are pre-training only);
   - ``meta_dinov2``: Meta's DINOv2 -> timm ViT (``register_tokens`` -> ``reg_token``; ``mask_token`` dropped);
   - ``iamcl2r``: the public IAM-CL2R reference (``fc1`` -> ``junction``, ``fc2`` -> ``classifier`` or dropped for a
     fixed d-Simplex, ``layerN.blocks.i`` -> ``layerN.i``);
4. match each key to the target as is, with ``backbone.`` added (CompatModel target) or removed (bare backbone);
   a ViT ``pos_embed`` with another grid is resampled with timm's interpolation.
Strict by default: every parameter and buffer of the target receives a tensor, and every source key (after the
layout's documented conversions, each recorded in ``LoadReport.dropped`` with its reason) lands in the target; else a
ValueError names up to 10 missing, unexpected and mis-shaped keys and their counts before anything is loaded. Known
extras are listed explicitly with ``ignore`` (glob patterns; each ignored key is recorded in the report). A
CompatModel target whose source holds only backbone keys (a published backbone checkpoint) keeps its junction and
classifier as initialised: those are reported as ``fresh``, never as loaded.
"""
from __future__ import annotations

import fnmatch
import hashlib
import io
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from compat_core import io as cio
from compat_core.models.weight_checks import check_weight_values
from compat_core.models.weight_sources import (
    register_uri_resolver,
    resolve_weights_source,
    sha256_of,
)

_CONTAINER_KEYS = ("state_dict", "model", "net", "module", "teacher", "model_ema")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.")
LAYOUTS = ("auto", "none", "meta_dinov3", "meta_dinov2", "iamcl2r")


@dataclass
class LoadReport:
    """What ``load_external_weights`` did. Key names are target-model names unless said otherwise."""

    source: str
    format: str  # "safetensors", "torch" or "state_dict" (in-memory)
    layout: str  # the key layout that was applied
    sha256: str | None  # hex digest of the file read (None for in-memory sources)
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # target keys that received nothing
    unexpected: list[str] = field(default_factory=list)  # source keys (after renaming) with no target
    shape_mismatches: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # name, src, dst
    dropped: dict[str, str] = field(default_factory=dict)  # source key -> why it was intentionally skipped
    resampled: list[str] = field(default_factory=list)  # target keys interpolated to a new shape
    slot_assignment: dict[str, int] = field(default_factory=dict)  # third-party class id -> d-Simplex slot (0-based)
    pretrained_class_ids: list[Any] = field(default_factory=list)  # class id at slot i, i = 0..n-1
    ignored: list[str] = field(default_factory=list)  # source or target keys matched by the ``ignore`` patterns
    unused_ignore: list[str] = field(default_factory=list)  # ``ignore`` patterns that matched no key
    fresh: list[str] = field(default_factory=list)  # head keys of a CompatModel kept as initialised (backbone source)
    target_keys: int = 0  # parameters and buffers in the target's state dict

    @property
    def ok(self) -> bool:
        """True when every target key was loaded and nothing was left over or mis-shaped."""
        return not (self.missing or self.unexpected or self.shape_mismatches)

    def summary(self) -> str:
        """One line for logs."""
        return (
            f"{self.source}: loaded {len(self.loaded)}/{self.target_keys}, missing {len(self.missing)}, unexpected "
            f"{len(self.unexpected)}, shape mismatches {len(self.shape_mismatches)}, dropped {len(self.dropped)}, "
            f"ignored {len(self.ignored)}, fresh {len(self.fresh)} (layout {self.layout}, format {self.format})"
        )

    def problems(self, limit: int = 10) -> str:
        """What does not fit, each kind with its count and up to ``limit`` names (empty when ``ok``)."""
        parts = []
        for label, names in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("shape mismatches (name, source, target)", self.shape_mismatches)):
            if names:
                shown = ", ".join(str(n) for n in names[:limit])
                parts.append(f"{len(names)} {label}: {shown}{' ...' if len(names) > limit else ''}")
        return "; ".join(parts)

    def to_json(self) -> dict:
        """Compact JSON form for stage records and tracking: counts, digests and up to 10 names of each kind."""
        return {
            "source": self.source, "sha256": self.sha256, "format": self.format, "layout": self.layout,
            "target_keys": self.target_keys, "loaded": len(self.loaded), "missing": self.missing[:10],
            "missing_count": len(self.missing), "unexpected": self.unexpected[:10],
            "unexpected_count": len(self.unexpected),
            "shape_mismatches": [list(map(str, m)) for m in self.shape_mismatches[:10]],
            "shape_mismatch_count": len(self.shape_mismatches), "dropped": dict(sorted(self.dropped.items())[:10]),
            "dropped_count": len(self.dropped), "ignored": self.ignored[:10], "ignored_count": len(self.ignored),
            "unused_ignore": list(self.unused_ignore), "fresh": self.fresh[:10], "fresh_count": len(self.fresh),
            "resampled": self.resampled[:10],
        }


def _read_state(uri: str, data: bytes | None) -> tuple[dict[str, Any], str]:
    """Deserialize a safetensors or torch file (``data`` given for remote files, else read locally)."""
    from safetensors.torch import load as load_safetensors_bytes
    from safetensors.torch import load_file

    head = data[:16] if data is not None else _local_prefix(uri, 16)
    is_safetensors = uri.endswith(".safetensors") or (len(head) > 8 and head[8:9] == b"{")
    try:
        if is_safetensors:
            if data is None:
                return dict(load_file(uri, device="cpu")), "safetensors"
            return dict(load_safetensors_bytes(data)), "safetensors"
        buffer: Any = io.BytesIO(data) if data is not None else uri
        # weights_only refuses pickled code: only tensors and plain containers come back.
        loaded = torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - re-raised with the file name and the expected formats
        raise ValueError(f"cannot read weights from {uri}: expected a safetensors file or a torch state dict "
                         f"readable with weights_only=True ({type(error).__name__}: {error})") from error
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{uri} holds a {type(loaded).__name__}, expected a state dict (mapping name -> tensor)")
    return dict(loaded), "torch"


def _local_prefix(uri: str, size: int) -> bytes:
    with cio.open_input(uri) as handle:
        return handle.read(size)


def _unwrap(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Descend into common checkpoint containers until a flat name -> tensor mapping remains."""
    current: Mapping[str, Any] = state
    for _ in range(4):
        if current and all(isinstance(v, torch.Tensor) for v in current.values()):
            break
        inner = next((current[k] for k in _CONTAINER_KEYS if isinstance(current.get(k), Mapping)), None)
        if inner is None:
            break
        current = inner
    tensors = {k: v for k, v in current.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError(f"no tensors found in the checkpoint (top-level keys: {sorted(state)[:20]}); expected a "
                         f"state dict, possibly under one of {_CONTAINER_KEYS}")
    return tensors


def strip_wrapper_prefixes(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove ``module.`` / ``_orig_mod.`` / ``model.`` while *every* key carries the same one."""
    state = dict(state)
    changed = True
    while changed and state:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in state):
                state = {k[len(prefix):]: v for k, v in state.items()}
                changed = True
    return state


def detect_layout(keys: Sequence[str]) -> str:
    """Guess the checkpoint layout from its key names (one of ``LAYOUTS`` minus ``auto``)."""
    names = [k.removeprefix("backbone.") for k in keys]
    if any(k == "storage_tokens" or k.startswith("rope_embed.") for k in names):
        return "meta_dinov3"
    if any(k.endswith(".ls1.gamma") for k in names) and "mask_token" in names:
        return "meta_dinov2"
    if "fc1.weight" in names and "fc2.weight" in names and any(k.startswith("backbone.") for k in keys):
        return "iamcl2r"
    return "none"


def _remap_meta_dinov3(
    state: dict[str, torch.Tensor], target_keys: set[str], report: LoadReport
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        base = key.rsplit(".", 1)[-1]
        if key.endswith("mask_token") or base == "bias_mask" or ".local_cls_norm." in f".{key}":
            report.dropped[key] = "pre-training only (mask token / bias mask / local-crop norm)"
            continue
        if "rope_embed." in key:
            report.dropped[key] = "RoPE periods are recomputed by timm from the architecture"
            continue
        if key.endswith("attn.qkv.bias"):
            q_name = key[: -len("qkv.bias")] + "q_bias"
            if _has_target(q_name, target_keys):
                q_bias, _k_bias, v_bias = value.chunk(3, dim=-1)
                out[q_name] = q_bias
                out[key[: -len("qkv.bias")] + "v_bias"] = v_bias
                report.dropped[key] = "split into q_bias/v_bias (timm keeps the key bias fixed at zero)"
            elif not any(torch.count_nonzero(part) for part in value.chunk(3, dim=-1)[::2]):
                # Meta's bias_mask zeroes the key part in its own forward, so only q and v carry information
                report.dropped[key] = "target has no qkv bias; the source's q and v parts are zero"
            else:  # dropping it would change the features: listed (refused when strict), never silently lost
                report.unexpected.append(key)
            continue
        renamed = key.replace("storage_tokens", "reg_token")
        renamed = re.sub(r"\.ls1\.gamma$", ".gamma_1", renamed)
        renamed = re.sub(r"\.ls2\.gamma$", ".gamma_2", renamed)
        out[renamed] = value
    return out


def _remap_meta_dinov2(
    state: dict[str, torch.Tensor], target_keys: set[str], report: LoadReport
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith("mask_token"):
            report.dropped[key] = "pre-training only (mask token)"
            continue
        out[key.replace("register_tokens", "reg_token")] = value
    return out


def _remap_iamcl2r(
    state: dict[str, torch.Tensor], target_keys: set[str], report: LoadReport
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == "fc1.weight":
            out["junction.weight"] = value
            continue
        if key == "fc2.weight":
            if "classifier.weight" in target_keys:
                out["classifier.weight"] = value
            else:
                report.dropped[key] = "fixed d-Simplex classifier: prototypes are rebuilt from K, not loaded"
            continue
        out[re.sub(r"(layer\d+)\.blocks\.(\d+)\.", r"\1.\2.", key)] = value
    return out


_REMAPPERS = {"meta_dinov3": _remap_meta_dinov3, "meta_dinov2": _remap_meta_dinov2, "iamcl2r": _remap_iamcl2r}


def _has_target(name: str, target_keys: set[str]) -> bool:
    return name in target_keys or f"backbone.{name}" in target_keys or name.removeprefix("backbone.") in target_keys


def _apply_key_map(state: dict[str, torch.Tensor], key_map: Mapping[str, str] | Callable[[str], str | None],
                   report: LoadReport) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if callable(key_map):
            renamed = key_map(key)
        else:
            renamed = key
            # Longest prefix wins so that {"a.": ..., "a.b.": ...} behaves predictably.
            for old in sorted(key_map, key=len, reverse=True):
                if key.startswith(old):
                    renamed = key_map[old] + key[len(old):]
                    break
        if renamed is None:
            report.dropped[key] = "dropped by key_map"
            continue
        out[renamed] = value
    return out


def _resample_pos_embed(value: torch.Tensor, module: nn.Module, target_shape: torch.Size) -> torch.Tensor | None:
    """Interpolate a ViT absolute position embedding to the target grid (None when it is not that case)."""
    patch_embed = getattr(module, "patch_embed", None)
    if value.ndim != 3 or len(target_shape) != 3 or value.shape[-1] != target_shape[-1] or patch_embed is None:
        return None
    from timm.layers import resample_abs_pos_embed

    prefix_tokens = 0 if getattr(module, "no_embed_class", False) else int(getattr(module, "num_prefix_tokens", 1))
    return resample_abs_pos_embed(value, new_size=list(patch_embed.grid_size), num_prefix_tokens=prefix_tokens,
                                  verbose=False)


def _assign_slots(slot_map: Sequence[Any] | int, num_slots: int | None, report: LoadReport) -> None:
    """Third-party classes take d-Simplex slots left to right: the i-th class id (0-based) gets slot i."""
    if isinstance(slot_map, int) and not isinstance(slot_map, bool):
        class_ids: list[Any] = list(range(slot_map))
    else:
        class_ids = list(slot_map)
    if not class_ids:
        raise ValueError("slot_map must name at least one third-party class (or give their count)")
    if len({str(c) for c in class_ids}) != len(class_ids):
        raise ValueError("slot_map lists a class id twice; every third-party class needs its own slot")
    if num_slots is not None and len(class_ids) > num_slots:
        raise ValueError(f"slot_map has {len(class_ids)} classes but the model has only K={num_slots} slots")
    report.slot_assignment = {str(class_id): slot for slot, class_id in enumerate(class_ids)}
    report.pretrained_class_ids = [c.item() if hasattr(c, "item") else c for c in class_ids]


class _IgnoreRules:
    """The ``ignore`` glob patterns of a load; remembers which ones matched a key."""

    def __init__(self, patterns: Sequence[str] | str) -> None:
        self.patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        for pattern in self.patterns:
            if not isinstance(pattern, str) or not pattern:
                raise ValueError(f"ignore: expected non-empty key patterns (glob, e.g. 'dino_head.*'), got {pattern!r}")
        self.used: set[str] = set()

    def __call__(self, name: str) -> bool:
        hits = [p for p in self.patterns if fnmatch.fnmatchcase(name, p)]
        self.used.update(hits)
        return bool(hits)

    def unused(self) -> list[str]:
        return [p for p in self.patterns if p not in self.used]


def _read_source(source: str | os.PathLike | Mapping[str, Any],
                 sha256: str | None) -> tuple[dict[str, Any], str, str, str | None]:
    """(raw state, format, source name, sha256 of the file or None) of a weights source, the digest checked."""
    if isinstance(source, Mapping):
        if sha256 is not None:
            raise ValueError("sha256 applies to a file; an in-memory state dict has no file to hash")
        return dict(source), "state_dict", "<state dict>", None
    source_name = resolve_weights_source(os.fspath(source))
    data = cio.read_bytes(source_name) if cio.is_remote(source_name) else None
    digest = hashlib.sha256(data).hexdigest() if data is not None else sha256_of(source_name)
    if sha256 is not None and digest.lower() != sha256.strip().lower():
        raise ValueError(f"sha256 mismatch for {source_name}: expected {sha256.strip().lower()}, actual {digest}")
    raw, fmt = _read_state(source_name, data)
    return raw, fmt, source_name, digest


def _layout_of(state: Mapping[str, Any], key_map: Any) -> str:
    """The key layout to apply: detected (``None`` / ``"auto"``), named, or ``"custom"`` for a mapping/callable."""
    if key_map is None or key_map == "auto":
        return detect_layout(list(state))
    if isinstance(key_map, str):
        if key_map not in LAYOUTS:
            raise ValueError(f"key_map layout must be one of {LAYOUTS}, a prefix mapping or a callable; "
                             f"got {key_map!r}")
        return key_map
    return "custom"


def _remap(state: dict[str, torch.Tensor], layout: str, key_map: Any, target_keys: set[str],
           report: LoadReport) -> dict[str, torch.Tensor]:
    """``state`` renamed to the target's names by ``layout`` (conversions recorded in ``report.dropped``)."""
    if layout == "iamcl2r":
        return _REMAPPERS[layout](state, target_keys, report)
    if layout in _REMAPPERS:  # Meta layouts name the ViT's own parameters: a DINO "backbone." wrapper goes first
        return _REMAPPERS[layout]({k.removeprefix("backbone."): v for k, v in state.items()}, target_keys, report)
    if layout == "custom":
        return _apply_key_map(state, key_map, report)
    return state


def _match(state: Mapping[str, torch.Tensor], target_state: Mapping[str, torch.Tensor], backbone_module: nn.Module,
           is_compat: bool, ignored: _IgnoreRules, report: LoadReport) -> dict[str, torch.Tensor]:
    """Target name -> tensor for each source key that lands in the target (a ViT ``pos_embed`` resampled to the
    grid of ``backbone_module``); ignored, unexpected and mis-shaped keys go to the report."""
    target_keys = set(target_state)
    matched: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        candidates = [key, f"backbone.{key}"] if is_compat else [key, key.removeprefix("backbone.")]
        name = next((c for c in candidates if c in target_keys), None)
        if ignored(key) or (name is not None and ignored(name)):
            report.ignored.append(key)
            continue
        if name is None:
            report.unexpected.append(key)
            continue
        target_shape = target_state[name].shape
        if value.shape != target_shape:
            resampled = None
            if name.rsplit(".", 1)[-1] == "pos_embed":
                resampled = _resample_pos_embed(value, backbone_module, target_shape)
            if resampled is None or resampled.shape != target_shape:
                report.shape_mismatches.append((name, tuple(value.shape), tuple(target_shape)))
                continue
            value = resampled
            report.resampled.append(name)
        matched[name] = value
    return matched


def _account_targets(report: LoadReport, target_keys: set[str], matched: Mapping[str, torch.Tensor], is_compat: bool,
                     ignored: _IgnoreRules) -> None:
    """Fill the report's loaded / fresh / missing / ignored lists from the target keys the match left unfilled."""
    report.loaded = sorted(matched)
    report.target_keys = len(target_keys)
    head_keys = {k for k in target_keys if not k.startswith("backbone.")} if is_compat else set()
    supplied = set(matched) | {name for name, _, _ in report.shape_mismatches}
    if head_keys and not (supplied & head_keys):
        report.fresh = sorted(head_keys)  # a backbone checkpoint: the head starts as initialised
    unfilled = sorted(target_keys - set(matched) - set(report.fresh))
    report.missing = [k for k in unfilled if not ignored(k)]
    report.ignored = sorted(report.ignored + [k for k in unfilled if k not in report.missing])
    report.unused_ignore = ignored.unused()
    report.unexpected.sort()


def load_external_weights(
    model_or_backbone: nn.Module,
    source: str | os.PathLike | Mapping[str, Any],
    sha256: str | None = None,
    strict: bool = True,
    key_map: str | Mapping[str, str] | Callable[[str], str | None] | None = None,
    slot_map: Sequence[Any] | int | None = None,
    ignore: Sequence[str] = (),
) -> LoadReport:
    """Load third-party weights into ``model_or_backbone`` in place and report what matched (see module doc).

    ``sha256``: expected hex digest of the file; a mismatch raises ValueError naming both digests.
    ``key_map``: a layout name from ``LAYOUTS`` (default auto-detection), a prefix mapping ``{old: new}``
    applied after wrapper stripping, or a callable ``key -> new key | None`` (None drops the key).
    ``slot_map``: the third-party model's class ids in its output order (or their count n); they take d-Simplex
    slots 0..n-1 left to right. Recorded in the report and, for a CompatModel, in ``model.config["pretrained_slots"]``.
    ``strict`` (default): raise ValueError with the counts and up to 10 names of missing / unexpected /
    mis-shaped keys, before anything is loaded; ``strict=False`` loads what matches (the report says what did not).
    ``ignore``: glob patterns (``fnmatch``) of keys known not to fit: a source key (after renaming) or a target key
    matching one is neither loaded nor counted as unexpected / missing, and is listed in ``report.ignored``.
    """
    ignored = _IgnoreRules(ignore)
    raw, fmt, source_name, digest = _read_source(source, sha256)
    state = strip_wrapper_prefixes(_unwrap(raw))
    target_state = model_or_backbone.state_dict()
    is_compat = hasattr(model_or_backbone, "junction") and hasattr(model_or_backbone, "backbone")
    layout = _layout_of(state, key_map)
    report = LoadReport(source=str(source_name), format=fmt, layout=layout, sha256=digest)
    state = _remap(state, layout, key_map, set(target_state), report)
    backbone_module = getattr(model_or_backbone, "backbone", model_or_backbone) if is_compat else model_or_backbone
    matched = _match(state, target_state, backbone_module, is_compat, ignored, report)
    check_weight_values(matched, f"weights file {report.source}",
                        {name: target_state[name].is_floating_point() for name in matched})
    _account_targets(report, set(target_state), matched, is_compat, ignored)
    if slot_map is not None:
        _assign_slots(slot_map, getattr(model_or_backbone, "num_slots", None), report)
    if strict and not report.ok:
        raise ValueError(
            f"weights from {report.source} do not fit the model ({len(report.loaded)} of {report.target_keys} "
            f"target keys matched): {report.problems()}. List known extras under the config's ignore keys (glob "
            f"patterns) to leave them out explicitly")
    model_or_backbone.load_state_dict(matched, strict=False)
    if slot_map is not None and isinstance(getattr(model_or_backbone, "config", None), dict):
        model_or_backbone.config["pretrained_slots"] = list(report.pretrained_class_ids)
    return report
