"""The 2D layout: replica groups of ranks that shard the tables among themselves.

A job of `R x k` trainers with `sync.sharding_group_size: k` is cut into R *replica groups* of k
consecutive ranks: group g is ranks `g*k ... g*k + k - 1`, its *sharding group*. TorchRec shards
the tables over a sharding group only, so its per-step all-to-all pairs those k ranks and no
others. Every group holds the same shards at the same places: the rank at position l of group g
holds what position l holds in every other group. The ranks at position l of all groups form the
*replica group* l (`R` ranks), over which shadowgba averages those table shards in the background.

    ranks:            0 1 | 2 3 | 4 5          (R = 3 groups, k = 2)
    sharding groups:  {0,1} {2,3} {4,5}        TorchRec's all-to-all, in the step
    replica groups:   {0,2,4} {1,3,5}          table fragments, in the shadow thread
    dense rounds:     {0,1,2,3,4,5}            every rank holds a dense replica (as in the flat layout)

Contiguous groups put a sharding group on one host when k divides the ranks per host, so the
all-to-all stays inside a host and only the background averaging crosses hosts (TorchRec's
`DMPCollection` calls this `use_inter_host_allreduce`).

Invariants: every rank creates every group, in the same order (torch requires it of `new_group`);
each group gets the job's `sync.timeout_s`, so a peer that stops answering fails the collective
waiting for it instead of leaving it waiting for torch's default half hour.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch.distributed as dist



@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """This rank's place in a 2D job: its sharding group (tables) and its replica group (their replicas)."""

    group_size: int
    """k: ranks per sharding group."""
    num_groups: int
    """R: replica groups in the job."""
    group_index: int
    """Which replica group this rank belongs to (g)."""
    position: int
    """This rank's position in its sharding group (l): the shards it holds."""
    sharding_group: dist.ProcessGroup = dataclasses.field(compare=False, repr=False)
    """The k ranks of group g: TorchRec's sharding environment."""
    replica_group: dist.ProcessGroup | None = dataclasses.field(default=None, compare=False, repr=False)
    """The R ranks at position l: where this rank's table shards are averaged. With a torchrun job
    per replica group, None until `dense_sync` meets the other groups (`shadowgba.factory`)."""

    @classmethod
    def build(cls, trainer_ranks: tuple[int, ...], rank: int, group_size: int, timeout_s: float) -> "ReplicaLayout":
        """Collective over `trainer_ranks`: create every sharding and replica group, return this rank's."""
        trainers = len(trainer_ranks)  # a multiple of group_size (`SyncConfig.check_world_size`)
        timeout = datetime.timedelta(seconds=timeout_s)
        num_groups = trainers // group_size
        index = trainer_ranks.index(rank)
        sharding = [dist.new_group([trainer_ranks[g * group_size + l] for l in range(group_size)], timeout=timeout)
                    for g in range(num_groups)]
        replica = [dist.new_group([trainer_ranks[g * group_size + l] for g in range(num_groups)], timeout=timeout)
                   for l in range(group_size)]
        group, position = divmod(index, group_size)
        return cls(group_size, num_groups, group, position, sharding[group], replica[position])

    def global_rank(self, position: int) -> int:
        """The global rank at `position` of this rank's sharding group."""
        return dist.get_global_rank(self.sharding_group, position)
