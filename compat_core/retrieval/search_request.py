"""Validation of a search service request (``POST /search``): JSON only, every error names the field.

A request is a JSON object with exactly one of ``embedding`` (a list of D numbers made by the serving model) or
``image`` (base64 of JPEG or PNG bytes), ``k`` (1 <= k <= min(max_k, gallery size), default 10) and optional
``model_version`` (the version that made ``embedding``; must be the one the service embeds with) and
``include_payload`` (bool). Nothing is unpickled: the body is parsed by ``json`` and images by Pillow, limited
in bytes and pixels before decoding.
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import math
from dataclasses import dataclass

import numpy as np

from compat_core.retrieval.mixed_gallery import unit_rows

__all__ = ["RequestError", "SearchLimits", "SearchRequest", "RequestField", "REQUEST_FIELDS", "FIELDS",
           "MODEL_VERSION_RULES", "parse_search_request", "decode_image"]

IMAGE_FORMATS = ("JPEG", "PNG")


@dataclass(frozen=True)
class RequestField:
    """One field of a ``POST /search`` body as the API reference states it: its JSON Schema (OpenAPI 3.1), unit
    and meaning. The parser accepts exactly these names (``FIELDS``) and the service's schema is built from them."""

    name: str
    schema: dict
    unit: str
    description: str


MODEL_VERSION_RULES = (
    "model_version is checked only for 'embedding' queries: omitted, the embedding is taken to be made by the "
    "version the service embeds with (the service cannot tell; an embedding of another model of the same width is "
    "searched as it is); equal to that version, it is searched; a version that embedded items of this index but "
    "is not the serving one (after `compat gate` moved the alias, or during a backfill) is refused with 409 "
    "(re-embed the query with the serving version, which /healthz names as model_version, or retry); a version "
    "the index does not hold is refused with 400. With 'image' it is refused with 400: the service embeds images "
    "itself with the serving version. Every answer names the version that searched (model_version).")

REQUEST_FIELDS = (
    RequestField("embedding", {"type": "array", "items": {"type": "number"}},
                 "D float32 components (D: the index's embedding width, /healthz dim); any length, normalised by "
                 "the service",
                 "The query's feature vector made by the serving model version: finite numbers, not all zero. "
                 "Exactly one of 'embedding' or 'image'."),
    RequestField("image", {"type": "string", "contentEncoding": "base64", "contentMediaType": "image/png"},
                 "base64 of JPEG or PNG file bytes; at most max_image_pixels decoded pixels (width x height) and "
                 "max_body_bytes bytes of request body",
                 "An image the service embeds with the serving model version: converted to the index's channels "
                 "and resized (bilinear) to its image shape. Exactly one of 'embedding' or 'image'."),
    RequestField("k", {"type": "integer", "minimum": 1, "default": 10},
                 "gallery items (count); 1 <= k <= min(max_k, gallery size)",
                 "How many nearest gallery items to return, best first."),
    RequestField("model_version", {"type": ["string", "integer"]},
                 "a model version of the served registered model (string; an integer is read as its string)",
                 "The version that made 'embedding', checked against the serving version. " + MODEL_VERSION_RULES),
    RequestField("include_payload", {"type": "boolean", "default": False},
                 "flag",
                 "Add each result's payload_uri (where the gallery item's bytes live)."),
)
FIELDS = tuple(field.name for field in REQUEST_FIELDS)


class RequestError(ValueError):
    """A rejected request: HTTP ``status`` (4xx), the JSON ``field`` at fault and a message saying what was expected."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.status = int(status)
        self.field = field
        self.message = message

    def to_json(self) -> dict:
        return {"error": {"status": self.status, "field": self.field, "message": self.message}}


@dataclass(frozen=True)
class SearchLimits:
    """Request limits: body bytes, k, image pixels (decoded width x height) and image side."""

    max_body_bytes: int = 4 << 20
    max_k: int = 100
    max_image_pixels: int = 4096 * 4096
    default_k: int = 10


@dataclass(frozen=True)
class SearchRequest:
    k: int
    embedding: np.ndarray | None = None     # (D,) float32
    image: np.ndarray | None = None         # (H, W, C) uint8, already the index's image shape
    model_version: str | None = None
    include_payload: bool = False


def _reject_constant(name: str):
    raise RequestError(400, "body", f"JSON constant {name} is not a number; send finite numbers only")


def _parse_json(body: bytes):
    """The JSON document of ``body``; RequestError 400 naming ``body`` for invalid JSON, integers of more digits
    than Python converts, and nesting deeper than the interpreter's recursion limit."""
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except RequestError:
        raise
    except RecursionError:
        raise RequestError(400, "body", "JSON nested too deeply; a search request is a flat object") from None
    except ValueError as error:   # JSONDecodeError, UnicodeDecodeError, an integer over the digit limit
        raise RequestError(400, "body", f"not valid JSON ({error})"[:300]) from None


