"""What a driver does around one pipeline run, for every command that runs one (``compat run``, ``compat demo``):
the executor (local, or Ray), the run inside the tracker's pipeline scope with progress display, and MLflow model
sources of a config (the registry's URI resolvers registered here and in Ray workers; aliases pinned to versions)."""
from __future__ import annotations

import functools
import importlib
import os
import re

from cluster.model_registry.versions import register_mlflow_resolvers, version_by_alias
from pipelines.config.load import ConfigError
from pipelines.config.redaction import redact_uri
from pipelines.engine.executor import LocalExecutor
from pipelines.engine.progress import ProgressReporter
from pipelines.reports.run_report import ReportWriter


def make_executor(kind: str = "local", address: str | None = None, emit=None, progress: bool = True,
                  num_cpus: int | None = None, setup=None):
    """LocalExecutor, or cluster.ray.executor.RayExecutor for kind "ray". ``emit`` receives every record; num_cpus:
    CPUs of an embedded Ray instance (Ray only); setup: picklable callable run in a Ray worker before each node (e.g.
    MLflow URI resolvers)."""
    if kind == "ray":
        # imported when chosen, as app.dispatch imports a command's module: a local run needs no Ray, so it runs on a
        # machine without Ray (a bare GPU machine) and does not pay for importing it
        ray_executor = importlib.import_module("cluster.ray.executor")
        kwargs = {"num_cpus": num_cpus} if num_cpus is not None else {}
        return ray_executor.RayExecutor(address=address, emit=emit, progress=progress, setup=setup, **kwargs)
    if address:
        raise SystemExit("--address applies to --executor ray only")
    return LocalExecutor(emit=emit, progress=progress)


def submits_job(kind: str, address: str | None) -> bool:
    """Whether the run is submitted as a Ray Job (``--executor ray --address http(s)://...``): the job runs
    `compat run` on the cluster, which tracks the run and writes its reports there."""
    return kind == "ray" and (address or "").startswith(("http://", "https://"))


def run_tracked(graph, store, tracker, kind: str = "local", address: str | None = None, progress: bool = True,
                sinks: tuple = (), num_cpus: int | None = None, setup=None, label: str = "", on_executor=None):
    """Run ``graph`` on the chosen executor inside the tracker's pipeline scope; every record goes to the progress
    display (bars when ``progress`` and on a terminal, else flushed lines, prefixed with ``label`` when given), the
    tracker and ``sinks``. A run the engine completes gets its reports (report.md, matrix.png, ...) when the engine
    emits its result (:class:`ReportWriter`), before the executor closes the tracker, which logs them.
    ``on_executor(executor)`` is called after the run (e.g. to read RayExecutor.last_stats). Returns the executor's
    Invocation."""
    reports = [] if submits_job(kind, address) else [ReportWriter(store)]
    emit = ProgressReporter(enabled=progress, sinks=[*reports, tracker, *sinks], label=label)
    executor = make_executor(kind, address, emit, progress, num_cpus, setup)
    with tracker.pipeline(graph, store):
        summary = executor.run(graph, store)
    if on_executor is not None:
        on_executor(executor)
    return summary


def model_sources_setup(config, tracking_uri: str | None):
    """When ``initial_model`` or a replacement source is an MLflow ``models:/`` or ``runs:/`` URI, register the MLflow
    URI resolvers in this process and return the same registration as a setup callable for Ray workers; else None.

    The registry is the one of ``--tracking-uri`` (else ``MLFLOW_TRACKING_URI``); a ConfigError names the source
    when neither is given."""
    sources = {f"replacements[{i}].source": r.source for i, r in enumerate(config.replacements)}
    sources["initial_model"] = config.initial_model or ""
    mlflow_sources = {key: uri for key, uri in sources.items() if uri.startswith(("models:/", "runs:/"))}
    if not mlflow_sources:
        return None
    uri = tracking_uri if tracking_uri not in (None, "none") else os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        key, source = next(iter(mlflow_sources.items()))
        raise ConfigError(f"{key}: {source!r} is read from an MLflow model registry; give --tracking-uri "
                          f"http(s)://HOST:PORT (or set MLFLOW_TRACKING_URI) naming the server that holds it")
    register_mlflow_resolvers(uri)
    return functools.partial(register_mlflow_resolvers, uri)


def pin_model_aliases(config, tracking_uri: str | None):
    """``models:/NAME@ALIAS`` sources rewritten as ``models:/NAME/VERSION`` (the version the alias names now), so
    the stage keys hash immutable content: moving the alias later never reuses stages trained from the old
    version, and config.yaml records which version was used. Other configs are returned unchanged."""
    pattern = re.compile(r"^models:/(?P<name>[^/@]+)@(?P<alias>[A-Za-z0-9_-]+)/?$")
    if not any(pattern.match(r.source) for r in config.replacements) and not pattern.match(config.initial_model or ""):
        return config
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    def pinned(key: str, source: str) -> str:
        match = pattern.match(source or "")
        if match is None:
            return source
        found = version_by_alias(client, match["name"], match["alias"])
        if found is None:
            raise FileNotFoundError(f"{key}: registered model {match['name']!r} has no alias {match['alias']!r} "
                                    f"on {redact_uri(tracking_uri)}")
        return f"models:/{match['name']}/{found.version}"

    replacements = [r.model_copy(update={"source": pinned(f"replacements[{i}].source", r.source)})
                    for i, r in enumerate(config.replacements)]
    return config.model_copy(update={"replacements": replacements,
                                     "initial_model": pinned("initial_model", config.initial_model)})


__all__ = ["make_executor", "model_sources_setup", "pin_model_aliases", "run_tracked", "submits_job"]
