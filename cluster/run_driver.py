"""What a driver does around one pipeline run, for every command that runs one (``compat run``, ``compat demo``):
the executor (local, or Ray), the run inside the tracker's pipeline scope with progress display, and MLflow model
sources of a config (the registry's URI resolvers registered here and in Ray workers; aliases pinned to versions)."""
from __future__ import annotations

import functools

from cluster.executors import build_executor
from cluster.model_registry.versions import pinned_model_uri, register_mlflow_resolvers
from cluster.tracking.client import open_client
from pipelines.config.load import ConfigError
from pipelines.config.model_uri import is_model_uri, parse_model_uri
from pipelines.engine.backends import address_refusal
from pipelines.engine.progress import ProgressReporter
from pipelines.reports.run_report import ReportWriter


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

    The registry is the one of the command's tracking store (``tracking_uri``, resolved once by
    :func:`cluster.tracking.store.resolve_tracking`); a ConfigError names the source when tracking is off (None)."""
    sources = {f"replacements[{i}].source": r.source for i, r in enumerate(config.replacements)}
    sources["initial_model"] = config.initial_model or ""
    mlflow_sources = {key: uri for key, uri in sources.items() if is_model_uri(uri) or uri.startswith("runs:/")}
    if not mlflow_sources:
        return None
    if tracking_uri is None:
        key, source = next(iter(mlflow_sources.items()))
        raise ConfigError(f"{key}: {source!r} is read from an MLflow model registry, but tracking is off "
                          f"(--tracking-uri none); give --tracking-uri http(s)://HOST:PORT (or set "
                          f"MLFLOW_TRACKING_URI) naming the server that holds it")
    register_mlflow_resolvers(tracking_uri)
    return functools.partial(register_mlflow_resolvers, tracking_uri)


def pin_model_aliases(config, tracking_uri: str | None):
    """``models:/NAME@ALIAS`` sources rewritten as ``models:/NAME/VERSION`` (the version the alias names now), so
    the stage keys hash immutable content: moving the alias later never reuses stages trained from the old
    version, and config.yaml records which version was used. Other configs are returned unchanged."""
    sources = {"initial_model": config.initial_model or ""}
    sources.update({f"replacements[{i}].source": r.source for i, r in enumerate(config.replacements)})
    aliased = {key: parse_model_uri(source, key) for key, source in sources.items() if is_model_uri(source)}
    aliased = {key: uri for key, uri in aliased.items() if uri.alias is not None}
    if not aliased:
        return config
    client = open_client(tracking_uri)

    def pinned(key: str, source: str) -> str:
        if key not in aliased:
            return source
        try:
            return str(pinned_model_uri(client, aliased[key]))
        except FileNotFoundError as error:
            raise FileNotFoundError(f"{key}: {error}") from None

    replacements = [r.model_copy(update={"source": pinned(f"replacements[{i}].source", r.source)})
                    for i, r in enumerate(config.replacements)]
    return config.model_copy(update={"replacements": replacements,
                                     "initial_model": pinned("initial_model", config.initial_model)})


__all__ = ["make_executor", "model_sources_setup", "pin_model_aliases", "run_tracked", "submits_job"]
