"""Fail fast on an unreachable cluster address instead of hanging inside a client library."""
from __future__ import annotations

import socket
from urllib.parse import urlparse

CONNECT_TIMEOUT_S = 10.0


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


def is_this_machine(host: str) -> bool:
    """True when ``host`` names this machine: a loopback address or name, this machine's hostname, or an address
    of one of its interfaces (as far as the resolver knows them)."""
    import ipaddress

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
