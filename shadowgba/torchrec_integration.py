"""TorchRec integration: keep the dense part of a `DistributedModelParallel` out of DDP.

TorchRec's default `DataParallelWrapper` wraps every unsharded parameter in DDP, which all-reduces
dense gradients inside backward: exactly the blocking sync shadowgba removes. `ShadowDataParallelWrapper`
only places the module on its device, leaving the dense replicas to train locally while the shadow
runtime keeps them together. The same code path serves gloo on CPU and NCCL on GPUs.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv


class ShadowDataParallelWrapper(DataParallelWrapper):
    """A `DataParallelWrapper` that applies no data parallelism to the dense part."""

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        dmp._dmp_wrapped_module = dmp._dmp_wrapped_module.to(device)


def dense_named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The replicated (dense) parameters of `model`: for a DMP, all parameters minus the sharded ones.

    Parameters that do not require grad are skipped: nothing trains them, so nothing needs syncing.
    """
    sharded: set[str] = set()
    if isinstance(model, DistributedModelParallel):
        sharded = set(DistributedModelParallel._sharded_parameter_names(model._dmp_wrapped_module))
    for name, param in model.named_parameters():
        if name not in sharded and param.requires_grad:
            yield name, param
