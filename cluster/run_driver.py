"""What a driver does around one pipeline run, for every command that runs one (``compat run``, ``compat demo``):
the executor (local, or Ray), the run inside the tracker's pipeline scope with progress display, and MLflow model
sources of a config (the registry's URI resolvers registered here and in Ray workers; aliases pinned to versions)."""
from __future__ import annotations

import functools
import os
import re

from cluster.executors import build_executor
from cluster.model_registry.versions import register_mlflow_resolvers, version_by_alias
from pipelines.config.load import ConfigError
from pipelines.config.redaction import redact_uri
from pipelines.engine.backends import address_refusal
from pipelines.engine.progress import ProgressReporter


def make_executor(kind: str = "local", address: str | None = None, emit=None, progress: bool = True,
                  num_cpus: int | None = None, setup=None):
    """The executor registered as ``kind`` (:data:`pipelines.engine.backends.EXECUTORS`: local, ray, ...), whose
    module is imported only now: a local run needs no Ray, so it runs on a machine without Ray (a bare GPU machine)
    and does not pay for importing it. ``emit`` receives every record; num_cpus: CPUs of an instance a cluster
    executor starts itself; setup: picklable callable run in a cluster worker before each node (e.g. MLflow URI
    resolvers)."""
    refusal = address_refusal(kind, address)
    if refusal is not None:
        raise SystemExit(refusal)
    return build_executor(kind, emit=emit, progress=progress, address=address, setup=setup, num_cpus=num_cpus)


def run_tracked(graph, store, tracker, kind: str = "local", address: str | None = None, progress: bool = True,
                sinks: tuple = (), num_cpus: int | None = None, setup=None, label: str = "", on_executor=None):
    """Run ``graph`` on the chosen executor inside the tracker's pipeline scope; every record goes to the progress
    display (bars when ``progress`` and on a terminal, else flushed lines, prefixed with ``label`` when given), the
    tracker and ``sinks``. ``on_executor(executor)`` is called after the run (e.g. to read RayExecutor.last_stats).
    Returns the executor's Invocation."""
    emit = ProgressReporter(enabled=progress, sinks=[tracker, *sinks], label=label)
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


__all__ = ["make_executor", "model_sources_setup", "pin_model_aliases", "run_tracked"]
