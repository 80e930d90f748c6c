"""Dense-parameter synchronization algorithms, one module each, selected by name.

Importing the package registers every built-in algorithm: `ma`, `easgd`, `bmuf`, `easgd_ps` (model
averaging family, run by ShadowSync) and `gba` (gradient aggregation, run by GBASync).
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
