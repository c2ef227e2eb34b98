"""The request body limit in Ray Serve's HTTP proxy, before any byte reaches a replica.

Serve's proxy reads the client's body message by message into an unbounded queue that the replica drains
(``ray/serve/_private/proxy.py``, ``proxy_asgi_receive``): without a limit there, a large chunked body sits in the
proxy's memory until the replica's own 413 is out. Serve applies the Starlette middlewares that the function named by
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` returns around the proxy's ASGI app, in the proxy's process
(``ray/serve/_private/http_util.py``, ``configure_http_middlewares``). :class:`ProxyBodyLimit` is such a middleware:

- a declared ``Content-Length`` over the limit gets 413 at once, before any byte of the body is read;
- a body without one (chunked) is counted as the proxy reads it: once it passes the limit the client gets 413 and
  the proxy is told the client went away, so it stops reading (and cancels the replica's request); the proxy holds
  at most the limit plus one message of such a body.

The proxy reads both variables once, when its process starts: :func:`install` sets them in this process before it
starts Ray (a local instance that ``compat serve`` starts passes them to every worker it launches). A cluster
``compat serve`` joins has the proxy its head's environment configured: ``compat cluster up`` starts its head with
:func:`head_environment` (the default limit, or ``$COMPAT_SERVE_PROXY_MAX_BODY_BYTES`` as set when it starts).
"""
from __future__ import annotations

import json
import os
from typing import Any

CALLBACK_VARIABLE = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "cluster.serving.proxy_limits:proxy_middlewares"
LIMIT_VARIABLE = "COMPAT_SERVE_PROXY_MAX_BODY_BYTES"
DEFAULT_MAX_BODY_BYTES = 4 << 20  # compat serve's --max-body-bytes default


def head_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a Ray head whose Serve proxy limits request bodies: the callback and the limit (bytes) added
    unless ``env`` already names them (a callback of the user's own is kept, and then no limit is set)."""
    if env.get(CALLBACK_VARIABLE, CALLBACK) != CALLBACK:
        return dict(env)
    return {**env, CALLBACK_VARIABLE: CALLBACK, LIMIT_VARIABLE: env.get(LIMIT_VARIABLE) or str(DEFAULT_MAX_BODY_BYTES)}


def install(max_body_bytes: int) -> bool:
    """Name :func:`proxy_middlewares` and the limit (bytes) in this process's environment, for a Ray instance this
    process starts. False (nothing set) when the environment already names another proxy callback."""
    current = os.environ.get(CALLBACK_VARIABLE)
    if current and current != CALLBACK:
        return False
    os.environ[CALLBACK_VARIABLE] = CALLBACK
    os.environ[LIMIT_VARIABLE] = str(int(max_body_bytes))
    return True


def proxy_middlewares() -> list:
    """What Serve's proxy applies (its callback): the body limit of ``$COMPAT_SERVE_PROXY_MAX_BODY_BYTES``."""
    from starlette.middleware import Middleware

    text = os.environ.get(LIMIT_VARIABLE, "")
    if not text.isdigit():
        return []
    return [Middleware(ProxyBodyLimit, max_body_bytes=int(text))]


def _refusal(message: str) -> tuple[dict, dict]:
    body = json.dumps({"error": {"status": 413, "field": "body", "message": message}}).encode()
    start = {"type": "http.response.start", "status": 413,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]}
    return start, {"type": "http.response.body", "body": body, "more_body": False}


class ProxyBodyLimit:
    """ASGI middleware: 413 for an HTTP request body over ``max_body_bytes`` (see the module docstring)."""

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app, self.limit = app, int(max_body_bytes)

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"").decode("latin-1").strip()
        if declared.isdigit() and int(declared) > self.limit:
            for message in _refusal(f"{declared} bytes is over the limit of {self.limit} bytes (refused by the "
                                    f"HTTP proxy before the body was read)"):
                await send(message)
            return
        state = {"received": 0, "refused": False, "started": False, "ours": False}

        async def counted_receive() -> dict:
            if state["refused"]:
                return {"type": "http.disconnect"}
            message = await receive()
            if message.get("type") == "http.request":
                state["received"] += len(message.get("body") or b"")
                if state["received"] > self.limit:
                    state["refused"] = True
                    if not state["started"]:
                        state["started"] = state["ours"] = True
                        for reply in _refusal(f"over the limit of {self.limit} bytes (the HTTP proxy stopped "
                                              f"reading after {state['received']} bytes)"):
                            await send(reply)
                    return {"type": "http.disconnect"}  # the proxy stops reading and cancels the request
            return message

        async def guarded_send(message: dict) -> None:
            if state["ours"] and message.get("type", "").startswith("http.response"):
                return  # the 413 above is the response
            if message.get("type") == "http.response.start":
                state["started"] = True
            await send(message)

        await self.app(scope, counted_receive, guarded_send)


__all__ = ["CALLBACK", "CALLBACK_VARIABLE", "LIMIT_VARIABLE", "ProxyBodyLimit", "install", "proxy_middlewares"]
