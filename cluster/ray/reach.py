"""Fail fast on an unreachable or silent cluster address instead of hanging inside a client library.

Two bounded checks before a client library (``ray.init``, Ray's job client) dials a head: the TCP port opens
(:func:`require_reachable`, 10 s), then the server there answers its protocol (:func:`require_answering`: a gRPC
handshake for a GCS ``HOST:PORT`` or a ``ray://`` Ray Client server, an HTTP response for a job server) within
``COMPAT_RAY_CONNECT_TIMEOUT_S`` seconds (default 60). A port that accepts connections and never answers would
otherwise hang ``ray.init`` and the job client forever.
"""
from __future__ import annotations

import ipaddress
import math
import os
import socket
from urllib.error import HTTPError, URLError
from urllib.parse import urlparse
from urllib.request import urlopen

CONNECT_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_VARIABLE = "COMPAT_RAY_CONNECT_TIMEOUT_S"
DEFAULT_ANSWER_TIMEOUT_S = 60.0


def host_port(address: str, default_port: int) -> tuple[str, int]:
    """(host, port) of ``http(s)://HOST:PORT``, ``ray://HOST:PORT`` or ``HOST:PORT``."""
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    if not parsed.hostname:
        raise ValueError(f"--address {address!r}: expected HOST:PORT or a URL with a host")
    return parsed.hostname, parsed.port or default_port


def require_reachable(address: str, what: str, default_port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Open (and close) a TCP connection to ``address``; raises ConnectionError naming it, ``what`` is there, and
    what to check, after at most ``timeout_s`` seconds."""
    host, port = host_port(address, default_port)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as error:
        raise ConnectionError(
            f"cannot reach the {what} at {host}:{port} within {timeout_s:g} s ({error.strerror or error}); check "
            f"--address, that the cluster is running and that this machine may connect to that port") from None


def answer_timeout_s() -> float:
    """Seconds a Ray head has to answer once its port is open: ``COMPAT_RAY_CONNECT_TIMEOUT_S``, else 60."""
    text = os.environ.get(ANSWER_TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_ANSWER_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{ANSWER_TIMEOUT_VARIABLE}={text!r}: expected a number of seconds greater than 0")
    return value


def require_answering(address: str, what: str, default_port: int, timeout_s: float | None = None) -> None:
    """Wait at most ``timeout_s`` seconds (None: :func:`answer_timeout_s`) for the server at ``address`` to answer:
    an HTTP response of any status for ``http(s)://``, else a completed gRPC (HTTP/2) handshake. Raises
    ConnectionError naming the address and what to check. Skipped for gRPC under ``RAY_USE_TLS`` (ray.init then
    negotiates TLS itself)."""
    timeout_s = answer_timeout_s() if timeout_s is None else timeout_s
    host, port = host_port(address, default_port)
    if address.startswith(("http://", "https://")):
        try:
            with urlopen(address.rstrip("/") + "/api/version", timeout=timeout_s):
                return
        except HTTPError:
            return  # an answer, whatever its status: the client reports what it means
        except (URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            if not isinstance(reason, (TimeoutError, socket.timeout)):
                raise ConnectionError(f"the {what} at {host}:{port} refused the request ({reason}); check "
                                      f"--address and that the Ray dashboard runs there") from None
    elif os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return
    else:
        import grpc  # installed with Ray; only the clients that talk to a Ray head need it

        channel = grpc.insecure_channel(f"{host}:{port}")
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
            return
        except grpc.FutureTimeoutError:
            pass  # reported below
        finally:
            channel.close()
    raise ConnectionError(
        f"the {what} at {host}:{port} accepted the connection but did not answer within {timeout_s:g} s; check "
        f"that --address names the Ray head's port (GCS HOST:PORT, `ray start --head --port`, default 6379; "
        f"ray://HOST:10001 for the Ray Client server; http://HOST:8265 for the job server), that the head is "
        f"healthy (`ray status` on it) and that no other program listens there; {ANSWER_TIMEOUT_VARIABLE} sets "
        f"how long to wait")


def is_this_machine(host: str) -> bool:
    """True when ``host`` names this machine: a loopback address or name, this machine's hostname, or an address
    of one of its interfaces (as far as the resolver knows them)."""
    def addresses(name: str) -> set[str]:
        try:
            return {info[4][0] for info in socket.getaddrinfo(name, None)}
        except OSError:
            return set()

    targets = addresses(host) or {host}
    for address in targets:
        try:
            if ipaddress.ip_address(address.split("%")[0]).is_loopback:
                return True
        except ValueError:
            continue
    hostname = socket.gethostname()
    own = addresses(hostname) | addresses(socket.getfqdn()) | {hostname, socket.getfqdn()}
    try:  # the address this machine uses for outgoing traffic (no packet is sent by a UDP connect)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((next(iter(targets)), 9))
            own.add(probe.getsockname()[0])
    except (OSError, StopIteration):
        pass
    return bool(targets & own)


def local_address_towards(address: str, default_port: int) -> str:
    """The IP address of this machine's interface on the route to ``address`` (127.0.0.1 for a loopback host)."""
    host, port = host_port(address, default_port)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), port))  # UDP: no packet is sent, only the route is chosen
        return probe.getsockname()[0]
