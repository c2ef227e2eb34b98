"""One check of every input before any compute (``compat run`` / ``submit`` / ``tune``): a run that would stop
hours in because of a missing file or a typo stops now, with every problem named by its config key.

- data: every pool opens (the same readers the stages use) and no test class occurs in a training pool; a task given
  by its own data (``tasks.sources``) holds the classes it declares, at the fine-tuning pool's image size, and none
  of them (by identity) is a class of an earlier task;
- weights: every external weights source (``pretrain[*].init``, ``replacements[*].source``, ``initial_model``) is
  resolved, is a regular file (``/dev/zero`` and FIFOs are refused before a byte is read), matches its pinned sha256
  and loads strictly into the model the stage builds (every key, extras only through the ignore lists);
- device: ``cuda`` on a machine (or cluster) without CUDA;
- memory: each training stage's estimate (parameters, gradients, optimiser state, previous model, activations,
  logits; :mod:`pipelines.config.memory`) against the memory this machine has for it (host RAM on CPU, free
  device memory on CUDA), naming ``model.num_slots`` and the batch size;
- the run folder's bucket exists (``s3://``).
Resource requests against the cluster are checked by the Ray backend for every stage before the first one starts.
"""
from __future__ import annotations

from typing import Any

from compat_core import io as cio
from compat_core.models.weight_sources import resolve_weights_source
from pipelines.config.memory import GIB, available_memory, training_memory
from pipelines.config.schema import PRETRAIN_PREFIX, ScenarioConfig
from pipelines.graph.build_inputs import method_classifier
from pipelines.graph.source_digests import file_digest
from pipelines.stages.inputs import ModelShape
from pipelines.stages.model_io import initial_model, load_weights_strictly
from pipelines.stages.pools import check_pools_open_set, load_pool, task_source_data_problems


