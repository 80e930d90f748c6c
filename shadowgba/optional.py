"""The optional dependencies, imported only by the features that use them.

`import shadowgba` and the shadow and GBA runtimes need torch alone (a plain PyTorch model). TorchRec
is needed by its features (a `DistributedModelParallel`'s dense part and sharded tables, PS-hosted
tables) and TensorBoard by the `SummaryWriter` sink (`sync.tensorboard_dir`). Each is imported here,
at first use, and its absence is a `SetupError` naming what to install, not a bare import error from
inside the library.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from shadowgba.errors import SetupError

INSTALL = {
    "torchrec": "pip install 'shadowgba[torchrec]' (TorchRec declares fbgemm-gpu, the CUDA build; on a "
                "CPU-only machine install fbgemm-gpu-cpu matching your torch, then torchrec with --no-deps)",
    "tensorboard": "pip install 'shadowgba[tensorboard]'",
}
"""Per optional package: how a user installs it."""


def available(package: str) -> bool:
    """Whether `package` is installed (without importing it)."""
    return importlib.util.find_spec(package) is not None


def require(package: str, feature: str) -> ModuleType:
    """Import `package` for `feature`, or raise `SetupError` naming the feature and how to install it."""
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as error:
        if error.name is not None and error.name.split(".")[0] != package:
            raise  # the package is there; something it imports is not: pip's message says what
        raise SetupError(f"{feature} needs {package}, which is not installed: {INSTALL[package]}") from error


def torchrec_integration(feature: str) -> ModuleType:
    """`shadowgba.integrations.torchrec` for `feature`, once TorchRec is known to be installed."""
    require("torchrec", feature)
    return importlib.import_module("shadowgba.integrations.torchrec")


def ps_embedding(feature: str) -> ModuleType:
    """`shadowgba.ps.embedding` (PS-hosted tables, TorchRec's EmbeddingBagCollection API) for `feature`."""
    require("torchrec", feature)
    return importlib.import_module("shadowgba.ps.embedding")


def ps_embedding_shard(feature: str) -> ModuleType:
    """`shadowgba.ps.embedding_shard` (a server's shard of PS-hosted tables, and their config) for `feature`."""
    require("torchrec", feature)
    return importlib.import_module("shadowgba.ps.embedding_shard")
