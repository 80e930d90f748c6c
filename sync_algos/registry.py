"""String registry of synchronization algorithms: the config names one, the registry builds it.

Two kinds are registered: *model* algorithms (`SyncAlgorithm` subclasses: a round maps a snapshot
of the dense parameters to a target; run by `shadowgba.ShadowSync`) and *gradient* algorithms
(GBA: trainers push gradients to a parameter server; run by `shadowgba.gba.GBASync`). Every entry
has a `name`, a `kind` and a `Config` dataclass that validates `sync.options`.
"""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

import torch
import torch.distributed as dist

from sync_algos.base import SyncAlgorithm

_ALGORITHMS: dict[str, type] = {}

AlgorithmT = TypeVar("AlgorithmT", bound=type)


def register(cls: AlgorithmT) -> AlgorithmT:
    """Class decorator: make an algorithm selectable by its `name`."""
    if cls.name in _ALGORITHMS:
        raise ValueError(f"sync algorithm '{cls.name}' is registered twice")
    _ALGORITHMS[cls.name] = cls
    return cls


def algorithm_names() -> list[str]:
    """Names a config may use, sorted."""
    return sorted(_ALGORITHMS)


def get_algorithm(name: str) -> type:
    """The algorithm class registered under `name`; the error lists the allowed names."""
    try:
        return _ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown sync algorithm '{name}'; allowed: {algorithm_names()}") from None


def build_algorithm(
    name: str,
    options: Any,
    group: dist.ProcessGroup | None,
    initial: torch.Tensor,
    **resources: Any,
) -> SyncAlgorithm:
    """Build algorithm `name` for `group`; `options` is its Config instance or a mapping of its fields."""
    cls = get_algorithm(name)
    if cls.kind != "model":
        raise ValueError(f"'{name}' is a {cls.kind} algorithm: it runs in shadowgba.gba.GBASync, not ShadowSync")
    config = cls.Config(**options) if isinstance(options, Mapping) else options
    if not isinstance(config, cls.Config):
        raise TypeError(f"options for '{name}' must be a mapping or {cls.Config.__name__}, got {type(options).__name__}")
    return cls(config, group, initial, **resources)
