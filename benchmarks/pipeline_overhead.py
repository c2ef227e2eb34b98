"""Pipeline overhead: the demo scenario through the stage pipeline vs a bare PyTorch loop doing the same work.

    python benchmarks/pipeline_overhead.py [--quick] [--method dsimplex-hoc|er] [--repeats N] [--set KEY=VALUE ...]

Both sides read the same validated scenario config and do the same training and evaluation work: pre-train the
third-party models, fine-tune every task (replacements included) with the method's loss on half-memory/half-task
batches, update the replay memory, extract query and gallery features of every model and compute the T(T+1)/2
Recall@1 entries. The pipeline adds what the product needs on top: stage keys, atomic artifact commits with
sha256 manifests, model save/load between stages, fp16 feature shards, matrix/metrics JSON and the reports
(report.md, matrix.png). Runs alternate (pipeline, bare, pipeline, bare, ...) so that load changes from other
processes hit both sides alike; the ratio uses the per-side minimum (and the median is printed too).
``--quick`` shrinks the work (1 epoch per task, 1 pre-training epoch on 8 images per class) to check the harness.
Results (seconds, ratio) are printed and written as JSON to ``--json`` when given.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUICK_OVERRIDES = [
    "training.epochs=1",
    *[f"pretrain.{i}.epochs=1" for i in range(3)],
    *[f"pretrain.{i}.pool.per_class=8" for i in range(3)],
]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def fresh_pools() -> None:
    """Forget pools opened by earlier runs so that every timed run reads its data from disk alike."""
    from pipelines.stages import pools

    pools._POOL_CACHE.clear()


# ---- the pipeline side --------------------------------------------------------------------------------------------
def run_pipeline(config) -> dict:
    from pipelines.engine.runner import LocalExecutor
    from pipelines.graph.compile import compile_scenario
    from pipelines.reports.run_report import write_store_reports
    from pipelines.store.run_store import RunStore

    fresh_pools()
    with tempfile.TemporaryDirectory(prefix="overhead-pipeline-") as folder:
        summary = LocalExecutor(progress=False).run(compile_scenario(config), RunStore(folder))
        write_store_reports(RunStore(folder))  # as `compat run` does
    return {"matrix": np.array([[np.nan if v is None else v for v in row] for row in summary.matrix["values"]])}


# ---- the bare side -------------------------------------------------------------------------------------------------
def _autocast(config):
    from pipelines.training.autocast import precision_context

    return precision_context("cpu", config.training.autocast)


def _train(model, old_model, source, indices, slots, memory_indices, memory_slots, epochs, batch_size, optimizer_spec,
           seed, config, method):
    """SGD with a per-step cosine schedule, half memory / half task batches when a memory exists."""
    from compat_core.data.replay import half_and_half_batches
    from compat_core.data.transforms import make_transforms
    from compat_core.losses import hoc_loss, simplex_cross_entropy
    from compat_core.models.precision import prepare_batch
    from pipelines.training.autocast import prepare_model

    torch.manual_seed(seed)
    if model.classifier_kind == "learnable":
        needed = int(max(slots.max(), memory_slots.max() if memory_slots is not None and memory_slots.size else 0)) + 1
        if needed > model.num_active_classes:
            model.expand_classes(needed)
    prepare_model(model, "cpu", config.training.autocast)
    if old_model is not None:
        prepare_model(old_model, "cpu", config.training.autocast)
    all_indices = indices if memory_indices is None else np.concatenate([indices, memory_indices])
    all_slots = slots if memory_slots is None else np.concatenate([slots, memory_slots])
    transform = make_transforms(source, train=True, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=optimizer_spec.lr, momentum=optimizer_spec.momentum,
                                weight_decay=optimizer_spec.weight_decay)

    def batches(epoch):
        rng_seed = seed * 1000 + epoch
        if memory_indices is not None and memory_indices.size:
            return list(half_and_half_batches(np.arange(indices.size), np.arange(indices.size, all_indices.size),
                                              batch_size, rng_seed))
        order = np.random.default_rng(rng_seed).permutation(indices.size)
        return [part for part in np.array_split(order, range(batch_size, order.size, batch_size)) if part.size >= 2]

    total = epochs * len(batches(0))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + np.cos(np.pi * step / total)))
    model.train()
    for epoch in range(epochs):
        for positions in batches(epoch):
            images = transform(torch.from_numpy(source.read(all_indices[positions])))
            images = prepare_batch(images, model)
            targets = torch.from_numpy(all_slots[positions])
            with _autocast(config):
                output = model(images)
                if method == "dsimplex-hoc" and old_model is not None:
                    with torch.no_grad():
                        old_features = old_model(images).features
                    loss = hoc_loss(output.logits, targets, output.features, old_features,
                                    lam=config.method.params.lam, rho=config.method.params.rho)
                elif model.classifier_kind == "simplex":
                    loss = simplex_cross_entropy(output.logits, targets)
                else:
                    loss = torch.nn.functional.cross_entropy(output.logits.float(), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
    model.eval()
    return model


@torch.no_grad()
def _features(model, source, config):
    from compat_core.data.transforms import make_transforms
    from compat_core.models.precision import prepare_batch

    transform = make_transforms(source, train=False)
    size = config.evaluation.batch_size
    parts = []
    for start in range(0, len(source), size):
        images = prepare_batch(transform(torch.from_numpy(source.read(np.arange(start, min(start + size, len(source)))))),
                               model)
        with _autocast(config):
            parts.append(model(images).features.float().numpy().astype(np.float16))
    return np.concatenate(parts)


def run_bare(config) -> dict:
    """The same scenario as plain loops over compat_core pieces: no stages, store, manifests or reports."""
    from compat_core.data.replay import ReplayMemory, update_memory
    from compat_core.data.tasks import build_task_sequence
    from compat_core.models.compat_model import create_model, frozen_copy
    from compat_core.retrieval.search import recall_at_1
    from pipelines.stages.pools import load_pool

    method = config.method.name
    if method not in ("dsimplex-hoc", "er"):
        raise SystemExit(f"--method: the bare loop implements dsimplex-hoc and er, got {method!r}")
    fresh_pools()
    classifier = "simplex" if method == "dsimplex-hoc" else "learnable"
    K = config.model.num_slots

    def new_model(seed, active=0):
        torch.manual_seed(seed)
        return create_model(config.model.backbone, K, classifier=classifier,
                            backbone_config=config.model.backbone_config, num_active_classes=active)

    third_party = {}
    for spec in config.pretrain:
        pool = load_pool(spec.pool)
        labels = np.asarray(pool.labels)
        model = new_model(config.seed, spec.num_classes if classifier == "learnable" else 0)
        third_party[spec.name] = (_train(model, None, pool, np.arange(len(pool)), labels, None, None,
                                         spec.epochs or config.training.epochs,
                                         spec.batch_size or config.training.batch_size,
                                         spec.optimizer or config.training.optimizer, config.seed, config, "pretrain"),
                                  spec.num_classes)

    pool = load_pool(config.data)
    pool_labels = np.asarray(pool.labels)
    tasks = build_task_sequence(np.unique(pool_labels), config.tasks.spec, config.task_seed).tasks
    position_of = {int(c): i for i, c in enumerate(np.concatenate(tasks))}
    memory = ReplayMemory.empty()
    models = []
    model, pretrained = None, 0
    for task, classes in enumerate(tasks):
        replacement = config.replacement_at(task)
        source = config.initial_model if task == 0 else (replacement.source if replacement else None)
        if source is not None:
            loaded, pretrained = third_party[source.split(":", 1)[1]]
            model = frozen_copy(loaded)
            model.requires_grad_(True)
            old = frozen_copy(loaded) if task > 0 else None
        else:
            old = frozen_copy(model)
        indices = np.flatnonzero(np.isin(pool_labels, classes))
        positions = np.asarray([position_of[int(c)] for c in pool_labels[indices]])

        def slots_of(pos):
            return K - 1 - pos if classifier == "simplex" else pretrained + pos

        memory_indices = memory.indices if memory.indices.size else None
        memory_slots = slots_of(memory.labels) if memory.indices.size else None
        model = _train(model, old if method == "dsimplex-hoc" else None, pool, indices, slots_of(positions),
                       memory_indices, memory_slots, config.training.epochs, config.training.batch_size,
                       config.training.optimizer, config.seed * 1000 + task, config, method)
        memory = update_memory(memory, indices, positions, positions, task, config.replay.per_class,
                               seed=config.seed * 1000 + task)
        models.append(frozen_copy(model))

    query_pool, gallery_pool = load_pool(config.evaluation.query_set), load_pool(config.evaluation.gallery_set)
    coarse = config.evaluation.label_level == "coarse"
    query_labels = query_pool.coarse_labels if coarse else query_pool.labels
    gallery_labels = gallery_pool.coarse_labels if coarse else gallery_pool.labels
    queries = [_features(m, query_pool, config) for m in models]
    galleries = [_features(m, gallery_pool, config) for m in models]
    T = len(models)
    matrix = np.full((T, T), np.nan)
    for row in range(T):
        for column in range(row + 1):
            matrix[row, column] = recall_at_1(torch.from_numpy(queries[row].astype(np.float32)), query_labels,
                                              torch.from_numpy(galleries[column].astype(np.float32)), gallery_labels)
    return {"matrix": matrix}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 epoch per task, tiny pre-training (harness check)")
    parser.add_argument("--method", default="dsimplex-hoc", choices=("dsimplex-hoc", "er"))
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per side (alternating)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    from pipelines.config.load import load_config

    torch.set_num_threads(args.threads)
    overrides = (QUICK_OVERRIDES if args.quick else []) + list(args.overrides)
    config = load_config(ROOT / "configs" / f"demo-{args.method}.yaml", overrides)
    sides = {"pipeline": run_pipeline, "bare": run_bare}
    times: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    matrices = {}
    for repeat in range(args.repeats):
        for name in (("pipeline", "bare") if repeat % 2 == 0 else ("bare", "pipeline")):
            started, cpu_started = time.perf_counter(), cpu_seconds()
            result = sides[name](config)
            times[name].append(time.perf_counter() - started)
            cpu[name].append(cpu_seconds() - cpu_started)
            matrices[name] = result["matrix"]
            print(f"run {repeat + 1} {name:8s}: {times[name][-1]:7.1f} s wall, {cpu[name][-1]:7.1f} s CPU", flush=True)
    ratio_min = min(times["pipeline"]) / min(times["bare"])
    ratio_cpu = min(cpu["pipeline"]) / min(cpu["bare"])
    summary = {
        "method": args.method, "quick": args.quick, "threads": args.threads, "overrides": overrides,
        "wall_s": times, "cpu_s": cpu,
        "ratio_min_wall": ratio_min, "ratio_median_wall": statistics.median(times["pipeline"]) /
        statistics.median(times["bare"]), "ratio_min_cpu": ratio_cpu,
        "AA_pipeline": float(np.nanmean(matrices["pipeline"])), "AA_bare": float(np.nanmean(matrices["bare"])),
    }
    print(f"pipeline {min(times['pipeline']):.1f} s vs bare {min(times['bare']):.1f} s (min wall): ratio "
          f"{ratio_min:.3f} (median {summary['ratio_median_wall']:.3f}; CPU {ratio_cpu:.3f}); target <= 1.15")
    print(f"sanity: AA pipeline {summary['AA_pipeline']:.3f}, bare {summary['AA_bare']:.3f} (same work, not the same "
          f"random draws)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
