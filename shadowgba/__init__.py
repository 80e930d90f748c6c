"""shadowgba: synchronization out of the training loop, for PyTorch and TorchRec.

`ShadowSync` wraps a model and its optimizer; a shadow thread keeps the dense replicas in sync with
an algorithm from `sync_algos` chosen by `SyncConfig.algo`. See README.md for the quick start.
"""

from shadowgba.config import BASELINES, ConfigError, SyncConfig, load_config
from shadowgba.metrics import SyncMetrics
from shadowgba.runtime import ShadowSync, ShadowSyncError

__all__ = [
    "BASELINES",
    "ConfigError",
    "ShadowSync",
    "ShadowSyncError",
    "SyncConfig",
    "SyncMetrics",
    "load_config",
]
