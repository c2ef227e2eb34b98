"""Local paths made absolute where the user typed them.

A relative path means "relative to the folder I am in" only on the machine and in the folder where the command was
typed. A Ray Job, a Tune trial or a worker runs in a working folder of its own, where the same relative path names
another place (results written into Ray's temporary package folder and lost). Every local path a config or a
command receives is therefore made absolute once, when it is read; URIs (``s3://``, ``models:/``, ``runs:/``,
``http://``...) and ``pretrain:<name>`` references are left as they are.
"""
from __future__ import annotations

import os
import re
from typing import Any

from compat_core.data import dataset_info

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # s3://, models:/, runs:/, pretrain:NAME, http://...


def is_local_path(value: str | None) -> bool:
    """True for a non-empty file-system path (no URI scheme, no ``pretrain:`` reference)."""
    return bool(value) and not _SCHEME.match(str(value))


def absolute_location(value: str | os.PathLike | None) -> str | None:
    """``value`` as an absolute local path (``~`` expanded, relative to the current folder); URIs unchanged."""
    if value is None:
        return None
    text = os.fspath(value)
    if not is_local_path(text):
        return text
    return os.path.abspath(os.path.expanduser(text))


def config_paths(config: Any) -> dict[str, str]:
    """Every path-valued setting of a validated scenario: {config key: value} (local paths and URIs alike)."""
    found: dict[str, str] = {}

    def pool(key: str, spec: Any) -> None:
        if spec is not None and spec.root:
            found[f"{key}.root"] = spec.root

    pool("data", config.data)
    pool("evaluation.query_set", config.evaluation.query_set)
    pool("evaluation.gallery_set", config.evaluation.gallery_set)
    for index, source in enumerate(config.tasks.sources):
        pool(f"tasks.sources[{index}].data", source.data)
    for index, spec in enumerate(config.pretrain):
        pool(f"pretrain[{index}].pool", spec.pool)
        if spec.init:
            found[f"pretrain[{index}].init"] = spec.init
    if config.initial_model:
        found["initial_model"] = config.initial_model
    for index, replacement in enumerate(config.replacements):
        found[f"replacements[{index}].source"] = replacement.source
    found["output.dir"] = config.output.dir
    if config.output.shared_store:
        found["output.shared_store"] = config.output.shared_store
    return found


def local_config_paths(config: Any) -> dict[str, str]:
    """The settings of :func:`config_paths` that are local file-system paths."""
    return {key: value for key, value in config_paths(config).items() if is_local_path(value)}


def absolute_config(config: Any) -> Any:
    """A copy of the validated scenario whose local paths (data roots, weights, output.dir, output.shared_store)
    are absolute, resolved against the current folder; nothing else changes."""

    def pool(spec: Any) -> Any:
        if spec is None or not is_local_path(spec.root):
            return spec
        return spec.model_copy(update={"root": absolute_location(spec.root)})

    pretrain = [spec.model_copy(update={"pool": pool(spec.pool), "init": absolute_location(spec.init)})
                for spec in config.pretrain]
    replacements = [r.model_copy(update={"source": absolute_location(r.source)}) for r in config.replacements]
    evaluation = config.evaluation.model_copy(update={"query_set": pool(config.evaluation.query_set),
                                                      "gallery_set": pool(config.evaluation.gallery_set)})
    output = config.output.model_copy(update={"dir": absolute_location(config.output.dir),
                                              "shared_store": absolute_location(config.output.shared_store)})
    sources = [source.model_copy(update={"data": pool(source.data)}) for source in config.tasks.sources]
    tasks = config.tasks.model_copy(update={"sources": sources})
    return config.model_copy(update={
        "data": pool(config.data), "tasks": tasks, "evaluation": evaluation, "pretrain": pretrain,
        "replacements": replacements,
        "initial_model": absolute_location(config.initial_model), "output": output})


def check_overridden_roots(before: Any, after: Any) -> None:
    """Raise ValueError naming each ``--set`` that changed a pool's ``root`` where no stage reads data from it: the
    pool's dataset generates its images (e.g. glyphs: root is only its cache folder), so the override would be
    silently ignored. ``before`` / ``after``: the scenario validated without / with the overrides."""
    pools = {"data": after.data, "evaluation.query_set": after.evaluation.query_set,
             "evaluation.gallery_set": after.evaluation.gallery_set}
    pools.update({f"pretrain[{i}].pool": spec.pool for i, spec in enumerate(after.pretrain)})
    pools.update({f"tasks.sources[{i}].data": source.data for i, source in enumerate(after.tasks.sources)})
    old, new = config_paths(before), config_paths(after)
    problems = []
    for key, pool in pools.items():
        root_key = f"{key}.root"
        if new.get(root_key) == old.get(root_key) or root_key not in new:
            continue
        try:
            generated = dataset_info(pool.dataset).generated
        except KeyError:
            continue  # an unknown dataset is reported by validation / the data check
        if generated:
            problems.append(f"--set {root_key}={new[root_key]}: no stage reads data from it: dataset "
                            f"{pool.dataset!r} generates its images (root is only its cache folder; set "
                            f"{key}.options.cache_dir to move the cache)")
    if problems:
        raise ValueError("; ".join(problems))


__all__ = ["check_overridden_roots", "absolute_config", "absolute_location", "config_paths", "is_local_path",
           "local_config_paths"]
