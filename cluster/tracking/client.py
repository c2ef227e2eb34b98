"""MLflow stores and clients: the tracking-URI check (credentials moved out of the URI), a lock around a SQLite
store's creation, experiments, and batched param / metric logging."""
from __future__ import annotations

import contextlib
import os
import re
import ssl
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.error import HTTPError, URLError
from urllib.request import urlopen

from cluster.tracking.ui import EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND, experiment_ui_tags
from pipelines.config.redaction import redact_uri, split_uri_credentials


def ensure_experiment(client: Any, name: str) -> str:
    """Id of experiment ``name``, created when missing (concurrent creation tolerated) and marked as a model-training
    experiment for MLflow's UI with the summary metrics' runs view (:func:`cluster.tracking.ui.experiment_ui_tags`;
    an existing experiment gets them as it is used, except that a kind set in the UI stays). With a SQLite store its
    artifacts go to ``<db folder>/mlartifacts``, never to ./mlruns of whatever folder the command ran in."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":
            raise ValueError(f"experiment {name!r} is deleted on {redact_uri(client.tracking_uri)}; restore it "
                             f"(mlflow experiments restore) or choose another experiment name")
        for key, value in experiment_ui_tags().items():
            current = (found.tags or {}).get(key)
            # a kind chosen in the UI stays; the product's own view follows this version of the product
            if current is None or (key != EXPERIMENT_KIND_TAG and current != value):
                client.set_experiment_tag(found.experiment_id, key, value)
        return found.experiment_id
    location = None
    if client.tracking_uri.startswith("sqlite:///"):
        location = (Path(client.tracking_uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
    try:
        return client.create_experiment(name, artifact_location=location, tags=experiment_ui_tags())
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":  # created concurrently by another driver
            raise
        return client.get_experiment_by_name(name).experiment_id


@contextlib.contextmanager
def sqlite_store_lock(tracking_uri: str) -> Iterator[None]:
    """Exclusive lock on ``<db>.lock`` next to a SQLite store (no-op for servers): two processes that open a new
    shared store at once would both run MLflow's schema migration, and one of them dies in it."""
    if not tracking_uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    database = Path(tracking_uri[len("sqlite:///"):])
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{database}.lock", "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def check_tracking_uri(uri: str) -> str:
    """Accept ``sqlite:///PATH``, ``http://`` and ``https://`` tracking URIs; raise ValueError otherwise.

    A ``user:password@`` part is moved into MLflow's standard ``MLFLOW_TRACKING_USERNAME`` /
    ``MLFLOW_TRACKING_PASSWORD`` variables and the URI is returned without it, so the password is never printed,
    logged, stored in a search folder or sent to Ray with the URI (local Ray workers inherit the variables)."""
    if not isinstance(uri, str) or not re.match(r"^(sqlite:///.+|https?://[^/\s]+.*)$", uri):
        raise ValueError(f"tracking URI {redact_uri(uri)!r}: expected sqlite:///PATH or an http(s):// MLflow "
                         f"tracking server")
    clean, user, password = split_uri_credentials(uri)
    if user is not None:
        os.environ["MLFLOW_TRACKING_USERNAME"] = user
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password or ""
    return clean


WAIT_VARIABLE = "COMPAT_TRACKING_WAIT_S"
DEFAULT_WAIT_S = 20.0
# MLflow's own HTTP retries (7 retries, backoff factor 2: minutes of silence on a server that went away) bounded
# for the whole command: 4 retries 1, 2, 4, 8 s apart (MLflow's per-request timeout is kept for large uploads); a
# variable the user set wins
MLFLOW_HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "4", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


