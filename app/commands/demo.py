"""`compat demo`: the README's main job: ER vs d-Simplex-HOC with replacements on the offline glyph set.

Both scenarios (configs/demo-er.yaml, configs/demo-dsimplex-hoc.yaml) run at the same time in two worker
processes with one torch thread each when the machine has at least two cores: the demo's 4-layer CNN gains little
from a second intra-op thread, and two single-threaded processes keep both cores busy without the OpenMP barrier
stalls that two threads per process suffer when other work shares the cores (measured ~10x slower steps then).
``--jobs 1`` runs them one after the other with every core. Runs are resumable like `compat run`.

By default both scenarios run on the embedded defaults of the product: this process starts ONE local Ray instance
(all cores, bound to 127.0.0.1) and both workers attach to it as drivers, so Ray schedules the stages of both
scenarios on the machine's cores (a core one scenario leaves idle, e.g. while its other stages wait for a model,
runs the other's work). Each scenario keeps its own run folder and store; both are tracked in one MLflow
experiment in the machine's MLflow store (``compat ui``). ``--executor local`` runs the stages in-process instead.

The three third-party models are trained once for both scenarios: both configs pre-train d-Simplex models
(ER's entries say ``classifier: simplex``; ER adopts each with exactly its logits as a learnable head), so their
pretrain stages have the same keys, and both runs share ``<output>/third-party`` as ``output.shared_store``: the
first run to need a model claims and trains it, publishes it there, and the other run copies it instead of
training it (``pipelines.store.shared_store``).

``--seeds 0,1,2`` runs the demo once per seed into ``<output>/seed-<s>/`` (``--set seed=<s>``: initialisation, batch
order, replay memory and the third-party models follow it), evaluated on the test pool, then evaluates the same
models on the validation pool (``val-query`` / ``val-gallery``) in ``<output>/seed-<s>/validation/``: a run folder
holds one scenario, so the validation runs start from verified copies of the trained models (same stage keys) and
only extract and score. It prints and writes (``<output>/seeds.md``, ``seeds.json``) the metrics of both methods
as mean and spread over the seeds (``pipelines.reports.seed_spread``).
"""
from __future__ import annotations

import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from app.printing import print_results
from cluster.ray.task_backend import connect
from cluster.run_driver import run_tracked
from cluster.tracking.run_identity import run_intent
from cluster.tracking.tracker import create_tracker
from compat_core.hardware import calibration
from pipelines.config.load import ConfigError, load_config
from pipelines.config.local_paths import absolute_location
from pipelines.config.redaction import redact_uri
from pipelines.config.run_origin import RunOrigin
from pipelines.graph.compile import compile_scenario, stage_threads
from pipelines.reports import seed_spread
from pipelines.reports.picture_grid import side_by_side
from pipelines.store.lease import run_lease
from pipelines.stages.run_precision import resolve_run_precision
from pipelines.store.run_store import RunStore
from pipelines.store.shared_store import copy_stage
from pipelines.training.settings import precision_name

DEMOS = (("er", "demo-er.yaml"), ("dsimplex-hoc", "demo-dsimplex-hoc.yaml"))
SHARED_FOLDER = "third-party"  # <output>/third-party: the shared store of both scenarios' third-party models
# ``--seeds``: (pool, overrides that evaluate on it, sub-folder of the seed folder) of each seed's passes: the test
# pool (the configs' own) first; the validation pass starts from copies of the test pass's trained models
POOLS = (("test", [], ""),
         ("validation", ["evaluation.query_set.split=val-query", "evaluation.gallery_set.split=val-gallery"],
          "validation"))


def configs_dir() -> Path:
    """configs/ of the checkout (next to the pipelines package)."""
    return Path(__file__).resolve().parents[2] / "configs"


