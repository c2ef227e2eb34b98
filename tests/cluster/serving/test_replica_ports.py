"""The replica's inter-deployment gRPC server, opened the way Ray Serve opens it (its own module's bind function on
``[::]:0``), listens on 127.0.0.1 only once :func:`keep_replica_ports_on_loopback` ran; settings that open replica
ports to other hosts are refused by name."""
from __future__ import annotations

import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray  # noqa: F401 - Ray ships psutil: importing ray first puts it on the path
import psutil  # noqa: I001
from ray.serve._private import replica

from cluster.serving.replica_ports import (
    exposing_settings,
    keep_replica_ports_on_loopback,
    opens_grpc_ports_only_through,
    refuse_exposing_settings,
)


def _listening_addresses(port: int) -> set[str]:
    return {connection.laddr.ip for connection in psutil.Process(os.getpid()).net_connections(kind="inet")
            if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port}


def _open(address: str) -> tuple[grpc.Server, int]:
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = replica.add_port_to_grpc_server(server, address)
    server.start()
    return server, port


def test_the_replica_grpc_server_binds_loopback_only():
    exposed, exposed_port = _open("[::]:0")   # what Serve does without the fix: every interface
    try:
        assert _listening_addresses(exposed_port) == {"::"}
    finally:
        exposed.stop(0)
    keep_replica_ports_on_loopback()
    keep_replica_ports_on_loopback()   # twice (a second replica in the same worker): wrapped once
    server, port = _open("[::]:0")
    try:
        addresses = _listening_addresses(port)   # gRPC binds 127.0.0.1 as an IPv4-mapped IPv6 socket
        assert port > 0 and addresses and addresses <= {"127.0.0.1", "::ffff:127.0.0.1"}, addresses
    finally:
        server.stop(0)


@pytest.mark.parametrize("name", ["RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_ENABLE_HA_PROXY",
                                  "RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_USE_GRPC_BY_DEFAULT",
                                  "RAY_SERVE_PROXY_USE_GRPC"])
def test_settings_that_open_replica_ports_are_refused_by_name(name):
    assert exposing_settings({name: "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS_X": "1"}) == [f"{name}=1"]
    assert exposing_settings({name: "0"}) == []
    with pytest.raises(ValueError, match=f"{name}=1 makes Ray Serve reach replicas over ports open to other hosts"):
        refuse_exposing_settings("the test's environment", {name: "1"})


def _module_from(path, text: str):
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_replica_that_opens_a_port_another_way_is_not_trusted(tmp_path):
    assert opens_grpc_ports_only_through(replica, "add_port_to_grpc_server")   # the installed Ray Serve
    through = _module_from(tmp_path / "through.py", "def start(server, bind):\n    return bind(server, '[::]:0')\n")
    direct = _module_from(tmp_path / "direct.py", "def start(server, bind):\n    bind(server, '[::]:0')\n"
                                                   "    return server.add_insecure_port('[::]:0')\n")
    assert opens_grpc_ports_only_through(through, "bind")
    assert not opens_grpc_ports_only_through(direct, "bind")
    assert not opens_grpc_ports_only_through(through, "add_port_to_grpc_server")
