"""Synchronization algorithms, maths only: one module each, selected by name (`registry`).

Importing the package registers every built-in algorithm: `ma`, `easgd`, `bmuf`, `easgd_ps` (the
model-averaging family; `build_algorithm` builds them) and `gba` (gradient aggregation: the rule the
parameter servers run). Nothing here imports `shadowgba` or talks to the network: what an algorithm
needs from outside (S-EASGD's centre) comes in through a small interface (`easgd_ps.Centre`).
"""

from sync_algos.base import FlaggedAllReduce, RoundResult, SyncAlgorithm
from sync_algos.registry import algorithm_names, build_algorithm, get_algorithm, register
from sync_algos import bmuf, easgd, easgd_ps, gba, ma  # noqa: F401  (registration side effect)

__all__ = [
    "FlaggedAllReduce",
    "RoundResult",
    "SyncAlgorithm",
    "algorithm_names",
    "build_algorithm",
    "get_algorithm",
    "register",
]
