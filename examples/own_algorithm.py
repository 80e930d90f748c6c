"""Your own synchronization algorithm: registered in your script, chosen by `sync.algo`.

    torchrun --standalone --nproc_per_node=2 examples/own_algorithm.py --config examples/configs/ma.yaml \
        --sync.algo partial_ma --sync.partial_ma.pull 0.5

`PartialAveraging` moves each replica a share `pull` of the way to the replicas' average every
round (1 is model averaging). Registered before the config is read, it is a first-class algorithm:
its options are the `sync.partial_ma` section (YAML or `--sync.partial_ma.<key>`), checked by its
`Config`; it runs in the shadow thread (or the foreground) with the same pacing, NaN handling,
checkpoints and metrics as the built-in ones. The training loop is `plain_loop.py`'s, unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import distributed as dist

import sync_algos
from plain_loop import main
from sync_algos.base import RoundResult, SyncAlgorithm


@dataclasses.dataclass
class PartialAveragingConfig:
    pull: float = 0.5
    """The share of the way to the average a round moves each replica, in (0, 1]."""

    def __post_init__(self) -> None:
        if not 0 < self.pull <= 1:
            raise ValueError(f"pull must be in (0, 1], got {self.pull}")


@sync_algos.register
class PartialAveraging(SyncAlgorithm):
    """`t = s + pull * (allreduce(s) / n - s)`."""

    name = "partial_ma"
    Config = PartialAveragingConfig

    def round(self, snapshot: torch.Tensor, stop: bool) -> RoundResult:
        average, reduced = self.average(snapshot, stop)
        if average is not None and reduced.own_counted:  # the snapshot becomes the delta t - s
            snapshot.sub_(average).mul_(-self.config.pull)
        return self.result(snapshot, reduced, consensus=average)  # a NaN replica heals to the average


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
