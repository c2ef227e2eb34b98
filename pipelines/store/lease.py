"""One writer per run folder: a lease taken before anything is computed or tracked.

Local folders: an exclusive ``fcntl`` lock on ``<run>/.compat-lease`` (the kernel drops it when the process dies,
so a killed run never blocks its resume). Object storage has no locks: the lease is an object
``<run>/.compat-lease.json`` holding an owner token and a heartbeat time, rewritten every ``HEARTBEAT_S`` seconds;
a lease whose heartbeat is older than ``STALE_S`` belonged to a dead (or paused) driver and is taken over, and one
whose holder was a process of this host (same hostname, boot and pid namespace) that no longer exists is taken over
at once (:func:`holder_gone`; a holder on another host keeps the heartbeat timeout).

Every write of the lease object is conditional (S3 ``If-None-Match: *`` to create it, ``If-Match: <ETag>`` to
replace it), so two drivers started together cannot both take it, a paused holder that wakes up can neither
heartbeat over nor release its successor's lease, and every RunStore write of a holder checks first that the
object still has its ETag (:func:`check_fence`): a stale holder's commits are refused with LeaseLostError.

Both leases beat on the one heartbeat loop (:func:`_hold`) and are checked once more when their block ends: a holder
that lost its lease while the block ran raises LeaseLostError instead of finishing as if it still held it.

Processes that write for the holder (its Ray workers) do not hold the lease: the holder hands them its
:func:`lease_fence` and they write inside :func:`hold_fence`, so their RunStore writes check that the holder still
has the lease (the same lock file, the same owner token in the lease object) before each write.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

from compat_core import io as cio

LEASE_FILE = ".compat-lease"
HEARTBEAT_S = 20.0
STALE_S = 90.0


class RunFolderBusyError(RuntimeError):
    """Another `compat` process holds the run folder."""


class LeaseLostError(RuntimeError):
    """This process's lease was taken over by another driver (it was paused or cut off longer than the stale time);
    it must stop without writing. Trackers leave the runs alone: the new holder owns them."""

    lease_lost = True


class PreconditionFailed(Exception):
    """A conditional object write found the object changed (HTTP 412): someone else wrote it."""


def stale_s() -> float:
    """Seconds without a heartbeat after which an S3 lease is taken over (``COMPAT_LEASE_STALE_S``, default 90)."""
    return float(os.environ.get("COMPAT_LEASE_STALE_S", STALE_S))


def heartbeat_s() -> float:
    """Seconds between heartbeats (``COMPAT_LEASE_HEARTBEAT_S``, default 20; keep well below the stale time)."""
    return float(os.environ.get("COMPAT_LEASE_HEARTBEAT_S", HEARTBEAT_S))


def _process_space() -> str:
    """Where this process's pid means something: the boot of this machine and its pid namespace (two containers
    with one hostname, or a host that rebooted, never share it)."""
    parts = []
    for source, read in (("/proc/sys/kernel/random/boot_id", lambda p: open(p).read().strip()),
                         ("/proc/self/ns/pid", os.readlink)):
        try:
            parts.append(read(source))
        except OSError:
            parts.append("?")
    return "/".join(parts)


def _owner() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "space": _process_space(), "since": time.time(),
            "token": uuid.uuid4().hex}


def holder_gone(holder: dict) -> bool:
    """Whether the lease ``holder`` is a process of this host (same hostname, boot and pid namespace) that no longer
    exists: its lease is taken over at once. A holder on another host (or one recorded without these facts) is
    judged by its heartbeat only."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or holder.get("space") != _process_space() \
            or not isinstance(pid, int) or pid <= 0 or "?" in _process_space():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _taken_over(root: str, holder: dict) -> None:
    print(f"note: run folder {root}: its previous holder (pid {holder.get('pid')} on {holder.get('host')}) is gone; "
          f"lease taken over", file=sys.stderr)


def _busy(root: str, holder: dict) -> RunFolderBusyError:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    beat = holder.get("heartbeat")
    last = f", last heartbeat {time.time() - float(beat):.0f} s ago (taken over after {stale_s():g} s without one)" \
        if beat else ""
    return RunFolderBusyError(
        f"run folder {root} is in use by another compat process (pid {holder.get('pid')} on "
        f"{holder.get('host')}, since {since}{last}); wait for it to finish, or give another --output")


