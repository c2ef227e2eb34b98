"""An embedded Ray instance that listens on 127.0.0.1 only.

Ray replaces a node address of 127.0.0.1 with the machine's routable address unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, a flag it reads when ``ray`` is first imported. Setting the variable
after ``import ray`` (as this project did) reaches the raylet, GCS and agents started later, but not the driver's
own copy of the flag, so the node address, and with it the dashboard agent, runtime-env agent and metrics
exporters, still bound to every interface. This module sets both before a local instance starts.
"""
from __future__ import annotations

import os

LOOPBACK = "127.0.0.1"
_FLAG = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def prepare_loopback() -> None:
    """Make the next ``ray.init`` of a *new local* instance keep every address on 127.0.0.1 (driver and the
    processes it spawns). Call it before ``ray.init(_node_ip_address=LOOPBACK, ...)``."""
    os.environ[_FLAG] = "0"  # inherited by raylet, GCS, agents and workers
    from ray._private import ray_constants  # the driver read the flag at import time: set its copy too

    ray_constants.ENABLE_RAY_CLUSTER = False


def prepare_for_address(address: str | None) -> None:
    """Before ``ray.init(address=...)`` joins an existing cluster: when the address is on loopback (a head started
    with ``--node-ip-address=127.0.0.1``, e.g. by ``compat cluster up``), the driver must stay on 127.0.0.1 too, or
    Ray replaces the address with the machine's routable one and never reaches the head."""
    import ipaddress
    from urllib.parse import urlparse

    if not address or address == "auto":
        return
    host = urlparse(address if "://" in address else f"tcp://{address}").hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        prepare_loopback()
