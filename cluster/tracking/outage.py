"""A run that goes on while its MLflow tracking server does not answer, and says so.

:class:`RecordQueue` hands a tracker's records to one worker thread, in order, so the stages never wait for MLflow:
training and evaluation go on while a request hangs. :class:`ServerWatch` times the request in flight: once one has
waited ``notice_s`` seconds (4) it asks the server's ``/health`` with a short timeout, and when that gets no answer
either it prints one line naming the server and what the run does meanwhile; when the request completes it prints
one line saying the server answers again. A request MLflow gives up on (after its bounded retries,
``MLFLOW_HTTP_REQUEST_TIMEOUT`` / ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``) stops the tracking of this invocation with one
line; the records after it are not sent, the stages still run and commit, and the error is raised when the tracker
finishes (a later ``compat run --resume`` of the folder logs the committed stages).
"""
from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from typing import Any, Callable, Iterator
from urllib.error import HTTPError
from urllib.request import urlopen

from pipelines.config.redaction import redact_uri

NOTICE_S = 4.0  # a request in flight this long gets the server probed (a silent server is named within 10 s)
PROBE_TIMEOUT_S = 2.0  # so a silent server is named about 6.5 s into a request, within 10 s
POLL_S = 0.5


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def server_answers(uri: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the MLflow server at ``uri`` answers an HTTP request to ``/health`` within ``timeout_s`` seconds."""
    try:
        with urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
            return True
    except HTTPError:
        return True  # an HTTP status is an answer
    except (OSError, ValueError):
        return False


class ServerWatch:
    """Times the tracker's requests to the MLflow server at ``uri`` from a daemon thread (see the module docstring).
    ``log`` receives the notice lines."""

    def __init__(self, uri: str, notice_s: float = NOTICE_S, log: Callable[[str], None] = _stderr,
                 answers: Callable[[str], bool] = server_answers) -> None:
        self.uri, self.shown = uri, redact_uri(uri)
        self.notice_s, self.log, self.answers = notice_s, log, answers
        self._since: float | None = None
        self._describe: Callable[[bool], str] = str
        self._silent_since: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def request(self, describe: Callable[[bool], str]) -> Iterator[None]:
        """Scope of one tracker call; ``describe(back)`` ends the notice lines: what the run does while the server is
        silent (``back`` False), what happens now that it answers (True)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mlflow-watch", daemon=True)
            self._thread.start()
        with self._lock:
            self._since, self._describe = time.monotonic(), describe
        try:
            yield
        finally:
            with self._lock:
                self._since, silent = None, self._silent_since
                self._silent_since = None
            if silent is not None:
                self.log(f"MLflow: the tracking server at {self.shown} answers again after "
                         f"{time.monotonic() - silent:.0f} s; {describe(True)}")

    def _loop(self) -> None:
        probed = None
        while not self._stop.wait(POLL_S):
            with self._lock:
                since, describe, silent = self._since, self._describe, self._silent_since
            if since is None or silent is not None or time.monotonic() - since < self.notice_s:
                continue
            if probed == since:  # this request's server answered the probe: slow, not gone
                continue
            probed = since
            if self.answers(self.uri):
                continue
            with self._lock:
                if self._since != since:
                    continue  # the request completed during the probe
                self._silent_since = since
            self.log(f"MLflow: the tracking server at {self.shown} does not answer (a request has waited "
                     f"{time.monotonic() - since:.0f} s and /health gets no answer); {describe(False)}")

    def close(self) -> None:
        self._stop.set()


class RecordQueue:
    """Records handed to ``handle`` by one worker thread, in order, each call under ``watch`` (module docstring)."""

    def __init__(self, handle: Callable[[Any], None], watch: ServerWatch) -> None:
        self.handle, self.watch = handle, watch
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def describe(self, back: bool) -> str:
        """The notice lines' second half (:meth:`ServerWatch.request`)."""
        if back:
            return f"sending the {self._queue.qsize()} queued tracking record(s)"
        return (f"the run goes on and its tracking records wait in order ({self._queue.qsize()} queued), sent when "
                f"the server answers")

    def put(self, record: Any) -> None:
        """Queue ``record`` (dropped once tracking stopped on an error)."""
        if self.error is not None:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="mlflow-records", daemon=True)
            self._thread.start()
        self._queue.put(record)

    def drain(self) -> None:
        """Wait until every queued record was handled (or dropped after an error); then raise that error."""
        self._queue.join()
        if self.error is not None:
            raise self.error

    def _work(self) -> None:
        while True:
            record = self._queue.get()
            try:
                if self.error is None:
                    with self.watch.request(self.describe):
                        self.handle(record)
            except Exception as error:  # noqa: BLE001 - kept and raised by drain(); the stages go on
                self.error = error
                self.watch.log(f"MLflow: tracking of this run stopped at a record the server at {self.watch.shown} "
                               f"did not take ({type(error).__name__}: {str(error)[:300]}); the run goes on "
                               f"untracked (a later --resume of its folder logs the committed stages)")
            finally:
                self._queue.task_done()


__all__ = ["NOTICE_S", "RecordQueue", "ServerWatch", "server_answers"]
