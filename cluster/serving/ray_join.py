"""How ``compat serve`` and ``compat index backfill`` join a Ray cluster, each from its own shell.

The user starts a head with ``compat cluster up`` (token authentication, everything on 127.0.0.1), which prints two
addresses: the job server (``http://127.0.0.1:PORT``, also suggested as ``RAY_ADDRESS``) and the GCS address
(``127.0.0.1:PORT``). Serving and backfilling are drivers, so they join the GCS; given the job server's address
(``--ray-address http://...`` or ``RAY_ADDRESS=http://...``), the GCS address of that head is looked up in the
heads ``compat cluster up`` recorded on this machine. The cluster's token comes from Ray's standard places
(``~/.ray/auth_token``, ``RAY_AUTH_TOKEN_PATH``, ``RAY_AUTH_TOKEN``) or ``--ray-token-file``; when the head's
dashboard is known, a missing token is reported with the fix before Ray is started.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cluster.ray.auth import prepare_client_auth, require_token_if_needed
from cluster.ray.task_backend import connect
from cluster.ray.local_head import default_state_dir, read_state
from cluster.ray.loopback import prepare_loopback

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class RayTarget:
    """Where to join: ``address`` for ``ray.init`` (None: an embedded local instance), ``dashboard`` the head's job
    server URL when known (for the token check), ``source`` how it was given (for messages)."""

    address: str | None
    dashboard: str | None
    source: str


def recorded_heads(state_dir: str | Path | None = None) -> list:
    """The heads ``compat cluster up`` recorded in ``state_dir`` (default: its default state folder)."""

    folder = Path(state_dir or default_state_dir())
    heads = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            heads.append(read_state(path.stem, folder))
        except (OSError, ValueError, TypeError):
            continue  # not a head state file
    return [head for head in heads if head is not None]


def _same_endpoint(a: str, b: str) -> bool:
    def parts(address: str) -> tuple[str, str]:
        host, _, port = address.split("://")[-1].rstrip("/").rpartition(":")
        return ("127.0.0.1" if host in LOOPBACK_HOSTS else host), port

    return parts(a) == parts(b)


def resolve_ray_target(address: str | None, state_dir: str | Path | None = None) -> RayTarget:
    """The cluster to join for ``--ray-address address`` (None: ``RAY_ADDRESS`` when set, else an embedded instance).

    A job-server address ``http(s)://HOST:PORT`` becomes the GCS address of the ``compat cluster up`` head serving
    it; an unknown one raises ValueError saying which address to give instead."""
    source = "--ray-address"
    if address is None and os.environ.get("RAY_ADDRESS"):
        address, source = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    if address is None:
        return RayTarget(None, None, "embedded")
    heads = recorded_heads(state_dir)
    if address.startswith(("http://", "https://")):
        for head in heads:
            if _same_endpoint(head.address, address):
                return RayTarget(head.gcs_address, head.address, source)
        raise ValueError(
            f"{source} {address}: a job server address, and no head started by `compat cluster up` on this machine "
            f"serves it; give the cluster's GCS address HOST:PORT instead (`compat cluster status` prints it as "
            f"the --address of `compat run`; for `ray start --head` it is HOST:6379)")
    for head in heads:
        if _same_endpoint(head.gcs_address, address):
            return RayTarget(head.gcs_address, head.address, source)
    return RayTarget(address, None, source)


def connect_ray(address: str | None, token_file: str | None = None, state_dir: str | Path | None = None) -> RayTarget:
    """Join the cluster named by ``address`` (see :func:`resolve_ray_target`) through the project's one Ray entry
    point (``cluster.ray.task_backend.connect``); returns where it joined. A loopback address needs this process's Ray
    to keep 127.0.0.1 too (otherwise Ray rewrites it to the machine's address)."""
    target = resolve_ray_target(address, state_dir)
    if target.address is not None:
        token_source = prepare_client_auth(token_file)
        if target.dashboard is not None:
            require_token_if_needed(target.dashboard, token_source)
        if target.source == "RAY_ADDRESS":
            os.environ["RAY_ADDRESS"] = target.address  # Ray reads it too: the GCS address, never the job server
        if target.address.split("://")[-1].rpartition(":")[0] in LOOPBACK_HOSTS:
            prepare_loopback()
    elif token_file:
        raise ValueError("--ray-token-file: only meaningful with --ray-address (or RAY_ADDRESS); without one a local "
                         "instance is started")
    connect(target.address)
    return target


__all__ = ["RayTarget", "connect_ray", "recorded_heads", "resolve_ray_target"]
