"""One writer per run folder: a lease taken before anything is computed or tracked.

Local folders: an exclusive ``fcntl`` lock on ``<run>/.compat-lease`` (the kernel drops it when the process dies,
so a killed run never blocks its resume). Object storage has no locks: the lease is an object
``<run>/.compat-lease.json`` holding an owner token and a heartbeat time, rewritten every ``HEARTBEAT_S`` seconds;
a lease whose heartbeat is older than ``STALE_S`` belonged to a dead driver and is taken over. After writing its
lease a driver reads it back after ``SETTLE_S``: if another driver wrote in between, the later writer wins and the
other refuses, so two drivers started together never both compute.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Iterator

from compat_core import io as cio

LEASE_FILE = ".compat-lease"
HEARTBEAT_S = 20.0
STALE_S = 90.0
SETTLE_S = 1.0


class RunFolderBusyError(RuntimeError):
    """Another `compat` process holds the run folder."""


def _owner() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "token": uuid.uuid4().hex}


def _busy(root: str, holder: dict) -> RunFolderBusyError:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return RunFolderBusyError(
        f"run folder {root} is in use by another compat process (pid {holder.get('pid')} on "
        f"{holder.get('host')}, since {since}); wait for it to finish, or give another --output")


@contextlib.contextmanager
def run_lease(root: str) -> Iterator[None]:
    """Hold the run folder ``root`` (local path or s3:// URI) for the duration of the block; raises
    RunFolderBusyError naming the holder when another live process has it."""
    if cio.is_remote(root):
        with _object_lease(root):
            yield
        return
    import fcntl

    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, LEASE_FILE)
    handle = open(path, "a+")
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            try:
                holder = json.loads(handle.read() or "{}")
            except json.JSONDecodeError:
                holder = {}
            raise _busy(root, holder) from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_owner()))
        handle.flush()
        yield
    finally:
        handle.close()  # closing drops the lock


@contextlib.contextmanager
def _object_lease(root: str) -> Iterator[None]:
    uri = cio.join(root, LEASE_FILE + ".json")
    mine = _owner()

    def read() -> dict | None:
        if not cio.exists(uri):
            return None
        try:
            return json.loads(cio.read_bytes(uri).decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None

    holder = read()
    if holder is not None and holder.get("token") != mine["token"] \
            and time.time() - float(holder.get("heartbeat", 0)) < STALE_S:
        raise _busy(root, holder)
    mine["heartbeat"] = time.time()
    cio.write_bytes(uri, json.dumps(mine).encode("utf-8"))
    time.sleep(SETTLE_S)
    holder = read()
    if holder is None or holder.get("token") != mine["token"]:
        raise _busy(root, holder or {})
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            mine["heartbeat"] = time.time()
            with contextlib.suppress(Exception):  # a missed beat only shortens the lease
                cio.write_bytes(uri, json.dumps(mine).encode("utf-8"))

    thread = threading.Thread(target=beat, name="compat-lease-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        mine["heartbeat"] = 0.0  # released: the next driver takes it at once
        with contextlib.suppress(Exception):
            cio.write_bytes(uri, json.dumps(mine).encode("utf-8"))
