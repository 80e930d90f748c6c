"""The `pma` baseline: torch's periodic model averaging of the dense replicas, as post-local SGD does it.

After every `optimizer.step()` torch's `PeriodicModelAverager` is called on the dense parameters; every
`sync.foreground_every` (k) steps it replaces them by their mean over the trainer group, in one blocking
all-reduce on the training thread. There is no DDP phase (local SGD from the first step) and no final
average: the replicas end identical only when the last step is an averaging step.

Rounds follow ShadowSync's foreground mode: after steps k, 2k, 3k, ... (torch counts calls from 0 and
averages at calls `warmup_steps + n * period`, so `warmup_steps = k - 1`). Of `SyncConfig` only
`foreground_every` is read.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from dlrm.stepped import AfterEveryStep


class PeriodicAveraging(AfterEveryStep):
    """Context manager: while entered, `optimizer.step()` is followed by torch's periodic averager.

    `metrics.summary()` has the keys of ShadowSync's: `rounds` (averaging all-reduces),
    `training_sync_s` (time the training thread spent in the averager), `bytes_moved`, latencies.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        period: int,
        process_group: dist.ProcessGroup,
    ) -> None:
        super().__init__(optimizer)
        self.params = list(params)
        self.period = period
        self._averager = PeriodicModelAverager(period=period, warmup_steps=period - 1, process_group=process_group)
        self._bytes_per_round = sum(param.numel() * param.element_size() for param in self.params)
        self._step = 0

    def _after_step(self) -> None:
        """Let torch's averager see the step; on averaging steps it all-reduces, else it only counts."""
        started = time.perf_counter()
        self._averager.average_parameters(self.params)
        spent = time.perf_counter() - started
        self._step += 1
        if self._step % self.period == 0:
            self.metrics.record_round(spent, self._bytes_per_round)
            self.metrics.record_applied(self._step)
        self.metrics.record_step(spent)
