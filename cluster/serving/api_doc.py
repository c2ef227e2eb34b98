"""The search service's API reference: an OpenAPI 3.1 document (``GET /openapi.json``) and a self-contained HTML
page generated from it (``GET /docs``; no script, style sheet or font from elsewhere).

The request body's fields come from ``compat_core.retrieval.search_request.REQUEST_FIELDS``, the list the parser
accepts; the response fields are listed here beside the code that writes them (``cluster.serving.app``,
``cluster.serving.state``). Examples are made for the state a replica serves (the index's embedding width and image
shape, the served model version), so each one is a request the service answers with 200.
"""
from __future__ import annotations

import base64
import html
import io
import json

import numpy as np

from compat_core.retrieval.search_request import MODEL_VERSION_RULES, REQUEST_FIELDS, SearchLimits

__all__ = ["RESPONSE_OBJECTS", "openapi_document", "docs_html"]


def _field(schema: dict, unit: str, description: str) -> dict:
    return {**schema, "description": f"{description} Unit: {unit}."}


# object name -> {field: (JSON Schema, unit, description)}; the test of the service checks its answers against these
RESPONSE_OBJECTS: dict[str, dict[str, tuple[dict, str, str]]] = {
    "SearchResult": {
        "id": ({"type": "string"}, "the gallery item's id", "Identifier of the gallery item (from the index)."),
        "position": ({"type": "integer", "minimum": 0}, "row number in the index",
                     "The item's row in the index; ties in score are ordered by it, lowest first."),
        "score": ({"type": "number", "minimum": -1, "maximum": 1}, "cosine similarity in [-1, 1]",
                  "Similarity of the query to the item (exact, float64, after any adapter), descending."),
        "item_version": ({"type": "string"}, "model version",
                         "The model version that embedded this gallery item."),
        "adapter": ({"type": ["string", "null"]}, "adapter kind or null",
                    "The adapter kind used to compare the query with this item (installed by compat gate for "
                    "items of the old version), or null when none applied."),
        "payload_uri": ({"type": ["string", "null"]}, "URI (local path or s3://)",
                        "Where the item's bytes live (null when the index was built without payload URIs, "
                        "compat index build --payload-prefix); present only when include_payload was true."),
    },
    "SearchResponse": {
        "model": ({"type": "string"}, "registered model name", "The registered model that embeds queries."),
        "model_version": ({"type": "string"}, "model version",
                          "The version that embedded or was checked against the query."),
        "index_manifest": ({"type": "string"}, "sha256 hex digest",
                           "Digest of the index manifest that was searched (its HEAD)."),
        "k": ({"type": "integer"}, "gallery items (count)", "The k that was asked for."),
        "results": ({"type": "array", "items": {"$ref": "#/components/schemas/SearchResult"}}, "list of k items",
                    "The k nearest gallery items, best first."),
    },
    "Health": {
        "status": ({"type": "string", "enum": ["ok", "degraded", "loading"]}, "state name",
                   "ok: serving the alias's target; degraded (200): answering with the loaded version while the "
                   "alias's target cannot be checked or loaded; loading (503): no model loaded yet."),
        "replica": ({"type": "string"}, "replica id (process id)", "The replica that answered."),
        "model": ({"type": "string"}, "registered model name", "The registered model that embeds queries."),
        "model_version": ({"type": "string"}, "model version", "The version that embeds queries now."),
        "index_manifest": ({"type": "string"}, "sha256 hex digest", "Digest of the index manifest served."),
        "items": ({"type": "integer"}, "gallery items (count)", "Items in the index."),
        "dim": ({"type": "integer"}, "components (count)", "The embedding width D a query 'embedding' must have."),
        "items_by_version": ({"type": "object", "additionalProperties": {"type": "integer"}},
                             "gallery items (count) per model version",
                             "How many items each model version embedded (a backfill moves them to the new one)."),
        "adapter": ({"type": ["object", "null"], "properties": {"kind": {"type": "string"},
                                                                "old_version": {"type": "string"}}},
                    "adapter kind and model version, or null",
                    "The adapter the gate installed with the serving version and the old version it maps."),
        "search": ({"type": "object"}, "search kind and its settings",
                   "kind (flat, ivf, hnsw, ivfpq) and approximate_groups; for an approximate structure also "
                   "params, effort, candidates, recall (Recall@1 of exact, fraction), recall_target, sample, "
                   "model_version, and rerank: where the exact re-rank reads the rows (structure: the structure's "
                   "own rows; row_file: an ivfpq index's fp16 row file, read per candidate; gallery: the loaded rows)."),
        "loaded_unix": ({"type": "number"}, "seconds since the Unix epoch", "When this state was loaded."),
        "alias": ({"type": "object", "properties": {"uri": {"type": "string"}, "error": {"type": "string"},
                                                    "target_version": {"type": ["string", "null"]}}},
                  "models:/ URI, error text and model version",
                  "Only when degraded: the alias followed, the version it names and why it is not served."),
        "error": ({"type": ["string", "null"]}, "error text",
                  "Only while loading: the last load error, or null while the first load runs."),
    },
    "Error": {
        "error": ({"type": "object", "properties": {"status": {"type": "integer"},
                                                    "field": {"type": ["string", "null"]},
                                                    "message": {"type": "string"}}},
                  "HTTP status, field name and text",
                  "status: the HTTP status; field: the request field, 'body', 'content-type', 'path' or 'method' "
                  "at fault (null for a server-side error); message: what was expected."),
    },
}
# fields present in every answer of that kind (the others depend on the request or the state)
_REQUIRED = {"SearchResult": ["id", "position", "score", "item_version", "adapter"],
             "SearchResponse": ["model", "model_version", "index_manifest", "k", "results"],
             "Health": ["status"], "Error": ["error"]}