def run_one(name: str, config_path: str, overrides: list[str], run_dir: str, threads: int | None,
            progress: str, executor: str = "local", tracking_uri: str | None = None,
            experiment: str | None = None, address: str | None = None, command: tuple[str, ...] = ()) -> dict:
    """Run one demo scenario from this process; returns matrix, metrics, wall and CPU seconds of the run.

    threads: torch intra-op threads (None: leave torch's default; with executor "ray" and no ``address``: the CPUs
    of an embedded Ray instance, default 1). progress: "bars", "lines" or "none". tracking_uri: the resolved store
    (None: tracking off). address: the Ray instance to attach to (the demo's shared one). CPU seconds count this
    process only. command: the demo's command line (recorded in each run's config.yaml).
    """
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    config = resolve_run_precision(load_config(config_path, overrides))

    with run_lease(run_dir):
        tracker = create_tracker(tracking_uri, experiment=experiment,
                                 intent=run_intent(config_path, overrides, config))
        graph, store = compile_scenario(config), RunStore(run_dir)
        graph.origin = RunOrigin.of_command(command, overrides)
        started = time.perf_counter()
        cpu_before = _cpu_seconds()
        stats: dict = {}
        summary = run_tracked(graph, store, tracker, executor, address=address,
                              progress=progress == "bars", label=name if progress == "lines" else "",
                              num_cpus=(threads or 1) if executor == "ray" and address is None else None,
                              on_executor=lambda engine: stats.update(getattr(engine, "last_stats", {})))
        ray_address = stats.get("ray_address")  # the instance this scenario's stages ran on (Ray only)
    return {"name": name, "run_dir": run_dir, "matrix": summary.matrix, "metrics": summary.metrics,
            "wall_s": time.perf_counter() - started, "cpu_s": _cpu_seconds() - cpu_before,
            "executed": len(summary.executed), "skipped": len(summary.skipped), "ray_address": ray_address,
            "adopted": len(summary.adopted), "published": len(summary.published),
            "precision": precision_name(config.training.autocast)}


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> [0, 1, 2]: distinct integers >= 0 in the order given (ValueError naming the bad item)."""
    seeds: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit():
            raise ValueError(f"--seeds: expected comma-separated integers >= 0 such as 0,1,2, got {item!r} in {text!r}")
        if int(item) in seeds:
            raise ValueError(f"--seeds: seed {item} is listed twice in {text!r}")
        seeds.append(int(item))
    return seeds


def seed_passes(seeds: list[int], overrides: list[str], output: str) -> list[tuple[int, str, list[str], str]]:
    """(seed, pool, overrides, output folder) of every pass, in the order they run: per seed the test pass into
    ``<output>/seed-<s>``, then the validation pass into ``<output>/seed-<s>/validation``, which shares the test
    pass's third-party models (its ``output.shared_store``)."""
    passes = []
    for seed in seeds:
        folder = f"{output.rstrip('/')}/seed-{seed}"
        for pool, pool_overrides, sub_folder in POOLS:
            shared = [f"output.shared_store={folder}/{SHARED_FOLDER}"] if sub_folder else []
            passes.append((seed, pool, [*overrides, f"seed={seed}", *pool_overrides, *shared],
                           f"{folder}/{sub_folder}" if sub_folder else folder))
    return passes