@contextlib.contextmanager
def run_lease(root: str) -> Iterator[None]:
    """Hold the run folder ``root`` (local path or s3:// URI) for the duration of the block; raises
    RunFolderBusyError naming the holder when another live process has it."""
    if cio.is_remote(root):
        with _object_lease(root):
            yield
        return
    with _local_lease(root):
        yield


class _LocalLease:
    """A held local lease: the lock file this holder opened (a stale holder's file is moved aside on takeover) and
    the owner mapping it rewrites at every heartbeat."""

    def __init__(self, root: str, path: str, handle, owner: dict) -> None:
        self.root, self.path, self.handle, self.owner = root, path, handle, owner
        self.token = owner["token"]
        self.lock = threading.Lock()
        self.lost = False

    def write(self, owner: dict) -> None:
        with self.lock:
            self.handle.seek(0)
            self.handle.truncate()
            self.handle.write(json.dumps(owner))
            self.handle.flush()

    def renew(self) -> None:
        """Rewrite the heartbeat in the lock file."""
        self.owner["heartbeat"] = time.time()
        self.write(self.owner)

    def check(self, fresh: bool = False) -> None:
        """LeaseLostError once another process moved this holder's lock file aside (it saw no heartbeat); one stat,
        so every check is fresh."""
        if not self.lost:
            try:
                self.lost = os.stat(self.path).st_ino != os.fstat(self.handle.fileno()).st_ino
            except FileNotFoundError:
                self.lost = True
        if self.lost:
            raise LeaseLostError(f"{self.root}: this process (pid {os.getpid()}) lost its lease to another process "
                                 f"(no heartbeat for {stale_s():g} s, e.g. while it was paused); it stops without "
                                 f"writing")

    def release(self) -> None:
        """Mark the lease released (a worker still writing for this holder fails its fence from now on) and drop
        the lock (closing the file)."""
        if not self.lost:
            self.owner["heartbeat"] = 0.0
            with contextlib.suppress(OSError):
                self.write(self.owner)
        self.handle.close()


def _read_lock_file(path: str, attempts: int = 5) -> dict:
    """The owner mapping in a local lock file, read by another process; an empty or half-written file (the holder
    rewrites it at each heartbeat: truncate, then write) is read again a few times before it counts as no owner."""
    for attempt in range(attempts):
        try:
            with open(path) as handle:
                text = handle.read()
            if text:
                return json.loads(text)
        except FileNotFoundError:
            return {}
        except json.JSONDecodeError:
            pass
        time.sleep(0.02 * (attempt + 1))
    return {}


def _read_holder(handle) -> dict:
    handle.seek(0)
    try:
        return json.loads(handle.read() or "{}")
    except json.JSONDecodeError:
        return {}


