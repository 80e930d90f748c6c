"""TorchRec integration: every TorchRec internal shadowgba relies on, in one place.

- `ShadowDataParallelWrapper` keeps the dense part of a `DistributedModelParallel` out of DDP.
  TorchRec's default `DataParallelWrapper` wraps every unsharded parameter in DDP, which all-reduces
  dense gradients inside backward: exactly the blocking sync shadowgba removes. This wrapper only
  places the module on its device, leaving the dense replicas to the sync runtime. The same code
  path serves gloo on CPU and NCCL on GPUs.
- `dense_named_parameters`: a DMP's parameters minus its sharded tables.
- `dmp_kwargs` / `ShardingGuard`: with parameter-server ranks in the job, TorchRec must shard
  over the trainers only; a DMP over the whole world would wait forever for the servers in its
  planner's collectives and all-to-all, so its construction is refused, naming the fix.
- `dense_optimizer`: the torch optimizer of the dense parameters inside TorchRec's
  `KeyedOptimizerWrapper` / `CombinedOptimizer` (GBA mirrors its type and hyperparameters).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from shadowgba.errors import SetupError

__all__ = [
    "ShadowDataParallelWrapper", "ShardingGuard", "dense_named_parameters", "dense_optimizer",
    "dmp_kwargs", "has_sharded_tables",
]


class ShadowDataParallelWrapper(DataParallelWrapper):
    """A `DataParallelWrapper` that applies no data parallelism to the dense part."""

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        dmp._dmp_wrapped_module = dmp._dmp_wrapped_module.to(device)


def dmp_kwargs(trainer_group: dist.ProcessGroup) -> dict[str, Any]:
    """`DistributedModelParallel` keyword arguments: shard over `trainer_group`, no dense DDP."""
    return {"env": ShardingEnv.from_process_group(trainer_group), "data_parallel_wrapper": ShadowDataParallelWrapper()}


def _sharded_names(model: nn.Module) -> set[str]:
    if not isinstance(model, DistributedModelParallel):
        return set()
    return set(DistributedModelParallel._sharded_parameter_names(model._dmp_wrapped_module))


def dense_named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The replicated parameters of `model`: for a DMP, all trainable parameters minus the sharded ones."""
    sharded = _sharded_names(model)
    for name, param in model.named_parameters():
        if name not in sharded and param.requires_grad:
            yield name, param


def has_sharded_tables(model: nn.Module) -> bool:
    """Whether `model` is a DMP with sharded tables (whose per-step all-to-all pairs the trainers)."""
    return bool(_sharded_names(model))


class ShardingGuard:
    """While installed, a `DistributedModelParallel` that would shard over more ranks than the
    trainers is refused at construction (before its planner's first collective over the world,
    which the servers never enter), naming the fix. `shadowgba.join` installs it on the trainers of
    a job with parameter servers and `Job.close()` removes it."""

    def __init__(self, trainer_group: dist.ProcessGroup, num_servers: int) -> None:
        self.trainers = dist.get_world_size(trainer_group)
        self.num_servers = num_servers
        self._original: Any = None

    def install(self) -> None:
        original = DistributedModelParallel.__init__
        signature = inspect.signature(original)
        guard = self

        @functools.wraps(original)
        def checked_init(dmp: DistributedModelParallel, *args: Any, **kwargs: Any) -> None:
            env = signature.bind(dmp, *args, **kwargs).arguments.get("env")
            guard.check(dist.get_world_size() if env is None else env.world_size)
            original(dmp, *args, **kwargs)

        self._original = original
        DistributedModelParallel.__init__ = checked_init

    def remove(self) -> None:
        if self._original is not None:
            DistributedModelParallel.__init__ = self._original
            self._original = None

    def check(self, sharded_over: int) -> None:
        if sharded_over != self.trainers:
            raise SetupError(
                f"this DistributedModelParallel would shard its tables over {sharded_over} ranks, but only "
                f"{self.trainers} train ({self.num_servers} are parameter servers and never join TorchRec's "
                "collectives, so it would wait for them forever); build it with "
                "DistributedModelParallel(..., **job.dmp_kwargs())"
            )


def dense_optimizer(optimizer: Any, dense_params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer that steps `dense_params`, found inside TorchRec's keyed / combined
    optimizers (a plain torch optimizer is returned as it is)."""
    candidates = _torch_optimizers(optimizer)
    dense = {id(param) for param in dense_params}
    for candidate in candidates:
        stepped = {id(param) for group in candidate.param_groups for param in group["params"]}
        if dense <= stepped:
            return candidate
    names = [type(candidate).__name__ for candidate in candidates]
    raise SetupError(
        f"none of the optimizers inside {type(optimizer).__name__} ({names}) steps every dense parameter; "
        "GBA needs one dense optimizer over all of them"
    )


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    if isinstance(optimizer, CombinedOptimizer):
        return [inner for _, keyed in optimizer.optimizers for inner in _torch_optimizers(keyed)]
    if isinstance(optimizer, KeyedOptimizerWrapper):
        return [optimizer._optimizer]
    return [optimizer]