def copy_trained_models(config_path: str, overrides: list[str], source_dir: str, run_dir: str) -> int:
    """Copy the committed third-party and task models of ``config_path`` + ``overrides`` from the run folder
    ``source_dir`` into ``run_dir`` (verified, as ``output.shared_store`` adopts a model), so that a run that differs
    only in its evaluation trains nothing; returns the number of stages copied. Stage keys name their content, so
    only models the scenario would train itself are copied."""
    graph = compile_scenario(load_config(config_path, overrides))
    source, target = RunStore(source_dir), RunStore(run_dir)
    copied = 0
    for key in [*graph.pretrain_stages.values(), *graph.model_stages]:
        if source.has(key) and not target.has(key):
            copy_stage(source, target, key)
            copied += 1
    return copied


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(args) -> int:
    cores = os.cpu_count() or 1
    jobs = args.jobs if args.jobs is not None else (2 if cores >= 2 else 1)
    if jobs < 1:
        print("error: --jobs must be >= 1", file=sys.stderr)
        return 2
    try:
        seeds = parse_seeds(args.seeds) if getattr(args, "seeds", None) else None
        # every pass: (seed, pool, its scenarios); one pass on the configs' own seed and pools without --seeds
        passes = ([(None, "test", _demo_tasks(args.overrides, args.output))] if seeds is None else
                  [(seed, pool, _demo_tasks(overrides, output))
                   for seed, pool, overrides, output in seed_passes(seeds, args.overrides, args.output)])
    except (ConfigError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    tracking_uri, experiment = _tracking_target(args)
    started = time.perf_counter()
    address = None
    if args.executor == "ray":
        # one Ray instance for both scenarios: their stages share the machine's cores through Ray's scheduler
        import ray

        connect(None, num_cpus=cores)
        address = ray.get_runtime_context().gcs_address
    records = []
    try:
        for seed, pool, tasks in passes:
            if pool == "validation":  # the test pass of this seed trained every model: copy them, train nothing
                for name, path, overrides, run_dir in tasks:
                    copy_trained_models(path, overrides, str(Path(run_dir).parent.parent / name), run_dir)
            results = _run_scenarios(tasks, jobs, cores, args, tracking_uri, experiment, address)
            if seed is not None:
                print(f"\n#### seed {seed}, {pool} pool ({pool_splits(tasks)}) ####")
            _print_results(results, str(Path(tasks[0][3]).parent), criteria=pool == "test")
            records += [{"seed": seed, "pool": pool, "method": result["name"], "metrics": _scalars(result["metrics"]),
                         "wall_s": result["wall_s"], "run_dir": result["run_dir"]} for result in results]
    finally:
        if address is not None:
            import ray

            ray.shutdown()
    wall = time.perf_counter() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = _cpu_seconds() + children.ru_utime + children.ru_stime
    if seeds is not None:
        _print_seed_table(records, args)
    where = f"Ray tasks on one embedded local Ray instance ({address})" if address else "in-process"
    cpu_text = f"{cpu:.0f} s CPU (user+sys, {'driver processes only' if args.executor == 'ray' else 'all processes'})"
    print(f"demo: {wall:.0f} s wall, {cpu_text}, {jobs} job(s) on {cores} core(s), stages {where}; "
          + (f"MLflow: {redact_uri(tracking_uri)} (experiment {experiment}; browse it with "
             f"`compat ui --experiment {experiment}`)"
             if tracking_uri is not None else "MLflow: off"))
    print(_calibration_used(_training_threads(tasks[0][1], args.overrides)))
    return 0


def _demo_tasks(overrides: list[str], output: str) -> list[tuple[str, str, list[str], str]]:
    """(name, config path, overrides, run folder) of each demo scenario; bad overrides are refused (ConfigError)
    before any worker starts. Both share ``<output>/third-party`` unless ``output.shared_store`` is set."""
    tasks = []
    output = absolute_location(output)  # once: every run folder, the shared store and the records are absolute
    for name, file_name in DEMOS:
        path = str(configs_dir() / file_name)
        load_config(path, overrides)  # refuse bad overrides before any worker starts
        scenario_overrides = list(overrides)
        if not any(item.startswith("output.shared_store=") for item in scenario_overrides):
            # one store of third-party models for both scenarios, next to their run folders
            scenario_overrides.append(f"output.shared_store={output.rstrip('/')}/{SHARED_FOLDER}")
        tasks.append((name, path, scenario_overrides, f"{output.rstrip('/')}/{name}"))
    return tasks


def _tracking_target(args) -> tuple[str | None, str | None]:
    """(tracking URI, experiment) of both scenarios. Unless tracking is off, both go to one store and one
    experiment, so the MLflow UI compares them side by side; the experiment is created here once, before the
    workers start, so they never race on the database migration."""
    tracking_uri, experiment = args.tracking.uri, None
    if tracking_uri is not None:
        os.makedirs(args.output, exist_ok=True)
        experiment = args.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "compat-demo"
        create_tracker(tracking_uri, experiment=experiment)._experiment(experiment)
    return tracking_uri, experiment


def _run_scenarios(tasks: list, jobs: int, cores: int, args, tracking_uri: str, experiment: str | None,
                   address: str | None) -> list[dict]:
    """Run the scenarios one after the other with every core (``jobs`` 1), or in ``jobs`` spawned worker
    processes sharing the cores; returns :func:`run_one`'s results in the order of ``tasks``."""
    if jobs == 1:
        progress = "none" if args.no_progress else "bars"
        threads = cores if args.executor == "ray" else None
        return [run_one(*task, threads=threads, progress=progress, executor=args.executor,
                        tracking_uri=tracking_uri, experiment=experiment, address=address,
                        command=tuple(getattr(args, "argv", ()))) for task in tasks]
    import multiprocessing

    threads = max(1, cores // min(jobs, len(tasks)))
    progress = "none" if args.no_progress else "lines"
    # spawn: a fresh interpreter per worker (fork would copy this process's torch thread pools)
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_one, *task, threads, progress, args.executor, tracking_uri, experiment,
                               address, tuple(getattr(args, "argv", ()))) for task in tasks]
        return [future.result() for future in futures]


def pool_splits(tasks: list) -> str:
    """'queries SPLIT, gallery SPLIT' of a pass's first scenario (both scenarios of a pass share them)."""
    evaluation = load_config(tasks[0][1], tasks[0][2]).evaluation
    return f"queries {evaluation.query_set.split}, gallery {evaluation.gallery_set.split}"


