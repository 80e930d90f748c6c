"""TorchRec integration: keep the dense part of a `DistributedModelParallel` out of DDP.

TorchRec's default `DataParallelWrapper` wraps every unsharded parameter in DDP, which all-reduces
dense gradients inside backward: exactly the blocking sync shadowgba removes. `ShadowDataParallelWrapper`
only places the module on its device, leaving the dense replicas to train locally while the shadow
runtime keeps them together. The same code path serves gloo on CPU and NCCL on GPUs.
"""

from __future__ import annotations

import torch
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from shadowgba.dense import dense_named_parameters

__all__ = ["ShadowDataParallelWrapper", "dense_named_parameters"]


class ShadowDataParallelWrapper(DataParallelWrapper):
    """A `DataParallelWrapper` that applies no data parallelism to the dense part."""

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        dmp._dmp_wrapped_module = dmp._dmp_wrapped_module.to(device)
