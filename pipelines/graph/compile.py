"""A scenario compiled into a graph of stages, each keyed by a hash of what determines its output.

Stage kinds (``t`` is the 0-based task index):

- ``pretrain``: a third-party model trained on its own class pool (slots 0.. left to right).
- ``finetune`` (t): task ``t`` trained from the model of task ``t - 1`` (task 0 from ``initial_model``, which is then
  also the frozen "old" model, or from a random initialisation); also updates the replay memory.
- ``replace`` (t): external weights loaded (a ``pretrain:<name>`` stage or a path/URI), then task ``t`` fine-tuned
  from them with the loaded model as the frozen "old" model (as the reference HOC does).
- ``extract`` (t, split): features of model ``t`` on the query or gallery set (once per model and split).
- ``adapt`` (t): at a replacement with ``adapters``, adapters between models t-1 and t fitted on paired gallery
  features, their cross-tests and the partial-backfilling curves (pipelines/stages/adapt.py).
- ``entry`` (t, k): one matrix entry ``C[t, k]`` (query features of model t against the gallery of model k, through
  the FAN adapters of tasks k+1..t when the method has them), computed by :func:`pipelines.stages.entries.entry_stage`.
- ``evaluate`` (t): row ``t`` of the compatibility matrix, ``C[t, 0..t]``, assembled from its entry nodes.

Each stage carries its typed, frozen inputs (``pipelines.stages.inputs``, built by
``pipelines.graph.build_inputs``): the only thing its function reads besides its parents' records. The key of a
stage is ``<kind>-<label>-<16 hex>`` where the hex digest hashes (kind, inputs as JSON, parent keys, code version): a
change to any input or to the compute code gives new keys, so stale artifacts are never reused, and a task's inputs
hold only what it consumes, so appending a task keeps every existing key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from pipelines.config.load import stable_hash
from pipelines.config.run_origin import RunOrigin
from pipelines.config.schema import EvaluationSpec, ScenarioConfig, StageResources
from pipelines.graph.build_inputs import (
    adapt_inputs,
    extract_inputs,
    pretrain_inputs,
    stage_threads,
    train_inputs,
)
from pipelines.graph.code_version import code_version
from pipelines.graph.stage_kind import StageKind
from pipelines.stages.feature_way import plan_lines
from pipelines.stages.inputs import (
    EntryInputs,
    EntryRules,
    EvaluateInputs,
    FrozenInputs,
    RunSettings,
    StageInputs,
)

SPLITS = ("query", "gallery")


@dataclass(frozen=True)
class Stage:
    """One node of the scenario graph.

    key: unique, content-derived id (also the artifact folder / manifest name). kind: its StageKind. label: short
    human name, e.g. ``finetune[t=3]``. inputs: the frozen, typed values its function reads (hashed into the key).
    parents: keys of the stages whose records this stage reads. resources: what a scheduler should reserve.
    task: 0-based task index (None for pretrain); split: query or gallery (extract); name: pretrain name.
    """

    key: str
    kind: StageKind
    label: str
    inputs: StageInputs
    parents: tuple[str, ...]
    resources: StageResources
    task: int | None = None
    split: str | None = None
    name: str | None = None  # pretrain name
    first: bool = False  # submitted before the other ready stages (see compile_scenario: the longest pre-training)


def stage_key(kind: StageKind, label: str, inputs: FrozenInputs, parents: tuple[str, ...], version: str) -> str:
    """Content key of a stage: ``<kind>-<label>-<first 16 hex of sha256(kind, inputs, parents, version)>``."""
    digest = stable_hash({"kind": str(kind), "inputs": inputs.model_dump(mode="json"), "parents": list(parents),
                          "code": version})
    return f"{kind}-{label}-{digest[:16]}"


def make_stage(kind: StageKind, key_label: str, label: str, inputs: StageInputs, parents: tuple[str, ...],
               resources: StageResources, version: str, **where) -> Stage:
    """A stage keyed by its inputs: ``key_label`` goes into the key (e.g. ``t003``), ``label`` is the human label
    (e.g. ``finetune[t=3]``); ``where``: task, split, name, first."""
    return Stage(stage_key(kind, key_label, inputs, parents, version), kind, label, inputs, parents, resources,
                 **where)


@dataclass
class StageGraph:
    """Stages in a topological order (every parent before its children) plus look-ups by role.

    settings: how the stages run (device, checkpoint cadence, input workers), never part of a key. origin: the
    command line and overrides the run was started with (recorded in config.yaml, never part of a key)."""

    config: ScenarioConfig
    stages: list[Stage] = field(default_factory=list)
    code_version: str = ""
    settings: RunSettings | None = None
    origin: RunOrigin | None = None
    model_stages: list[str] = field(default_factory=list)        # key of the model stage of task t
    pretrain_stages: dict[str, str] = field(default_factory=dict)  # pretrain name -> key
    extract_stages: dict[tuple[int, str], str] = field(default_factory=dict)  # (t, split) -> key
    evaluate_stages: list[str] = field(default_factory=list)     # key of row t
    adapt_stages: dict[int, str] = field(default_factory=dict)   # replacement task t -> key of its adapt stage

    def __post_init__(self) -> None:
        self._by_key = {stage.key: stage for stage in self.stages}
        if self.settings is None:
            self.settings = RunSettings.of(self.config)

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

    def count_by_kind(self) -> dict[StageKind, int]:
        # optional kinds (adapt) appear only when the scenario has such stages
        counts = {kind: 0 for kind in StageKind if kind != StageKind.ADAPT or self.adapt_stages}
        for stage in self.stages:
            counts[stage.kind] += 1
        return counts

    def children(self, key: str) -> list[Stage]:
        return [stage for stage in self.stages if key in stage.parents]


def compile_scenario(config: ScenarioConfig, version: str | None = None) -> StageGraph:
    """Compile a validated scenario into its stage graph (no data is read): pre-training, the model line, feature
    extraction, the matrix and the adapters at replacements."""
    graph = StageGraph(config=config, code_version=code_version() if version is None else version)
    add_pretraining(graph)
    add_model_line(graph)
    add_extraction(graph)
    graph.evaluate_stages = add_evaluation(graph, config.evaluation)
    add_adapters(graph)
    return graph


def add_pretraining(graph: StageGraph) -> None:
    """One pretrain stage per third-party model.

    The pre-training of the most images-epochs (classes x epochs: pools hold about as many images per class) is
    submitted first: it is the stage the last replacement waits for, and started after the others it ends the run
    late (measured on the demo: 278 s from the start vs a start at 221 s when queued behind p1 and p2); the others
    follow in the order they are needed."""
    config = graph.config
    costs = [spec.num_classes * (spec.epochs or config.training.epochs) for spec in config.pretrain]
    longest = costs.index(max(costs)) if len(costs) > 1 else None
    for index, spec in enumerate(config.pretrain):
        stage = graph.add(make_stage(StageKind.PRETRAIN, spec.name, f"pretrain[{spec.name}]",
                                     pretrain_inputs(config, index), (), config.resources.pretrain,
                                     graph.code_version, name=spec.name, first=index == longest))
        graph.pretrain_stages[spec.name] = stage.key


def add_model_line(graph: StageGraph) -> None:
    """The model of every task: finetune from the previous task's model, or replace at a replacement's first task;
    a ``pretrain:<name>`` start makes that pretrain stage a parent."""
    config = graph.config
    previous: str | None = None
    for task in range(config.num_tasks):
        inputs = train_inputs(config, task)
        kind = StageKind.REPLACE if inputs.replaces else StageKind.FINETUNE
        parents = (previous,) if previous else ()
        if inputs.start is not None and inputs.start.pretrain is not None:
            parents += (graph.pretrain_stages[inputs.start.pretrain],)
        stage = graph.add(make_stage(kind, f"t{task:03d}", f"{kind}[t={task}]", inputs, parents,
                                     config.resources.for_stage(kind), graph.code_version, task=task))
        graph.model_stages.append(stage.key)
        previous = stage.key


def add_extraction(graph: StageGraph) -> None:
    """Query and gallery features of every model, once per model and split."""
    config = graph.config
    for task, model_key in enumerate(graph.model_stages):
        for split in SPLITS:
            stage = graph.add(make_stage(StageKind.EXTRACT, f"t{task:03d}-{split}", f"extract[t={task},{split}]",
                                         extract_inputs(config, task, split), (model_key,), config.resources.extract,
                                         graph.code_version, task=task, split=split))
            graph.extract_stages[(task, split)] = stage.key


def add_adapters(graph: StageGraph) -> None:
    """Adapters at a replacement: fitted on paired gallery features of the old (t-1) and new (t) models."""
    config = graph.config
    for index, replacement in enumerate(config.replacements):
        if not replacement.adapters:
            continue
        task = replacement.at_task - 1
        parents = tuple(graph.extract_stages[(t, split)] for t in (task - 1, task) for split in SPLITS)
        stage = graph.add(make_stage(StageKind.ADAPT, f"t{task:03d}", f"adapt[t={task}]", adapt_inputs(config, index),
                                     parents, config.resources.evaluate, graph.code_version, task=task))
        graph.adapt_stages[task] = stage.key


def add_evaluation(graph: StageGraph, evaluation: EvaluationSpec) -> list[str]:
    """Add the matrix of ``evaluation`` (a protocol) to ``graph``: one ``entry`` node per C[t, k] and one
    ``evaluate`` node per row t assembling its entries; returns the row keys (nodes already present are reused,
    so the graph's own protocol adds nothing). ``compat eval`` calls this with another protocol."""
    rules = EntryRules.of(graph.config, evaluation)
    resources = graph.config.resources.evaluate
    rows = []
    for task in range(len(graph.model_stages)):
        query = graph.extract_stages[(task, "query")]
        # the gallery extracts of the whole row are parents: FAN adapters of tasks column+1..row come from them
        parents = (query,) + tuple(graph.extract_stages[(k, "gallery")] for k in range(task + 1))
        entries = []
        for column in range(task + 1):
            inputs = EntryInputs(row=task, column=column, rules=rules, threads=stage_threads(resources))
            stage = make_stage(StageKind.ENTRY, f"r{task:03d}-c{column:03d}", f"entry[{task},{column}]", inputs,
                               parents, resources, graph.code_version, task=task)
            if stage.key not in graph:
                graph.add(stage)
            entries.append(stage.key)
        stage = make_stage(StageKind.EVALUATE, f"t{task:03d}", f"evaluate[row={task}]",
                           EvaluateInputs(row=task, protocol=rules.protocol), tuple(entries), resources,
                           graph.code_version, task=task)
        if stage.key not in graph:
            graph.add(stage)
        rows.append(stage.key)
    return rows


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


# model.simplex_norm values other than the default, as the plan's first line names them
SIMPLEX_NORM_NOTES = {"row_eps": " (model.simplex_norm row_eps: d-Simplex rows divided by norm + 1e-8, as the public "
                                 "IAM-CL2R code)"}


def describe(graph: StageGraph) -> str:
    """Human-readable plan: stages with parents and resources, then the estimates."""
    config = graph.config
    sources = "".join(f" + {source.name}" for source in config.tasks.sources)
    lines = [f"scenario {config.name}: {config.num_tasks} tasks ({config.tasks.spec}{sources}), "
             f"method {config.method.name}, "
             f"K={config.model.num_slots}{SIMPLEX_NORM_NOTES.get(config.model.simplex_norm, '')}, "
             f"code {graph.code_version}"]
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