class PreflightError(ValueError):
    """Inputs that cannot run; the message lists every problem as ``config key: what is wrong``."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        lines = [message if message.startswith(f"{key}:") else f"{key}: {message}" for key, message in problems]
        super().__init__(f"{len(problems)} problem(s) before any compute:\n  " + "\n  ".join(lines))


def data_problems(config: ScenarioConfig) -> list[tuple[str, str]]:
    """(config key, problem) for every pool that does not open, then the open-set guard across pools."""
    pools = [("data", config.data)] + [(f"pretrain[{i}].pool", p.pool) for i, p in enumerate(config.pretrain)]
    pools += [(f"tasks.sources[{i}].data", s.data) for i, s in enumerate(config.tasks.sources)]
    pools += [("evaluation.query_set", config.evaluation.query_set),
              ("evaluation.gallery_set", config.evaluation.gallery_set)]
    problems, seen = [], set()
    for key, spec in pools:
        identity = spec.model_dump_json()
        if identity in seen:
            continue
        seen.add(identity)
        try:
            load_pool(spec, key)
        except Exception as error:  # noqa: BLE001 - every reader failure is reported, none stops the listing
            problems.append((key, str(error)))
    if not problems:
        try:
            check_pools_open_set(config)
        except ValueError as error:
            problems.append(("evaluation", str(error)))
        problems += task_source_data_problems(config)
    return problems


def weights_sources(config: ScenarioConfig) -> list[dict[str, Any]]:
    """Every external weights file the scenario names: config key, source, pinned sha256, ignore list, and what the
    stage builds to load it into (backbone, backbone config, classifier, pretrained classes, seed)."""
    line_classifier = method_classifier(config)
    found = []
    for spec in config.pretrain:
        if spec.init is not None:
            found.append({"key": f"pretrain[{spec.name}].init", "source": spec.init, "sha256": spec.init_sha256,
                          "ignore": spec.init_ignore_keys, "backbone": spec.backbone,
                          "backbone_config": spec.backbone_config,
                          "classifier": spec.resolved_classifier(line_classifier),
                          "num_active": spec.num_classes,
                          "seed": spec.seed if spec.seed is not None else config.seed})
    for index, replacement in enumerate(config.replacements):
        if not replacement.source.startswith(PRETRAIN_PREFIX):
            found.append({"key": f"replacements[{index}].source", "source": replacement.source,
                          "sha256": replacement.sha256, "ignore": replacement.ignore_keys,
                          "backbone": replacement.backbone, "backbone_config": replacement.backbone_config,
                          "classifier": line_classifier, "num_active": replacement.num_pretrain_classes or 0,
                          "seed": config.seed})
    if config.initial_model and not config.initial_model.startswith(PRETRAIN_PREFIX):
        found.append({"key": "initial_model", "source": config.initial_model, "sha256": None,
                      "ignore": config.initial_model_ignore_keys, "backbone": None, "backbone_config": None,
                      "classifier": line_classifier, "num_active": 0, "seed": config.seed})
    return found


def weights_problems(config: ScenarioConfig) -> list[tuple[str, str]]:
    """(config key, problem) for every weights source that is missing, unreadable, not the pinned bytes, or does
    not load strictly into the model its stage builds (the load is tried here, on CPU, then discarded)."""
    problems = []
    for entry in weights_sources(config):
        key = entry["key"]
        try:
            resolve_weights_source(entry["source"])
        except (OSError, ValueError) as error:
            problems.append((key, f"weights source {entry['source']!r}: {error}"))
            continue
        digest = file_digest(entry["source"])
        expected = (entry["sha256"] or "").lower() or None
        if expected and digest != expected:
            problems.append((key, f"sha256 mismatch for {entry['source']}: expected {expected}, actual {digest}"))
            continue
        try:
            shape = ModelShape.of(config, entry["classifier"], entry["backbone"], entry["backbone_config"])
            model = initial_model(shape, entry["classifier"], entry["seed"],
                                  num_active=entry["num_active"] if entry["classifier"] == "learnable" else 0)
            load_weights_strictly(model, entry["source"], digest, entry["ignore"], key)
        except (OSError, ValueError, KeyError) as error:
            message = str(error)
            problems.append((key, message))
    return problems


def device_problems(config: ScenarioConfig, cluster_has_gpus: bool | None = None) -> list[tuple[str, str]]:
    """``device: cuda[:N]`` where torch (or, on a cluster, Ray) sees no CUDA device."""
    device = str(config.device)
    if not device.startswith("cuda"):
        return []
    if cluster_has_gpus is None:
        import torch

        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
        where = "this machine"
    else:
        available, count, where = cluster_has_gpus, None, "the Ray cluster"
    if not available:
        return [("device", f"{device!r} but {where} has no CUDA device; use auto or cpu")]
    index = device.partition(":")[2]
    if count is not None and index.isdigit() and int(index) >= count:
        return [("device", f"{device!r} but this machine has {count} CUDA device(s) (0..{count - 1})")]
    return []


def _training_lines(config: ScenarioConfig) -> list[dict[str, Any]]:
    """Every kind of training stage: its config key, backbone, classifier, batch size (and its key), data pool."""
    line_classifier = method_classifier(config)
    lines = [{"key": "model", "backbone": None, "backbone_config": None, "classifier": line_classifier,
              "batch": config.training.batch_size, "batch_key": "training.batch_size", "pool": config.data}]
    for spec in config.pretrain:
        lines.append({"key": f"pretrain[{spec.name}]", "backbone": spec.backbone,
                      "backbone_config": spec.backbone_config,
                      "classifier": spec.resolved_classifier(line_classifier),
                      "batch": spec.batch_size or config.training.batch_size,
                      "batch_key": f"pretrain[{spec.name}].batch_size" if spec.batch_size else "training.batch_size",
                      "pool": spec.pool})
    for index, source in enumerate(config.tasks.sources):
        lines.append({"key": f"tasks.sources[{index}]", "backbone": None, "backbone_config": None,
                      "classifier": line_classifier, "batch": config.training.batch_size,
                      "batch_key": "training.batch_size", "pool": source.data})
    for index, replacement in enumerate(config.replacements):
        if replacement.backbone is not None:
            lines.append({"key": f"replacements[{index}]", "backbone": replacement.backbone,
                          "backbone_config": replacement.backbone_config, "classifier": line_classifier,
                          "batch": config.training.batch_size, "batch_key": "training.batch_size",
                          "pool": config.data})
    return lines


def memory_problems(config: ScenarioConfig, device: str | None = None,
                    room: tuple[int, str, str] | None = None) -> list[tuple[str, str]]:
    """(config key, problem) for each training stage whose memory estimate exceeds what this machine has for it
    (``device``: where the stages run, default the config's device, ``auto`` = CUDA when present). ``room``: (bytes,
    what they are, who has them) to compare with instead of this machine's memory (a cluster node's:
    cluster.ray.memory_check)."""
    import torch

    if room is None:
        device = str(device or config.device)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        room = (*available_memory(device), "this machine")
    room, what, holder = room
    problems = []
    for line in _training_lines(config):
        shape = ModelShape.of(config, line["classifier"], line["backbone"], line["backbone_config"])
        try:
            image_shape = tuple(load_pool(line["pool"], f"{line['key']} pool").image_shape)
        except Exception:  # noqa: BLE001 - data problems are reported by data_problems; estimated without images
            image_shape = None
        estimate = training_memory(shape.backbone, shape.backbone_config, shape.num_slots, line["classifier"],
                                   shape.head, line["batch"], image_shape)
        if estimate.total > room:
            problems.append(("model.num_slots", f"model.num_slots={shape.num_slots} with {line['batch_key']}="
                             f"{line['batch']} ({line['key']}, backbone {shape.backbone}): a training stage needs "
                             f"about {estimate.describe()}, but {holder} has {room / GIB:.2f} GiB of {what}; "
                             f"lower model.num_slots or {line['batch_key']}, or run the stage where it fits"))
    return problems


def output_problems(run_dir: str) -> list[tuple[str, str]]:
    """An ``s3://`` run folder whose bucket does not exist (named, with the endpoint)."""
    if not cio.is_s3(str(run_dir)):
        return []
    bucket = cio.S3Uri.parse(str(run_dir)).bucket
    try:
        cio.exists(str(cio.S3Uri(bucket)))
        cio.list_dir(str(cio.S3Uri(bucket)))
    except FileNotFoundError as error:
        return [("output.dir", f"bucket {bucket!r} of {run_dir} does not exist ({error})")]
    except OSError as error:
        return [("output.dir", f"cannot reach bucket {bucket!r} of {run_dir}: {error}")]
    return []


def preflight(config: ScenarioConfig, run_dir: str | None = None, cluster_has_gpus: bool | None = None,
              check_device: bool = True) -> None:
    """Raise PreflightError listing every problem (all of them, so one pass fixes a new machine); None when the
    scenario can run. ``cluster_has_gpus``: judge ``device: cuda`` by the cluster instead of this machine."""
    problems = data_problems(config)
    problems += weights_problems(config)
    if check_device:
        problems += device_problems(config, cluster_has_gpus)
        if not problems:
            problems += memory_problems(config)
    if run_dir is not None:
        problems += output_problems(run_dir)
    if problems:
        raise PreflightError(problems)


__all__ = ["PreflightError", "data_problems", "device_problems", "memory_problems", "output_problems", "preflight",
           "weights_problems",
           "weights_sources"]
