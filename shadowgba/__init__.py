"""shadowgba: synchronization out of the training loop, for PyTorch and TorchRec.

`join` a job on every rank, then wrap the training loop in `dense_sync(...)`: a `DenseSync` that
keeps the dense replicas in sync with the algorithm `SyncConfig.algo` names (ma, easgd, bmuf,
easgd_ps in the shadow runtime; gba in the GBA runtime). See README.md for the quick start.
"""

from shadowgba.config import SyncConfig, load_config
from shadowgba.errors import CheckpointError, ConfigError, PeerLost, SetupError, ShadowGBAError, SyncError
from shadowgba.factory import Job, dense_sync, join, ps_table_options
from shadowgba.interface import DenseSync
from shadowgba.network import init_process_group

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DenseSync",
    "Job",
    "PeerLost",
    "SetupError",
    "ShadowGBAError",
    "SyncConfig",
    "SyncError",
    "dense_sync",
    "init_process_group",
    "join",
    "load_config",
    "ps_table_options",
]
