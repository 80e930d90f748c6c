"""The `torchrec_2d` baseline: TorchRec's own 2D recipe, rebuilt on CPU for side-by-side runs.

TorchRec's `DMPCollection` (CUDA only) shards the tables within a sharding group, wraps the dense
part in DDP over every rank, and `sync()` averages the replicated table shards, weights and fused
optimizer state, with a blocking all-reduce on the replica groups every N batches
(`TrainPipelineSparseDist(dmp_collection_sync_interval_batches=N)`). Here: the same groups
(`shadowgba.layout`, `sync.sharding_group_size`), `WorldDDP` for the dense part, and `ReplicaSync`
after every N-th `optimizer.step()`, in the training thread, in place on the kernels' storage.
N is `sync.foreground_every`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from dlrm.stepped import AfterEveryStep
from shadowgba.integrations.torchrec import fused_table_shards


class WorldDDP(DefaultDataParallelWrapper):
    """TorchRec's default dense DDP, over `group` (every trainer) instead of the DMP's sharding group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        super().wrap(dmp, ShardingEnv.from_process_group(self.group), device)


class ReplicaSync(AfterEveryStep):
    """Context manager: while entered, every `every`-th `optimizer.step()` is followed by the
    blocking average of this rank's table shards over `replica_group` (`DMPCollection.sync()`)."""

    def __init__(self, model: nn.Module, optimizer: Any, every: int, replica_group: dist.ProcessGroup) -> None:
        super().__init__(optimizer)
        self.tensors = [tensor for shard in fused_table_shards(model) for tensor in shard.tensors]
        self.every = every
        self.group = replica_group
        self.replicas = dist.get_world_size(replica_group)
        self._bytes_per_round = sum(tensor.numel() * tensor.element_size() for tensor in self.tensors)
        self._step = 0

    def _after_step(self) -> None:
        started = time.perf_counter()
        self._step += 1
        if self._step % self.every == 0:
            for tensor in self.tensors:  # gloo has no AVG: sum, then divide
                dist.all_reduce(tensor, group=self.group)
                tensor.div_(self.replicas)
            spent = time.perf_counter() - started
            self.metrics.record_round(spent, self._bytes_per_round)
            self.metrics.record_applied(self._step)
        self.metrics.record_step(time.perf_counter() - started)
