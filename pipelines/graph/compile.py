"""A scenario compiled into a graph of stages, each keyed by a hash of what determines its output.

Stage kinds (``t`` is the 0-based task index):

- ``pretrain``: a third-party model trained on its own class pool (slots 0.. left to right).
- ``finetune`` (t): task ``t`` trained from the model of task ``t - 1`` (task 0 from ``initial_model``, which is then
  also the frozen "old" model, or from a random initialisation); also updates the replay memory.
- ``replace`` (t): external weights loaded (a ``pretrain:<name>`` stage or a path/URI), then task ``t`` fine-tuned
  from them with the loaded model as the frozen "old" model (as the reference HOC does).
- ``extract`` (t, split): features of model ``t`` on the query or gallery set (once per model and split).
- ``adapt`` (t): at a replacement with ``adapters``, adapters between models t-1 and t fitted on paired gallery
  features, their cross-tests and the partial-backfilling curves (pipelines/stages/upgrades.py).
- ``entry`` (t, k): one matrix entry ``C[t, k]`` (query features of model t against the gallery of model k, through
  the FAN adapters of tasks k+1..t when the method has them), computed by :func:`pipelines.stages.entries.entry_stage`.
- ``evaluate`` (t): row ``t`` of the compatibility matrix, ``C[t, 0..t]``, assembled from its entry nodes.

The key of a stage is ``<kind>-<label>-<16 hex>`` where the hex digest hashes (kind, config slice, parent keys,
code version): a change to any input or to the source code gives new keys, so stale artifacts are never reused.
A pretrain stage's slice holds only the training settings it uses (its own entry, the model, the seed, the
classifier family, and the ``training`` values it falls back to: epochs, batch_size, optimizer, schedule, autocast),
so changing how the fine-tuning tasks are trained keeps the third-party models.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from pipelines.config.load import HOW_NOT_WHAT, config_to_dict, stable_hash
from pipelines.config.schema import PRETRAIN_PREFIX, ScenarioConfig, StageResources, resolved_head
from pipelines.graph.code_version import code_version
from pipelines.graph.source_digests import hashed_source, is_file_source
from pipelines.graph.stage_kind import StageKind
from pipelines.methods import METHODS
from pipelines.stages.feature_way import feature_way, plan_lines
from pipelines.training.settings import PRETRAIN_OVERRIDES

STAGE_KINDS = tuple(kind.value for kind in StageKind)
SPLITS = ("query", "gallery")
@dataclass(frozen=True)
class Stage:
    """One node of the scenario graph.

    key: unique, content-derived id (also the artifact folder / manifest name). kind: one of STAGE_KINDS.
    label: short human name, e.g. ``finetune[t=3]``. task: 0-based task index (None for pretrain). split: query or
    gallery for extract stages. params: the JSON config slice hashed into the key. parents: keys of the stages
    whose records this stage reads. resources: what a scheduler should reserve.
    """

    key: str
    kind: str
    label: str
    params: dict[str, Any]
    parents: tuple[str, ...]
    resources: StageResources
    task: int | None = None
    split: str | None = None
    name: str | None = None  # pretrain name
    first: bool = False  # submitted before the other ready stages (see compile_scenario: the longest pre-training)


def stage_threads(resources: StageResources) -> int:
    """torch intra-op threads a stage computes with, on every backend: its ``num_cpus`` (at least 1).

    Float reductions (GEMM, convolutions) are split by thread count, so results depend on it: it is fixed per stage
    and part of the stage key, so the same key gives the same bytes in-process, on Ray and after a resume.
    """
    return max(1, int(resources.num_cpus))


def parallel_params(resources: StageResources) -> dict[str, int]:
    """Key parameters of data-parallel training: ``{"workers": N}`` for N > 1 workers, else nothing (keys of
    one-worker stages stay as they were). N changes float reduction order, so it is part of the key."""
    return {"workers": int(resources.num_workers)} if resources.num_workers > 1 else {}


def stage_key(kind: str, label: str, params: dict, parents: tuple[str, ...], version: str) -> str:
    """Content key of a stage: ``<kind>-<label>-<first 16 hex of sha256(kind, params, parents, version)>``."""
    digest = stable_hash({"kind": kind, "params": params, "parents": list(parents), "code": version})
    return f"{kind}-{label}-{digest[:16]}"


@dataclass
class StageGraph:
    """Stages in a topological order (every parent before its children) plus look-ups by role."""

    config: ScenarioConfig
    stages: list[Stage] = field(default_factory=list)
    code_version: str = ""
    model_stages: list[str] = field(default_factory=list)        # key of the model stage of task t
    pretrain_stages: dict[str, str] = field(default_factory=dict)  # pretrain name -> key
    extract_stages: dict[tuple[int, str], str] = field(default_factory=dict)  # (t, split) -> key
    evaluate_stages: list[str] = field(default_factory=list)     # key of row t
    adapt_stages: dict[int, str] = field(default_factory=dict)   # replacement task t -> key of its adapt stage

    def __post_init__(self) -> None:
        self._by_key = {stage.key: stage for stage in self.stages}

    def add(self, stage: Stage) -> Stage:
        for parent in stage.parents:
            if parent not in self._by_key:
                raise ValueError(f"stage {stage.label}: parent {parent} must be added before its child")
        if stage.key in self._by_key:
            raise ValueError(f"stage {stage.label}: duplicate key {stage.key}")
        self.stages.append(stage)
        self._by_key[stage.key] = stage
        return stage

    def __getitem__(self, key: str) -> Stage:
        try:
            return self._by_key[key]
        except KeyError:
            raise KeyError(f"no stage with key {key!r} in this graph") from None

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def ancestors(self, keys) -> set[str]:
        """``keys`` and every node they depend on."""
        needed, stack = set(), list(keys)
        while stack:
            current = stack.pop()
            if current not in needed:
                needed.add(current)
                stack.extend(self[current].parents)
        return needed

    def __iter__(self) -> Iterator[Stage]:
        return iter(self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    def count_by_kind(self) -> dict[str, int]:
        # optional kinds (adapt) appear only when the scenario has such stages
        counts = {kind: 0 for kind in STAGE_KINDS if kind != StageKind.ADAPT or self.adapt_stages}
        for stage in self.stages:
            counts[stage.kind] += 1
        return counts

    def children(self, key: str) -> list[Stage]:
        return [stage for stage in self.stages if key in stage.parents]


def _method_traits(name: str) -> dict[str, Any]:
    """Class-level traits of the method (classifier family, retraining) that change what stages do."""
    method = METHODS.get(name)
    return {
        "classifier": getattr(method, "classifier", "simplex"),
        "retrain_from_scratch": bool(getattr(method, "retrain_from_scratch", False)),
        "training_free": bool(getattr(method, "training_free", False)),
    }


def pretrain_classifier(config: ScenarioConfig, index: int, method_classifier: str) -> str:
    """Classifier family of ``config.pretrain[index]`` (its ``classifier``, 'method' resolved); ValueError naming the
    key when the method cannot start from such a model."""
    spec = config.pretrain[index]
    classifier = spec.resolved_classifier(method_classifier)
    key = f"pretrain[{index}].classifier"
    if classifier == "learnable" and method_classifier == "simplex":
        raise ValueError(f"{key}: 'learnable' cannot feed method {config.method.name!r}, whose d-Simplex classifier "
                         f"needs a d-Simplex model; use 'simplex' or 'method'")
    return classifier


def compile_scenario(config: ScenarioConfig, version: str | None = None) -> StageGraph:
    """Compile a validated scenario into its stage graph (no data is read)."""
    version = code_version() if version is None else version
    document = config_to_dict(config)
    traits = _method_traits(config.method.name)
    if config.evaluation.features == "bridge":  # refuse an impossible bridge before anything trains
        feature_way(config, resolved_head(config, traits["classifier"]), 2, 1)
    graph = StageGraph(config=config, code_version=version)
    resources = config.resources
    model_section = document["model"]

    # The pre-training of the most images-epochs (classes x epochs: pools hold about as many images per class) is
    # submitted first: it is the stage the last replacement waits for, and started after the others it ends the
    # run late (measured on the demo: 278 s from the start vs a start at 221 s when queued behind p1 and p2); the
    # others follow in the order they are needed.
    costs = [spec.num_classes * (spec.epochs or config.training.epochs) for spec in config.pretrain]
    longest = costs.index(max(costs)) if len(costs) > 1 else None
    for index, spec in enumerate(config.pretrain):
        classifier = pretrain_classifier(config, index, traits["classifier"])
        # the resolved family, never "method": an ER run and a d-Simplex run that both pre-train d-Simplex models
        # get the same keys, so a shared store (output.shared_store) trains each third-party model once
        entry = {**document["pretrain"][index], "classifier": classifier}
        _hash_file_source(entry, "init", "init_sha256", "init_ignore_keys")
        training = document["training"]
        # only the training settings the pretrain stage falls back to (or always uses) enter its key, so tuning
        # the fine-tuning schedule keeps already trained third-party models
        resolved_training = {name: training[name] if entry.get(name) is None else entry[name]
                             for name in PRETRAIN_OVERRIDES}
        resolved_training["autocast"] = training["autocast"]
        params = {
            "pretrain": entry,
            "defaults": {"model": model_section, "training": resolved_training, "seed": config.seed},
            "classifier": classifier,
            "threads": stage_threads(resources.pretrain),
            **parallel_params(resources.pretrain),
        }
        stage = Stage(stage_key("pretrain", spec.name, params, (), version), "pretrain", f"pretrain[{spec.name}]",
                      params, (), resources.pretrain, name=spec.name, first=index == longest)
        graph.add(stage)
        graph.pretrain_stages[spec.name] = stage.key

    # What every task's training depends on, besides its own position and its parents.
    shared = {
        "data": document["data"],
        "tasks": document["tasks"],
        "seed": config.seed,
        "model": model_section,
        "method": document["method"],
        "method_traits": traits,
        # how often a stage checkpoints and how many processes decode its input do not change what it computes
        "training": {k: v for k, v in document["training"].items() if k not in HOW_NOT_WHAT},
        "replay": document["replay"],
        "evaluation_for_selection": document["evaluation"] if config.training.model_selection == "compatibility"
        else None,
    }

    def source_parents(source: str | None) -> tuple[str, ...]:
        if source and source.startswith(PRETRAIN_PREFIX):
            return (graph.pretrain_stages[source[len(PRETRAIN_PREFIX):]],)
        return ()

    previous: str | None = None
    for task in range(config.num_tasks):
        replacement = config.replacement_at(task)
        if replacement is not None:
            if replacement.anchor == "replaced" and traits["classifier"] != "simplex":
                index = config.replacements.index(replacement)
                raise ValueError(f"replacements[{index}].anchor: 'replaced' needs a d-Simplex method (one fixed "
                                 f"classifier shared by both lines); {config.method.name!r} has a "
                                 f"{traits['classifier']} classifier whose outputs differ between the lines")
            kind = "replace"
            source = {name: value for name, value in
                      document["replacements"][config.replacements.index(replacement)].items()
                      if name not in ("adapters", "adapter_params")}  # adapters never retrain the model
            _hash_file_source(source, "source", "sha256", "ignore_keys")
            parents = (previous,) + source_parents(replacement.source)  # type: ignore[operator]
        else:
            kind = "finetune"
            source = {"initial_model": config.initial_model} if task == 0 else None
            if source is not None:
                source["ignore_keys"] = config.initial_model_ignore_keys
                _hash_file_source(source, "initial_model", None, "ignore_keys")
            parents = ((previous,) if previous else ()) + (source_parents(config.initial_model) if task == 0 else ())
        params = {"task": task, "shared": shared, "source": source, "threads": stage_threads(resources.for_stage(kind)),
                  **parallel_params(resources.for_stage(kind))}
        stage = Stage(stage_key(kind, f"t{task:03d}", params, parents, version), kind, f"{kind}[t={task}]", params,
                      parents, resources.for_stage(kind), task=task)
        graph.add(stage)
        graph.model_stages.append(stage.key)
        previous = stage.key

    evaluation = document["evaluation"]
    extraction_params = {"feature_dtype": evaluation["feature_dtype"], "batch_size": evaluation["batch_size"],
                         "features": evaluation["features"]}
    for task, model_key in enumerate(graph.model_stages):
        for split in SPLITS:
            params = {"split": split, "pool": evaluation[f"{split}_set"], **extraction_params,
                      "method": document["method"], "threads": stage_threads(resources.extract)}
            stage = Stage(stage_key("extract", f"t{task:03d}-{split}", params, (model_key,), version), "extract",
                          f"extract[t={task},{split}]", params, (model_key,), resources.extract, task=task,
                          split=split)
            graph.add(stage)
            graph.extract_stages[(task, split)] = stage.key

    graph.evaluate_stages = add_evaluation(graph, document["evaluation"])

    # Adapters at a replacement: fitted on paired gallery features of the old (t-1) and new (t) models.
    for index, replacement in enumerate(config.replacements):
        if not replacement.adapters:
            continue
        task = replacement.at_task - 1
        parents = (graph.extract_stages[(task - 1, "query")], graph.extract_stages[(task - 1, "gallery")],
                   graph.extract_stages[(task, "query")], graph.extract_stages[(task, "gallery")])
        params = {"task": task, "adapters": document["replacements"][index]["adapters"],
                  "adapter_params": document["replacements"][index]["adapter_params"], "seed": config.seed,
                  "protocol": protocol_params(document["evaluation"]), "strict": config.evaluation.strict}
        stage = Stage(stage_key("adapt", f"t{task:03d}", params, parents, version), "adapt", f"adapt[t={task}]",
                      params, parents, resources.evaluate, task=task)
        graph.add(stage)
        graph.adapt_stages[task] = stage.key
    return graph


def _hash_file_source(entry: dict, path_key: str, sha_key: str | None, ignore_key: str) -> None:
    """In a stage's config slice, a weights file is its sha256 (never its path; the pinned digest folded in), and
    an unset ignore list is left out (keys of configs without one stay as they were)."""
    if is_file_source(entry.get(path_key)):
        entry[path_key] = hashed_source(entry[path_key], entry.get(sha_key) if sha_key else None)
        if sha_key:
            entry.pop(sha_key, None)
    if entry.get(ignore_key) is None:
        entry.pop(ignore_key, None)


def add_evaluation(graph: StageGraph, evaluation: dict) -> list[str]:
    """Add the matrix of ``evaluation`` (a protocol) to ``graph``: one ``entry`` node per C[t, k] and one
    ``evaluate`` node per row t assembling its entries; returns the row keys (nodes already present are reused,
    so the graph's own protocol adds nothing). ``compat eval`` calls this with another protocol."""
    protocol = protocol_params(evaluation)
    resources = graph.config.resources.evaluate
    rows = []
    for task in range(len(graph.model_stages)):
        query = graph.extract_stages[(task, "query")]
        galleries = tuple(graph.extract_stages[(k, "gallery")] for k in range(task + 1))
        entries = []
        for column in range(task + 1):
            # the gallery extracts of the whole row are parents: FAN adapters of tasks column+1..row come from them
            key = entry_key(query, galleries[column], protocol, task, column, galleries[column + 1:],
                            stage_threads(resources))
            if key not in graph:
                graph.add(Stage(key, "entry", f"entry[{task},{column}]", {"row": task, "column": column,
                                "protocol": protocol}, (query,) + galleries, resources, task=task))
            entries.append(key)
        params = {"row": task, "protocol": protocol}
        key = stage_key("evaluate", f"t{task:03d}", params, tuple(entries), graph.code_version)
        if key not in graph:
            graph.add(Stage(key, "evaluate", f"evaluate[row={task}]", params, tuple(entries), resources, task=task))
        rows.append(key)
    return rows


def protocol_params(evaluation: dict) -> dict:
    """The evaluation settings that change a matrix entry (ECC strictness does not: it only changes metrics)."""
    return {key: evaluation[key] for key in ("metric", "gallery", "label_level", "far", "verification_pairs")}


def entry_key(query_extract: str, gallery_extract: str, protocol: dict, row: int, column: int,
              adapter_extracts: tuple[str, ...] = (), threads: int = 1) -> str:
    """Key of one matrix entry C[row, column] computed from two stored feature sets under ``protocol``.

    adapter_extracts: gallery extracts of columns column+1..row, whose models may carry FAN adapters applied to the
    gallery features (hashed too, so entries computed before adapters were applied are never reused). threads: the
    torch threads the entry computes with (see :func:`stage_threads`)."""
    digest = stable_hash({"query": query_extract, "gallery": gallery_extract, "protocol": protocol,
                          "adapters": list(adapter_extracts), "threads": threads})
    return f"entry-r{row:03d}-c{column:03d}-{digest[:16]}"


# ---- estimates for `compat plan` --------------------------------------------------------------------------------
@dataclass
class PlanEstimate:
    """Storage and compute estimates. Sizes in bytes; FLOPs count multiply-adds as 2."""

    feature_dim: int
    query_rows: int | None
    gallery_rows: int | None
    feature_bytes: int | None
    matrix_entries: int
    matrix_flops: float | None


def estimate(graph: StageGraph) -> PlanEstimate:
    """Feature storage (T models x (query + gallery) x (K-1) x bytes per value) and matrix cost (T(T+1)/2 entries)."""
    config = graph.config
    T = config.num_tasks
    dim = config.model.num_slots - 1
    bytes_per_value = 2 if config.evaluation.feature_dtype == "float16" else 4
    query_rows = config.evaluation.query_set.num_samples
    gallery_rows = config.evaluation.gallery_set.num_samples
    entries = T * (T + 1) // 2
    feature_bytes = None
    flops = None
    if query_rows is not None and gallery_rows is not None:
        feature_bytes = T * (query_rows + gallery_rows) * dim * bytes_per_value
        gallery_columns = gallery_rows
        gallery_classes = config.evaluation.gallery_set.classes
        if config.evaluation.gallery == "class_means" and gallery_classes:
            gallery_columns = len(gallery_classes)  # one template per class
        flops = float(entries) * 2.0 * query_rows * gallery_columns * dim
    return PlanEstimate(dim, query_rows, gallery_rows, feature_bytes, entries, flops)


def describe(graph: StageGraph) -> str:
    """Human-readable plan: stages with parents and resources, then the estimates."""
    config = graph.config
    lines = [f"scenario {config.name}: {config.num_tasks} tasks ({config.tasks.spec}), method {config.method.name}, "
             f"K={config.model.num_slots}, code {graph.code_version}"]
    counts = graph.count_by_kind()
    lines.append("stages: " + ", ".join(f"{n} {k}" for k, n in counts.items()) + f" ({len(graph)} in all)")
    labels = {stage.key: stage.label for stage in graph}
    for stage in graph:
        if stage.kind == StageKind.ENTRY:
            continue  # T(T+1)/2 of them: summarised on the matrix line
        res = stage.resources
        gpus = "auto" if res.num_gpus is None else f"{res.num_gpus:g}"
        memory = "-" if res.memory is None else _human_bytes(res.memory)
        parents = ", ".join(labels[p] for p in stage.parents) or "-"
        if stage.kind == StageKind.EVALUATE:  # its T entry nodes, one range instead of t+1 labels
            parents = f"entry[{stage.task},0..{stage.task}]"
        lines.append(f"  {stage.label:<26} gpus={gpus:<4} cpus={res.num_cpus:<4g} mem={memory:<9} <- {parents}")
    plan = estimate(graph)
    if plan.feature_bytes is None:
        lines.append(f"feature storage: unknown (set evaluation.query_set.num_samples and gallery_set.num_samples); "
                     f"{plan.feature_dim * (2 if config.evaluation.feature_dtype == 'float16' else 4)} bytes per "
                     f"image per model ({config.evaluation.feature_dtype}, d={plan.feature_dim})")
    else:
        lines.append(f"feature storage: {plan.feature_bytes} bytes ({_human_bytes(plan.feature_bytes)}; "
                     f"{config.num_tasks} models x ({plan.query_rows} query + {plan.gallery_rows} gallery) x "
                     f"d={plan.feature_dim} x {config.evaluation.feature_dtype})")
    flops = "unknown" if plan.matrix_flops is None else f"{plan.matrix_flops:.3e} FLOPs"
    lines.append(f"matrix: {plan.matrix_entries} entries (T(T+1)/2, metric {config.evaluation.metric}, gallery "
                 f"{config.evaluation.gallery}), similarity cost {flops}")
    lines.extend(plan_lines(config, plan.query_rows, plan.gallery_rows, plan.matrix_entries))
    return "\n".join(lines)


def _human_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value} B"
