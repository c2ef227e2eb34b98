"""Stopping every process a command started: a local Ray instance's GCS, raylet, dashboard and runtime-env agents and
workers, which ``ray.shutdown`` alone can leave behind (the agents outlive a raylet it kills).

The processes are listed while the tree is intact (:func:`descendants`), then stopped within a bound
(:func:`stop_processes`): SIGTERM, a grace period, SIGKILL for the rest. psutil is the copy Ray ships, importable
once ``ray`` is imported.
"""
from __future__ import annotations

import logging
import os

LOG = logging.getLogger("compat.processes")


def descendants(pid: int | None = None) -> list:
    """psutil.Process objects of every living descendant of ``pid`` (default: this process)."""
    import ray  # noqa: F401 - puts Ray's bundled psutil on the path
    import psutil

    try:
        return psutil.Process(os.getpid() if pid is None else pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def stop_processes(processes: list, grace_s: float = 15.0, what: str = "child processes") -> list[str]:
    """SIGTERM each of ``processes`` still running, wait up to ``grace_s`` seconds, SIGKILL the rest and wait up to 5 s
    more; returns ``name(pid)`` of those that needed SIGKILL. A process is identified with its start time, so a reused
    pid is never signalled."""
    import ray  # noqa: F401 - puts Ray's bundled psutil on the path
    import psutil

    def alive(candidates):
        living = []
        for process in candidates:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    living.append(process)
            except psutil.NoSuchProcess:
                continue
        return living

    living = alive(processes)
    if not living:
        return []
    LOG.info("stopping %d %s (waiting up to %.0f s)", len(living), what, grace_s)
    for process in living:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            continue
    _, living = psutil.wait_procs(living, timeout=grace_s)
    living = alive(living)
    killed = []
    for process in living:
        try:
            killed.append(f"{process.name()}({process.pid})")
            process.kill()
        except psutil.NoSuchProcess:
            continue
    if living:
        psutil.wait_procs(living, timeout=5.0)
        LOG.warning("%s still running after %.0f s, killed: %s", what, grace_s, ", ".join(killed))
    return killed


__all__ = ["descendants", "stop_processes"]