def bound_mlflow_http_retries() -> None:
    """Set MLflow's HTTP retry and timeout variables to :data:`MLFLOW_HTTP_LIMITS` where the user did not."""
    for name, value in MLFLOW_HTTP_LIMITS.items():
        os.environ.setdefault(name, value)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def wait_for_tracking_server(uri: str, total_s: float | None = None, log: Callable[[str], None] = _stderr) -> None:
    """Wait until the MLflow server at the ``http(s)://`` ``uri`` answers HTTP (any status: the server is there),
    retrying with backoff (0.5, 1, 2, 4 s ...) for at most ``total_s`` seconds (default ``$COMPAT_TRACKING_WAIT_S``,
    else 20); says what it waits for after the first failed try. ConnectionError naming the URI otherwise. A
    ``sqlite:///`` store is not probed."""
    if not uri.startswith(("http://", "https://")):
        return
    total_s = float(os.environ.get(WAIT_VARIABLE, DEFAULT_WAIT_S)) if total_s is None else total_s
    shown, started, delay, tries, reason = redact_uri(uri), time.monotonic(), 0.5, 0, ""
    while True:
        tries += 1
        left = total_s - (time.monotonic() - started)
        try:
            with urlopen(uri.rstrip("/") + "/health", timeout=max(min(5.0, left), 0.5)):
                return
        except HTTPError:
            return  # an HTTP answer (401, 404, ...): a server is there
        except (URLError, OSError, ValueError) as error:
            if isinstance(getattr(error, "reason", error), ssl.SSLError):
                return  # a TLS server answered; MLflow applies its own certificate settings
            reason = str(getattr(error, "reason", error))
        left = total_s - (time.monotonic() - started)
        if left <= 0:
            raise ConnectionError(f"the MLflow tracking server at {shown} does not answer ({reason}; {tries} tries "
                                  f"in {time.monotonic() - started:.0f} s); start it, give another --tracking-uri, "
                                  f"or --tracking-uri none to run without tracking")
        if tries == 1:
            log(f"waiting for the MLflow tracking server at {shown} ({reason}); retrying for up to {total_s:.0f} s")
        time.sleep(min(delay, left))
        delay = min(2 * delay, 5.0)


PROGRESS_BAR_VARIABLE = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


def open_client(tracking_uri: str) -> Any:
    """An MlflowClient for ``tracking_uri`` and its model registry (as resolved by
    :func:`cluster.tracking.store.resolve_tracking`: checked, without credentials). A SQLite store is created or
    migrated under :func:`sqlite_store_lock` first, so processes that open a fresh store at once take turns.
    MLflow's artifact download bars are switched off in this process (unless ``MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR``
    is set): the product's downloads are small model files, and the bars only clutter its logs."""
    from mlflow import MlflowClient

    os.environ.setdefault(PROGRESS_BAR_VARIABLE, "false")
    with sqlite_store_lock(tracking_uri):  # no-op for servers
        # MLflow creates and migrates a SQLite store as the client (and its first registry call) opens it
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        if tracking_uri.startswith("sqlite:///"):
            client.search_registered_models(max_results=1)
    return client


def tracking_credentials_from_environment() -> None:
    """``MLFLOW_TRACKING_URI`` with ``user:password@``: the credentials moved to MLflow's username / password
    variables and the variable rewritten without them (call once, before Ray starts: workers inherit both)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri and split_uri_credentials(uri)[1] is not None:
        os.environ["MLFLOW_TRACKING_URI"] = check_tracking_uri(uri)


def log_params(client: Any, run_id: str, params: dict[str, str]) -> None:
    """Log ``params`` (sorted by key) in batches of 100, the most MLflow accepts at once."""
    from mlflow.entities import Param

    items = [Param(key, value) for key, value in sorted(params.items())]
    for start in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
        client.log_batch(run_id, params=items[start:start + 100], synchronous=True)


def log_metrics(client: Any, run_id: str, values: dict[str, Any], step: int) -> None:
    """Log ``values`` (None skipped) at ``step`` with one timestamp (ms), in batches of 1000."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(key, float(value), now, int(step)) for key, value in values.items() if value is not None]
    for start in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[start:start + 1000], synchronous=True)


__all__ = ["EXPERIMENT_KIND_TAG", "MODEL_TRAINING_KIND", "bound_mlflow_http_retries", "check_tracking_uri",
           "ensure_experiment", "log_metrics", "log_params", "open_client", "sqlite_store_lock",
           "tracking_credentials_from_environment", "wait_for_tracking_server"]