def _object_schema(name: str) -> dict:
    fields = RESPONSE_OBJECTS[name]
    return {"type": "object", "required": _REQUIRED[name],
            "properties": {key: _field(*spec) for key, spec in fields.items()}}


def _request_schema(dim: int | None, limits: SearchLimits, top_k: int) -> dict:
    properties = {}
    for field in REQUEST_FIELDS:
        schema = _field(field.schema, field.unit, field.description)
        if field.name == "embedding" and dim is not None:
            schema.update({"minItems": dim, "maxItems": dim})
        if field.name == "k":
            schema.update({"maximum": top_k, "default": limits.default_k})
        properties[field.name] = schema
    return {"type": "object", "additionalProperties": False, "properties": properties,
            "oneOf": [{"required": ["embedding"]}, {"required": ["image"]}]}


def _png_base64(shape: tuple[int, int, int]) -> str:
    from PIL import Image

    height, width, channels = shape
    pixels = np.full((height, width, channels), 128, dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels[:, :, 0] if channels == 1 else pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _examples(state, top_k: int) -> dict:
    """Request examples for the served state: a gallery row of the serving version (or a unit vector) as the
    embedding, a grey image of the index's image shape."""
    k = min(5, top_k)
    if state is None:
        return {"embedding": {"summary": "an embedding (the served width D is known once a model is loaded)",
                              "value": {"embedding": [0.6, 0.8, 0.0], "k": 3}}}
    served = np.flatnonzero(state.index.versions == state.ref.version)
    row = np.asarray(state.index.row(int(served[0])), dtype=np.float64) if served.size else None
    if row is None or not np.all(np.isfinite(row)) or not np.any(np.round(row, 6)):
        row = np.eye(1, int(state.index.dim))[0]
    examples = {"embedding": {"summary": f"an embedding made by version {state.ref.version} (a gallery row)",
                              "value": {"embedding": [round(float(x), 6) for x in row], "k": k,
                                        "model_version": state.ref.version}}}
    if state.image_shape is not None and state.model is not None:
        examples["image"] = {"summary": f"a grey {state.image_shape[1]}x{state.image_shape[0]} PNG",
                             "value": {"image": _png_base64(state.image_shape), "k": k, "include_payload": True}}
    return examples


def _json_content(name: str) -> dict:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}


def _errors(*codes: int) -> dict:
    meaning = {400: "invalid request: the error names the field", 404: "no such route",
               405: "wrong method for the route", 409: "model_version is not the serving version (re-embed or "
               "retry)", 413: "body or image over the limit", 415: "not application/json, or an image that is not "
               "JPEG/PNG", 500: "server-side error (message says what broke)", 503: "no model loaded yet; retry"}
    return {str(code): {"description": meaning[code], "content": _json_content("Error")} for code in codes}


