"""String registry of synchronization algorithms: every entry is selectable by its `name`.

Each entry has a `name`, a `kind` and a `Config` dataclass that validates its options. There are
two kinds:

- *model* (`ma`, `easgd`, `bmuf`, `easgd_ps`): `SyncAlgorithm` subclasses, whose round maps a
  snapshot of the dense parameters to a target. They are built here, `build_algorithm(name, ...)`,
  with whatever resources beyond their config they need (S-EASGD's `centre`).
- *gradient* (`gba`): trainers push gradients rather than exchange models, so there is no round to
  build. The entry names GBA's aggregation rule, which the parameter servers run
  (`sync_algos.gba`); the trainer runtime that pushes to them is chosen by shadowgba's factory
  from this kind. `build_algorithm` therefore builds model algorithms only and says so for gba.
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
    """Build model algorithm `name` for `group`; `options` is its Config instance or a mapping of its
    fields; `resources` go to its constructor as keyword arguments (S-EASGD: `centre`)."""
    cls = get_algorithm(name)
    if cls.kind != "model":
        raise ValueError(f"'{name}' is a {cls.kind} algorithm: no round to build; its rule runs on the parameter "
                         "servers and its trainer runtime is shadowgba.gba.runtime.GBASync, not ShadowSync")
    config = cls.Config(**options) if isinstance(options, Mapping) else options
    if not isinstance(config, cls.Config):
        raise TypeError(f"options for '{name}' must be a mapping or {cls.Config.__name__}, got {type(options).__name__}")
    return cls(config, group, initial, **resources)
