"""The dataset registry: one name per dataset, each reading its published on-disk format.

Reader modules register themselves on import; every module of the reader packages (:data:`READER_PACKAGES`) is
imported lazily on the first lookup, so importing ``compat_core.data`` stays cheap and a new format is one new module. ``root`` is a local folder or an ``s3://bucket/prefix`` URI; nothing is downloaded.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, Mapping

from compat_core.data.source import ImageSource
from compat_core.registry import Registry

DATASETS: Registry = Registry("dataset")

# Every module of these packages registers its datasets when imported (one module per published format; the glyph
# generator); they are found by listing the packages, so a new format is one new module and no list changes here.
READER_PACKAGES = ("compat_core.data.formats", "compat_core.data.glyphs")
_imported = False


@dataclass(frozen=True)
class DatasetInfo:
    """What a registered dataset reads.

    ``splits``: accepted ``split`` values; ``layout``: the expected files and their line/record formats;
    ``options``: accepted keyword options -> meaning and default; ``default_root``: used when ``root`` is None.
    ``derived_splits``: for a dataset whose splits depend on the others (``shards`` keeps its source split's name),
    the callable that lists them once every reader is registered (:func:`dataset_info` fills ``splits`` from it).
    """

    name: str
    summary: str
    splits: tuple[str, ...]
    layout: str
    options: Mapping[str, str] = field(default_factory=dict)
    default_root: str | None = None
    loader: Callable[..., ImageSource] | None = field(default=None, repr=False, compare=False)
    generated: bool = False  # images made by the reader itself: ``root`` is only where it caches them, no input
    derived_splits: Callable[[], tuple[str, ...]] | None = field(default=None, repr=False, compare=False)
    class_space: str | None = None  # datasets naming the same class space compare class identities (None: own name)

    @property
    def space(self) -> str:
        """The class space of this dataset: datasets of one space share class identities (CIFAR100R, CIFAR-100)."""
        return self.class_space or self.name


def register_dataset(
    name: str,
    *,
    summary: str,
    splits: tuple[str, ...] | Callable[[], tuple[str, ...]],
    layout: str,
    options: Mapping[str, str] | None = None,
    default_root: str | None = None,
    generated: bool = False,
    class_space: str | None = None,
):
    """Decorator registering ``loader(root, split, **options) -> ImageSource`` under ``name`` with its description
    (generated: the reader makes its images and reads no data from ``root``). ``splits``: the accepted split names,
    or a callable listing them when the dataset is looked up (splits that depend on the other datasets).
    ``class_space``: the name of the dataset whose classes this one draws from (a subsample of another dataset), so
    the open-set guard compares their class identities; None: a class space of its own."""

    def _register(loader: Callable[..., ImageSource]) -> Callable[..., ImageSource]:
        derived = splits if callable(splits) else None
        info = DatasetInfo(name, summary, () if derived else tuple(splits), layout, dict(options or {}),
                           default_root, loader, generated, derived, class_space)
        DATASETS.register(name, info)
        return loader

    return _register


def _import_readers() -> None:
    """Import every reader module of :data:`READER_PACKAGES` once (each registers its datasets), in name order."""
    global _imported
    if _imported:
        return
    for package_name in READER_PACKAGES:
        package = importlib.import_module(package_name)
        for module in sorted(info.name for info in pkgutil.iter_modules(package.__path__)
                             if not info.ispkg and not info.name.startswith("_")):
            importlib.import_module(f"{package_name}.{module}")
    _imported = True


def dataset_names() -> list[str]:
    """Every registered dataset name, sorted."""
    _import_readers()
    return DATASETS.names()


def dataset_info(name: str) -> DatasetInfo:
    """The :class:`DatasetInfo` of ``name`` (KeyError listing valid names when unknown)."""
    _import_readers()
    entry = DATASETS.get(name)
    if isinstance(entry, DatasetInfo):
        if entry.derived_splits is not None:
            return dataclasses.replace(entry, splits=tuple(entry.derived_splits()))
        return entry
    # A plain factory registered with DATASETS.register(name) directly: describe it from its docstring.
    doc = inspect.getdoc(entry) or ""
    return DatasetInfo(name, doc.split("\n", 1)[0], (), doc, {}, None, entry)


def load_dataset(name: str, root: str | None = None, split: str | None = "train", **options) -> ImageSource:
    """Open dataset ``name`` from ``root`` (local folder or ``s3://bucket/prefix``) as an :class:`ImageSource`.

    ``split=None`` takes the dataset's own default (its first listed split; lfw has only "pairs"). ``split`` and
    ``options`` are validated against :func:`dataset_info`; unknown values raise ValueError listing the
    accepted ones. Labels of the returned source are 0-based class ids.
    """
    info = dataset_info(name)
    if not isinstance(DATASETS.get(name), DatasetInfo):
        return _call_plain_factory(info.loader, root, split, options)
    if split is None:
        split = info.splits[0]
    if split not in info.splits:
        raise ValueError(f"dataset {name!r}: unknown split {split!r}; valid splits: {', '.join(info.splits)}")
    unknown = sorted(set(options) - set(info.options))
    if unknown:
        valid = ", ".join(sorted(info.options)) or "(none)"
        raise ValueError(f"dataset {name!r}: unknown option(s) {unknown}; valid options: {valid}")
    if root is None:
        root = info.default_root
    return info.loader(root=root, split=split, **options)


def _call_plain_factory(factory, root, split, options) -> ImageSource:
    parameters = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    kwargs = dict(options)
    if split is not None:
        kwargs["split"] = split
    if root is not None or takes_any or "root" in parameters:
        kwargs["root"] = root
    return factory(**kwargs)


__all__ = ["DATASETS", "DatasetInfo", "register_dataset", "load_dataset", "dataset_info", "dataset_names", "READER_PACKAGES"]
