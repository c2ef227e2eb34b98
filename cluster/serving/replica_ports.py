"""The ports a search-service replica opens stay on 127.0.0.1.

Besides the actor calls Serve's HTTP proxy makes, Ray Serve starts in every replica a gRPC server for calls between
deployments and binds it to every interface (``[::]:0``); that server unpickles the request metadata it receives,
so whoever reaches the port can run code in the replica. The search service is reached only through Serve's HTTP
proxy, which calls replicas as Ray actors, so the server needs no address but loopback:
:func:`keep_replica_ports_on_loopback`, run by the replica's constructor (before Serve starts that server, in the
replica's own process), binds it to 127.0.0.1, and refuses to start the replica where that cannot be guaranteed
(a Ray Serve that opens the server differently, or settings that route requests to replicas over the network).
"""
from __future__ import annotations

import inspect
import os

LOOPBACK = "127.0.0.1"
_MARK = "_compat_loopback_only"
# Ray Serve settings under which requests reach replicas over ports that must be open to other hosts or the world
NETWORK_INGRESS_SETTINGS = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_ENABLE_HA_PROXY",
                            "RAY_SERVE_THROUGHPUT_OPTIMIZED")
GRPC_ROUTING_SETTINGS = ("RAY_SERVE_USE_GRPC_BY_DEFAULT", "RAY_SERVE_PROXY_USE_GRPC")


def exposing_settings(environ: dict | None = None) -> list[str]:
    """The ``NAME=VALUE`` Ray Serve settings in ``environ`` (default: this process) that open replica ports to other
    hosts (direct ingress, HAProxy, the throughput profile that switches both on, gRPC routing between replicas)."""
    environ = os.environ if environ is None else environ
    return [f"{name}={environ[name]}" for name in NETWORK_INGRESS_SETTINGS + GRPC_ROUTING_SETTINGS
            if environ.get(name, "0").strip().lower() in ("1", "true")]


def refuse_exposing_settings(where: str, environ: dict | None = None) -> None:
    """ValueError naming the settings of :func:`exposing_settings` found in ``where`` and what to do."""
    found = exposing_settings(environ)
    if found:
        raise ValueError(f"{where}: {', '.join(found)} makes Ray Serve reach replicas over ports open to other "
                         f"hosts; compat serve keeps every replica port on {LOOPBACK} and its HTTP on --host only. "
                         f"Unset {' and '.join(item.split('=')[0] for item in found)} (in the shell of `compat "
                         f"serve` and of the Ray cluster's nodes)")


def opens_grpc_ports_only_through(module, function: str) -> bool:
    """Whether the source of ``module`` opens gRPC ports only by calling ``function`` (no direct
    ``add_insecure_port`` / ``add_secure_port``); False when its source cannot be read."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return False
    return f"{function}(" in source and "add_insecure_port(" not in source and "add_secure_port(" not in source


def keep_replica_ports_on_loopback() -> None:
    """In a replica's process, before Serve starts its inter-deployment gRPC server: bind that server to
    127.0.0.1. Raises RuntimeError when this Ray Serve opens it some other way (nothing then guarantees loopback),
    ValueError for settings that route requests to replicas over the network."""
    from ray.serve._private import replica

    refuse_exposing_settings("the search service's replica environment")
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None or not callable(bind) or not opens_grpc_ports_only_through(replica, "add_port_to_grpc_server"):
        import ray

        raise RuntimeError(f"ray {ray.__version__}: the Serve replica no longer opens its gRPC server only "
                           f"through add_port_to_grpc_server, so compat serve cannot keep that port on {LOOPBACK} "
                           f"and refuses to start the replica; use a ray release whose replica does (tested: 2.60)")
    if getattr(bind, _MARK, False):
        return

    def bind_on_loopback(server, address: str):
        port = str(address).rpartition(":")[2]
        return bind(server, f"{LOOPBACK}:{port}")

    setattr(bind_on_loopback, _MARK, True)
    replica.add_port_to_grpc_server = bind_on_loopback


__all__ = ["LOOPBACK", "exposing_settings", "keep_replica_ports_on_loopback", "opens_grpc_ports_only_through",
           "refuse_exposing_settings"]