@contextlib.contextmanager
def _local_lease(root: str) -> Iterator[None]:
    """fcntl lock plus a heartbeat in the lock file: a holder that stops beating for the stale time (paused, or on
    a host that vanished from a shared folder) has its lock file moved aside and the lease taken over."""
    import fcntl

    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, LEASE_FILE)
    for attempt in range(2):
        handle = open(path, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = _read_holder(handle)
            handle.close()
            beat = float(holder.get("heartbeat", holder.get("since", time.time())))
            gone = holder_gone(holder)
            if attempt == 0 and (gone or time.time() - beat >= stale_s()):
                if gone:
                    _taken_over(root, holder)
                # the holder keeps its lock on the file moved aside; its next write finds it lost (check_fence)
                with contextlib.suppress(FileNotFoundError):
                    os.replace(path, f"{path}.stale-{uuid.uuid4().hex[:8]}")
                continue
            raise _busy(root, holder) from None
    mine = _owner()
    mine["heartbeat"] = time.time()
    lease = _LocalLease(_key(root), path, handle, mine)
    lease.write(mine)
    with _hold(lease):
        yield


@contextlib.contextmanager
def _hold(lease: "_LocalLease | _ObjectLease") -> Iterator[None]:
    """The one heartbeat of both leases: ``lease.renew()`` every :func:`heartbeat_s` seconds on a daemon thread while
    the block runs (until the lease is found lost), the lease registered for :func:`check_fence`; after the block it
    is checked once more, so a holder that lost the lease while its block ran reports it (LeaseLostError); then the
    heartbeat stops and the lease is released."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(heartbeat_s()) and not lease.lost:
            with contextlib.suppress(Exception):  # a missed beat only shortens the lease
                lease.renew()

    thread = threading.Thread(target=beat, name="compat-lease-heartbeat", daemon=True)
    previous = _HELD.get(lease.root)
    _HELD[lease.root] = lease
    thread.start()
    try:
        yield
        lease.check(fresh=True)  # a holder that lost the lease while its block ran reports it
    finally:
        stop.set()
        thread.join(timeout=5)
        if previous is not None:
            _HELD[lease.root] = previous
        else:
            _HELD.pop(lease.root, None)
        lease.release()


class _ObjectLease:
    """A held S3 lease: the ETag of the lease object as this holder last wrote it (the fencing token)."""

    def __init__(self, root: str, uri: str, owner: dict, etag: str, objects) -> None:
        self.root, self.uri, self.owner, self.etag, self.objects = root, uri, owner, etag, objects
        self.lost = False
        self.lock = threading.Lock()
        self.verified = time.monotonic()

    def renew(self) -> None:
        """Rewrite the heartbeat only while the object is still this holder's (If-Match); lost otherwise."""
        with self.lock:
            if self.lost:
                return
            self.owner["heartbeat"] = time.time()
            try:
                self.etag = self.objects.write(self.uri, json.dumps(self.owner).encode("utf-8"), if_match=self.etag)
                self.verified = time.monotonic()
            except PreconditionFailed:
                self.lost = True

    def check(self, fresh: bool = False) -> None:
        """LeaseLostError when another driver took the lease over (checked against the object's ETag at most once
        a second, always after a pause, e.g. SIGSTOP, longer than that; every time when ``fresh``)."""
        with self.lock:
            if not self.lost and (fresh or time.monotonic() - self.verified > 1.0):
                self.lost = self.objects.etag(self.uri) != self.etag
                self.verified = time.monotonic()
            if self.lost:
                raise LeaseLostError(
                    f"run folder {self.root}: this process (pid {os.getpid()}) lost its lease to another driver "
                    f"(no heartbeat for {stale_s():g} s, e.g. while it was paused); it stops without writing")

    def release(self) -> None:
        """Mark the lease released, so the next driver takes it at once; conditional (If-Match), never over
        another holder's lease."""
        with self.lock:
            if not self.lost:
                self.owner["heartbeat"] = 0.0
                with contextlib.suppress(Exception):
                    self.objects.write(self.uri, json.dumps(self.owner).encode("utf-8"), if_match=self.etag)


_HELD: dict[str, "_ObjectLease | _LocalLease | LeaseFence"] = {}
_CONDITIONAL = None


def set_conditional_objects(objects):
    """Install what reads and conditionally writes ``s3://`` objects (``read``, ``etag``, ``write`` with
    ``if_match`` / ``create``; cluster.storage.s3 installs its S3 client); returns the previous one."""
    global _CONDITIONAL
    previous, _CONDITIONAL = _CONDITIONAL, objects
    return previous


def _key(root: str) -> str:
    """The one spelling of a run folder for the leases this process holds: an absolute local path (a relative one
    names the same folder as its absolute form), an object-store URI without its trailing slash."""
    text = os.fspath(root).rstrip("/")
    return text if cio.is_remote(text) else os.path.abspath(text)


def holds_lease(root: str) -> bool:
    """Whether this process holds the lease of run folder ``root`` now (taken with :func:`run_lease`, checked fresh:
    not taken over since). A fence held for another process's lease (a worker) does not count."""
    lease = _HELD.get(_key(root))
    if not isinstance(lease, (_LocalLease, _ObjectLease)):
        return False
    try:
        lease.check(fresh=True)
    except LeaseLostError:
        return False
    return True


def check_fence(root: str) -> None:
    """Raise LeaseLostError when this process held the lease of ``root`` and another driver has taken it over;
    every write of a RunStore calls this, so a paused driver that wakes up commits nothing."""
    lease = _HELD.get(_key(root))
    if lease is not None:
        lease.check()


@dataclass(frozen=True)
class LeaseFence:
    """A holder's lease as another process writing for it (a Ray worker) checks it: the lock file the holder
    locked (``lock_file``, by inode: the one number a shared filesystem shows alike on every host, and by the owner
    ``token`` the holder wrote into it, so a lease released and taken again by another driver fails the check too)
    or the lease object with the holder's owner ``token``."""

    root: str
    holder: str
    lock_file: str = ""
    inode: int = 0
    uri: str = ""
    token: str = ""

    def held(self) -> bool:
        """Whether the holder still has the lease now (one stat, or one read of the lease object)."""
        if self.lock_file:
            try:
                info = os.stat(self.lock_file)
            except FileNotFoundError:
                return False
            owner = _read_lock_file(self.lock_file)
            return (info.st_ino == self.inode and owner.get("token") == self.token
                    and float(owner.get("heartbeat") or 0.0) > 0.0)
        if _CONDITIONAL is None:
            raise RuntimeError(f"run folder {self.root}: checking the driver's s3:// lease needs object storage "
                               f"configured in this process (cluster.storage.s3.configure_object_storage)")
        current = _CONDITIONAL.read(self.uri)
        try:
            owner = json.loads(current[0].decode("utf-8")) if current else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            owner = {}
        return owner.get("token") == self.token and float(owner.get("heartbeat") or 0.0) > 0.0

    def check(self) -> None:
        """LeaseLostError naming the run folder when the holder no longer has the lease (checked at every call:
        a worker's writes are few, and its commit must never follow a takeover)."""
        if not self.held():
            raise LeaseLostError(
                f"run folder {self.root}: the driver this process writes for ({self.holder}) no longer holds the "
                f"run folder's lease (another driver took it over, e.g. after the driver was paused past "
                f"{stale_s():g} s, or it was released); this process (pid {os.getpid()} on {socket.gethostname()}) "
                f"commits nothing")


def lease_fence(root: str) -> LeaseFence | None:
    """The fence of the lease this process holds on ``root`` (None when it holds none), for the processes that
    write for it: they write inside :func:`hold_fence`."""
    lease = _HELD.get(_key(root))
    if isinstance(lease, _LocalLease):
        return LeaseFence(lease.root, f"pid {os.getpid()} on {socket.gethostname()}",
                          lock_file=os.path.abspath(lease.path), inode=os.fstat(lease.handle.fileno()).st_ino,
                          token=lease.token)
    if isinstance(lease, _ObjectLease):
        return LeaseFence(lease.root, f"pid {lease.owner['pid']} on {lease.owner['host']}", uri=lease.uri,
                          token=lease.owner["token"])
    return lease  # a fence held by this process (or none) passes on unchanged


@contextlib.contextmanager
def hold_fence(root: str, fence: LeaseFence | None) -> Iterator[None]:
    """Write to run folder ``root`` under another process's lease for the block: every :func:`check_fence` of
    ``root`` (each RunStore write) checks ``fence`` first. Refuses at once when the lease is already gone."""
    if fence is None:
        yield
        return
    fence.check()
    key = _key(root)
    previous = _HELD.get(key)
    _HELD[key] = fence
    try:
        yield
    finally:
        if previous is not None:
            _HELD[key] = previous
        else:
            _HELD.pop(key, None)


@contextlib.contextmanager
def _object_lease(root: str) -> Iterator[None]:
    objects = _CONDITIONAL
    if objects is None:
        raise RuntimeError(f"run folder {root}: an s3:// lease needs conditional writes; configure object storage "
                           f"first (cluster.storage.s3.configure_object_storage)")
    uri = cio.join(root, LEASE_FILE + ".json")
    mine = _owner()
    current = objects.read(uri)
    mine["heartbeat"] = time.time()
    body = json.dumps(mine).encode("utf-8")
    try:
        if current is None:
            etag = objects.write(uri, body, create=True)
        else:
            try:
                holder = json.loads(current[0].decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                holder = {}
            gone = holder_gone(holder)
            if not gone and time.time() - float(holder.get("heartbeat", 0)) < stale_s():
                raise _busy(root, holder)
            if gone:
                _taken_over(root, holder)
            etag = objects.write(uri, body, if_match=current[1])  # only over the stale lease just read
    except PreconditionFailed:
        now = objects.read(uri)
        raise _busy(root, json.loads(now[0].decode("utf-8")) if now else {}) from None
    lease = _ObjectLease(_key(root), uri, mine, etag, objects)
    with _hold(lease):
        yield