def openapi_document(state, limits: SearchLimits) -> dict:
    """The OpenAPI 3.1 document of the service as one replica serves it (``state``: its ``ServingState`` or None
    while loading)."""
    top_k = limits.max_k if state is None else min(limits.max_k, state.index.size)
    dim = None if state is None else int(state.index.dim)
    limits_text = (f"Limits: request body <= {limits.max_body_bytes} bytes, k <= {top_k} (max_k {limits.max_k}"
                   f"{'' if state is None else f', gallery size {state.index.size}'}), decoded image <= "
                   f"{limits.max_image_pixels} pixels.")
    served = ("" if state is None else f" Served now: model {state.ref.name} version {state.ref.version}, "
              f"{state.index.size} items of width {dim}.")
    search = {"summary": "Nearest gallery items of an embedding or an image",
              "description": f"Top-k by cosine similarity over the gallery index, scored exactly (an index with an "
                             f"approximate structure proposes the candidates; /healthz search); each item's model "
                             f"version and adapter are in the answer. {MODEL_VERSION_RULES} {limits_text}",
              "requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/SearchRequest"}, "examples": _examples(state, top_k)}}},
              "responses": {"200": {"description": "the k nearest items", "content": _json_content("SearchResponse")},
                            **_errors(400, 409, 413, 415, 500, 503)}}
    health = {"summary": "The served model, index and search structure",
              "responses": {"200": {"description": "loaded (status ok or degraded)",
                                    "content": _json_content("Health")},
                            "503": {"description": "no model loaded yet (status loading)",
                                    "content": _json_content("Health")}}}
    text = {"text/plain": {"schema": {"type": "string"}}}
    metrics = {"summary": "Prometheus text metrics of the replica that answered",
               "description": "compat_search_requests_total (by path and code), compat_search_latency_seconds "
                              "(histogram, seconds), compat_model_swaps_total, compat_model_swap_errors_total, "
                              "compat_search_batches_total, compat_search_batched_requests_total, "
                              "compat_model_loaded, compat_model_version_info, compat_index_items (by version), "
                              "compat_backfill_fraction (fraction of items embedded by the serving version).",
               "responses": {"200": {"description": "Prometheus text format 0.0.4", "content": text}}}
    schemas = {"SearchRequest": _request_schema(dim, limits, top_k),
               **{name: _object_schema(name) for name in RESPONSE_OBJECTS}}
    return {"openapi": "3.1.0",
            "info": {"title": "compat search service", "version": "1",
                     "description": "Compatible search over a gallery indexed by one or more model versions "
                                    "(compat serve). JSON in and out; every error names the field at fault." + served},
            "paths": {"/search": {"post": search}, "/healthz": {"get": health}, "/metrics": {"get": metrics},
                      "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {
                          "description": "OpenAPI 3.1 JSON", "content": {"application/json": {}}}}}},
                      "/docs": {"get": {"summary": "This reference as an HTML page", "responses": {"200": {
                          "description": "HTML", "content": {"text/html": {}}}}}}},
            "components": {"schemas": schemas}}


_STYLE = ("body{font-family:sans-serif;max-width:70em;margin:2em auto;padding:0 1em;line-height:1.4}"
          "table{border-collapse:collapse;width:100%}td,th{border:1px solid #ccc;padding:.3em;vertical-align:top;"
          "text-align:left}pre{background:#f4f4f4;padding:.5em;overflow-x:auto;white-space:pre-wrap;"
          "word-break:break-all}code{background:#f4f4f4}")


def _type_text(schema: dict) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    kind = schema.get("type", "any")
    kind = " | ".join(kind) if isinstance(kind, list) else kind
    if kind == "array" and "items" in schema:
        kind = f"array of {_type_text(schema['items'])}"
    bounds = [f"{key} {schema[key]}" for key in ("minimum", "maximum", "minItems", "maxItems", "default")
              if key in schema]
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


def _body_text(answer: dict) -> str:
    """A response's media types, each with its schema's name when it has one."""
    return ", ".join(f"{kind} {_type_text(content['schema'])}" if content.get("schema") else kind
                     for kind, content in answer.get("content", {}).items())


def _schema_table(name: str, schema: dict) -> str:
    required = set(schema.get("required", []))
    rows = "".join(f"<tr><td><code>{html.escape(key)}</code></td><td>{html.escape(_type_text(spec))}</td>"
                   f"<td>{'yes' if key in required else 'no'}</td><td>{html.escape(spec.get('description', ''))}"
                   f"</td></tr>" for key, spec in schema["properties"].items())
    note = " One of <code>embedding</code> or <code>image</code> is required." if "oneOf" in schema else ""
    return (f"<h3 id='{html.escape(name)}'>{html.escape(name)}</h3><p>JSON object.{note}</p><table><tr><th>field"
            f"</th><th>type</th><th>always present / required</th><th>meaning and unit</th></tr>{rows}</table>")


def docs_html(document: dict) -> str:
    """A self-contained HTML page of ``document`` (an OpenAPI document from :func:`openapi_document`)."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(document['info']['title'])}"
             f"</title><style>{_STYLE}</style></head><body><h1>{html.escape(document['info']['title'])}</h1>"
             f"<p>{html.escape(document['info']['description'])}</p><p>Machine-readable: "
             f"<a href='openapi.json'>openapi.json</a> (OpenAPI {document['openapi']}).</p><h2>Routes</h2>"]
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            parts.append(f"<h3>{method.upper()} <code>{html.escape(path)}</code></h3>"
                         f"<p>{html.escape(operation['summary'])}. {html.escape(operation.get('description', ''))}"
                         f"</p>")
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            for example in body.get("examples", {}).values():
                parts.append(f"<p>Example request: {html.escape(example['summary'])}</p>"
                             f"<pre>{html.escape(json.dumps(example['value']))}</pre>")
            rows = "".join(f"<tr><td>{code}</td><td>{html.escape(answer['description'])}</td><td>"
                           f"{html.escape(_body_text(answer))}</td></tr>"
                           for code, answer in operation["responses"].items())
            parts.append(f"<table><tr><th>status</th><th>meaning</th><th>body</th></tr>{rows}</table>")
    parts.append("<h2>Objects</h2>")
    parts += [_schema_table(name, schema) for name, schema in document["components"]["schemas"].items()]
    parts.append("</body></html>")
    return "".join(parts)