def _scalars(metrics: dict | None) -> dict:
    """The metrics the seed table reports (fractions; None where a run has none)."""
    return {name: (metrics or {}).get(name) for name in seed_spread.METRICS}


def _print_seed_table(records: list[dict], args) -> None:
    """The mean and spread over the seeds of both pools, written next to the seed folders, and the README's
    criteria on the test pool's means."""
    markdown, document = seed_spread.write_table(records, args.output, list(getattr(args, "argv", ())))
    print("\n" + markdown.read_text(encoding="utf-8"))
    print(f"written to {markdown} and {document}")
    means = {row["method"]: {name: row[name].get("mean") for name in seed_spread.METRICS}
             for row in seed_spread.summarise(records) if row["pool"] == "test"}
    er, hoc = means.get("er"), means.get("dsimplex-hoc")
    if er and hoc and er.get("AA") and hoc.get("AA") is not None:
        print("demo criteria (README) on the test pool's means over the seeds: " + "; ".join(
            f"{name}: {'met' if met else 'NOT met'} ({value})" for name, met, value in demo_criteria(hoc, er)))


def _print_results(results: list[dict], output: str, criteria: bool = True) -> None:
    """Each scenario's run, matrix and metrics, the two methods compared (with the README's criteria when
    ``criteria``: they judge the test pool), and their matrices side by side."""
    for result in results:
        on_ray = f"; Ray instance {result['ray_address']}" if result.get("ray_address") else ""
        shared = (f", {result['published']} third-party model(s) trained and shared, {result['adopted']} taken "
                  f"from the shared store" if result.get("adopted") or result.get("published") else "")
        print(f"\n== {result['name']}: {result['run_dir']} ({result['wall_s']:.0f} s wall, {result['cpu_s']:.0f} s CPU "
              f"of its driver; {result['executed']} stages run, {result['skipped']} already done{shared}; "
              f"precision {result['precision']}{on_ray}) ==")
        if result["matrix"] is not None:
            print_results(result["matrix"], result["metrics"])
    by_name = {result["name"]: result["metrics"] for result in results}
    er, hoc = by_name.get("er"), by_name.get("dsimplex-hoc")
    if er and hoc and er.get("AA") and hoc.get("AA") is not None:
        print(f"\nd-Simplex-HOC vs ER: AC {hoc['AC']:.3f} vs {er['AC']:.3f}; AA {hoc['AA']:.3f} vs {er['AA']:.3f} "
              f"({hoc['AA'] / er['AA']:.2f}x)")
        if criteria:
            print("demo criteria (README): " + "; ".join(
                f"{name}: {'met' if met else 'NOT met'} ({value})" for name, met, value in demo_criteria(hoc, er)))
    pictures = [Path(result["run_dir"]) / "matrix.png" for result in results]
    if all(picture.is_file() for picture in pictures):
        combined = side_by_side(pictures, Path(output) / "matrices.png")
        print(f"\nmatrices side by side ({', '.join(result['name'] for result in results)}): {combined}")


def demo_criteria(hoc: dict, er: dict) -> list[tuple[str, bool, str]]:
    """The README's criteria for the demo's test-pool metrics (fractions): (criterion, met, measured value)."""
    ratio = hoc["AA"] / er["AA"] if er["AA"] else float("inf")
    return [("d-Simplex-HOC AC >= 0.5", hoc["AC"] >= 0.5, f"{hoc['AC']:.3f}"),
            ("ER AC <= 0.25", er["AC"] <= 0.25, f"{er['AC']:.3f}"),
            ("HOC AA >= 1.5x ER's", ratio >= 1.5, f"{ratio:.2f}x")]


def _training_threads(config_path: str, overrides: list[str]) -> int:
    """torch threads of the scenario's first model stage (``pipelines.graph.compile.stage_threads``: its CPU count)."""
    graph = compile_scenario(load_config(config_path, overrides))
    return stage_threads(graph[graph.model_stages[0]].resources)


def _calibration_used(threads: int) -> str:
    """The calibration the stages chose their precisions from (``autocast: auto``, retrieval ``precision="auto"``):
    the cached document of this machine's device at the stages' torch thread count."""
    import torch

    if not calibration.calibration_enabled():
        return f"calibration: off ({calibration.MODE_ENV}=off), so every auto precision was fp32"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the cache is keyed by the thread count the stages ran with
    try:
        return "stages' " + calibration.format_calibration(calibration.load(device), calibration.cache_path(device))
    finally:
        torch.set_num_threads(before)