def parse_search_request(body: bytes, content_type: str | None, *, dim: int, image_shape: tuple[int, int, int] | None,
                         gallery_size: int, limits: SearchLimits = SearchLimits()) -> SearchRequest:
    """The validated request, or RequestError (413 too large, 415 wrong media type, 400 otherwise)."""
    if content_type is not None and content_type.split(";")[0].strip().lower() not in ("application/json", ""):
        raise RequestError(415, "content-type", f"expected application/json, got {content_type!r}")
    if len(body) > limits.max_body_bytes:
        raise RequestError(413, "body", f"{len(body)} bytes is over the limit of {limits.max_body_bytes} bytes")
    if not body.strip():
        raise RequestError(400, "body", "empty; expected a JSON object with 'embedding' or 'image'")
    document = _parse_json(body)
    if not isinstance(document, dict):
        raise RequestError(400, "body", f"expected a JSON object, got a JSON {type(document).__name__}")
    unknown = sorted(set(document) - set(FIELDS))
    if unknown:
        raise RequestError(400, unknown[0], f"unknown field; valid fields are {list(FIELDS)}")
    has_embedding, has_image = "embedding" in document, "image" in document
    if not has_embedding and not has_image:
        raise RequestError(400, "embedding", "missing: give 'embedding' (a list of numbers) or 'image' (base64)")
    if has_embedding and has_image:
        raise RequestError(400, "image", "give either 'embedding' or 'image', not both")
    k = _parse_k(document.get("k", limits.default_k), gallery_size, limits)
    model_version = document.get("model_version")
    if model_version is not None and (not isinstance(model_version, (str, int)) or isinstance(model_version, bool)):
        raise RequestError(400, "model_version", f"expected a version string, got {type(model_version).__name__}")
    include_payload = document.get("include_payload", False)
    if not isinstance(include_payload, bool):
        raise RequestError(400, "include_payload", f"expected true or false, got {type(include_payload).__name__}")
    model_version = None if model_version is None else str(model_version)
    if has_embedding:
        return SearchRequest(k, embedding=_parse_embedding(document["embedding"], dim), model_version=model_version,
                             include_payload=include_payload)
    if model_version is not None:
        raise RequestError(400, "model_version", "only for 'embedding' queries (an image is embedded by the service)")
    if image_shape is None:
        raise RequestError(400, "image", "this index records no image shape; send 'embedding' instead")
    return SearchRequest(k, image=decode_image(document["image"], image_shape, limits), include_payload=include_payload)


def _parse_k(value, gallery_size: int, limits: SearchLimits) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, "k", f"expected an integer, got {type(value).__name__} {value!r}"[:200])
    top = min(limits.max_k, gallery_size)
    if not 1 <= value <= top:
        shown = str(value) if abs(value) < 10 ** 20 else f"an integer of {len(str(abs(value)))} digits"
        raise RequestError(400, "k", f"out of range: expected 1 <= k <= {top} (max_k {limits.max_k}, gallery size "
                                     f"{gallery_size}), got {shown}")
    return value


def _parse_embedding(value, dim: int) -> np.ndarray:
    if not isinstance(value, list):
        raise RequestError(400, "embedding", f"expected a list of {dim} numbers, got {type(value).__name__}")
    if len(value) != dim:
        raise RequestError(400, "embedding", f"wrong width: expected {dim} numbers (the index's embedding width), "
                                             f"got {len(value)}")
    for position, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise RequestError(400, "embedding", f"item {position} is {type(item).__name__}; expected a number")
        try:
            finite = math.isfinite(item)
        except OverflowError:   # an integer beyond float64
            finite = False
        if not finite:
            raise RequestError(400, "embedding", f"item {position} is not a finite float64 number")
    array = np.asarray(value, dtype=np.float64)
    if not np.all(np.isfinite(array.astype(np.float32))):
        raise RequestError(400, "embedding", "a value overflows float32")
    if not np.any(array):
        raise RequestError(400, "embedding", "all zeros; a zero vector has no direction to search")
    embedding = array.astype(np.float32)
    norm = float(np.linalg.norm(unit_rows(embedding[None]).double().numpy()))
    if not abs(norm - 1.0) < 1e-3:
        raise RequestError(400, "embedding", "the vector's float32 norm underflows or overflows (largest magnitude "
                                             f"{float(np.abs(array).max()):.3g}); scale it towards unit length")
    return embedding


def decode_image(value, image_shape: tuple[int, int, int], limits: SearchLimits = SearchLimits()) -> np.ndarray:
    """base64 JPEG/PNG -> uint8 (H, W, C) of the index's image shape (converted to its channels, resized bilinearly
    when the size differs)."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(value, str):
        raise RequestError(400, "image", f"expected a base64 string, got {type(value).__name__}")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as error:
        raise RequestError(400, "image", f"not valid base64 ({error})") from None
    if not data:
        raise RequestError(400, "image", "empty image")
    try:
        image = Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS))
    except UnidentifiedImageError:
        raise RequestError(415, "image", f"not a decodable image; expected one of {list(IMAGE_FORMATS)}") from None
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise RequestError(413, "image", f"{width}x{height} pixels is over the limit of {limits.max_image_pixels}")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise RequestError(400, "image", f"undecodable {image.format} data ({error})") from None
    height_out, width_out, channels = (int(x) for x in image_shape)
    image = image.convert("L" if channels == 1 else "RGB")
    if image.size != (width_out, height_out):
        image = image.resize((width_out, height_out), Image.Resampling.BILINEAR)
    array = np.asarray(image, dtype=np.uint8)
    return array[:, :, None] if array.ndim == 2 else array
