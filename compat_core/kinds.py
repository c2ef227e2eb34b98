"""The named choices of the algorithms, each defined once as a ``Literal`` type with its values as a tuple.

Config schemas, command-line choices and the algorithms' own argument checks all use these definitions, so a new
choice is added in one place. This module imports nothing heavy (no torch): configs and ``--help`` use it.
"""
from __future__ import annotations

from typing import Literal, get_args

# classifier family of a model: the fixed d-Simplex (K pre-allocated slots) or a learnable, growing linear layer
ClassifierFamily = Literal["simplex", "learnable"]
CLASSIFIERS: tuple[str, ...] = get_args(ClassifierFamily)

# InfoNCE masking of the HOC loss (SPEC section 4): positive kept and same-class negatives dropped ("standard"),
# same-class entries multiplied by zero as the public code ("reference"), Eq. 4 as printed ("paper")
InfoNceMasking = Literal["standard", "reference", "paper"]
INFO_NCE_MASKINGS: tuple[str, ...] = get_args(InfoNceMasking)

# adapters between an old and a new embedding space: query adapters map new -> old, gallery adapters old -> new
QueryAdapterKind = Literal["procrustes", "affine", "mlp"]
GalleryAdapterKind = Literal["fct", "fan"]
AdapterKind = Literal[QueryAdapterKind, GalleryAdapterKind]
QUERY_ADAPTERS: tuple[str, ...] = get_args(QueryAdapterKind)
GALLERY_ADAPTERS: tuple[str, ...] = get_args(GalleryAdapterKind)
ADAPTER_KINDS: tuple[str, ...] = QUERY_ADAPTERS + GALLERY_ADAPTERS

__all__ = ["ADAPTER_KINDS", "AdapterKind", "CLASSIFIERS", "ClassifierFamily", "GALLERY_ADAPTERS",
           "GalleryAdapterKind", "INFO_NCE_MASKINGS", "InfoNceMasking", "QUERY_ADAPTERS", "QueryAdapterKind"]
