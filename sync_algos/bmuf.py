"""Blockwise model-update filtering (BMUF, Chen & Huo 2016): model averaging with block momentum.

Every rank holds the same global model `Wg` and block momentum `D`. Per round:
`a = allreduce(s)/n; G = a - start; D = eta*D + zeta*G; Wg = Wg + D`, and the target (the next
block's starting point) is `t = Wg + eta*D` (Nesterov) or `t = Wg` (classic). With `eta = 0,
zeta = 1` it is exactly MA.

`start` is the previous round's target: `Wg` for classic BMUF, but `Wg + eta*D` for Nesterov. The
textbook form `G = a - Wg`, used under Nesterov, would count the look-ahead `eta*D`, which the
replicas already hold, a second time: `D <- 2*eta*D + progress`, which stops decaying at the
default eta = 1 - 1/n for n = 2 and diverges beyond (observed: Hogwild training stalled).
Measured from the block's start, G is the replicas' own progress, as in fairseq's BMUF; for
classic BMUF the two forms are the same.

`a` averages the finite snapshots only (`sync_algos.base`): every rank still updates `Wg` and `D`
alike, so they stay identical, but a rank whose snapshot held NaN / Inf keeps its own weights.

The first round places `Wg` at the replicas' average with `D = 0` (`SyncAlgorithm.sync`), so the
block momentum starts from the first synchronized block, not from the unsynchronized warm-up.

The last round (every rank raised its stop flag: training has ended everywhere) takes the average
and no outer step: `Wg = t = a`, D kept. An outer step there would move the model after its last training
step, by the momentum alone when the block is empty (a foreground job whose last step just
synced), and the replicas would not end at the model they trained; torch's PeriodicModelAverager
and torchft's DiLoCo likewise do nothing at exit.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from sync_algos.base import RoundResult, SyncAlgorithm
from sync_algos.registry import register


@dataclasses.dataclass
class BMUFConfig:
    """Knobs of block momentum."""

    block_lr: float = 1.0
    """zeta, the block learning rate applied to the averaged block update G; > 0."""
    block_momentum: float | None = None
    """eta, the block momentum in [0, 1); None derives the paper's default `1 - 1/n`."""
    nesterov: bool = True
    """Nesterov-style target `Wg + eta*D` (True) or classic `Wg` (False)."""

    def __post_init__(self) -> None:
        if self.block_lr <= 0.0:
            raise ValueError(f"block_lr must be > 0, got {self.block_lr}")
        if self.block_momentum is not None and not 0.0 <= self.block_momentum < 1.0:
            raise ValueError(f"block_momentum must be in [0, 1) or null, got {self.block_momentum}")


@register
class BlockMomentum(SyncAlgorithm):
    """BMUF: global model `global_model` (Wg) and block momentum `momentum` (D), identical on all ranks."""

    name = "bmuf"
    Config = BMUFConfig
    state_names = ("global_model", "momentum")

    def __init__(self, config: BMUFConfig, group: dist.ProcessGroup | None, initial: torch.Tensor,
                 compress: str = "none") -> None:
        super().__init__(config, group, initial, compress)
        self.fit_to_group()
        self.zeta = config.block_lr
        self.global_model = initial.clone()
        self.momentum = torch.zeros_like(initial)

    def round(self, snapshot: torch.Tensor, stop: bool) -> RoundResult:
        # The average, then the block update, then the target, each in the all-reduce's payload in
        # place of the one before (no buffer of their own): G = a - start, start = Wg + eta*D.
        average, reduced = self.average(snapshot, stop)
        if average is None:  # no finite snapshot this round: the block update waits for the next
            return self.result(snapshot, reduced)
        if reduced.last:  # training has ended everywhere: the replicas meet at their average, no outer step
            with self.state_guard:
                self.global_model.copy_(average)
            return self.result(snapshot, reduced, average)
        block_update = average.sub_(self.global_model)
        if self.config.nesterov:
            block_update.sub_(self.momentum, alpha=self.eta)
        with self.state_guard:
            self.momentum.mul_(self.eta).add_(block_update, alpha=self.zeta)
            self.global_model += self.momentum
        return self.result(snapshot, reduced, self._block_start(out=block_update))

    def fit_to_group(self) -> None:
        momentum = self.config.block_momentum
        self.eta = momentum if momentum is not None else 1.0 - 1.0 / self.world_size

    def start_at(self, consensus: torch.Tensor) -> None:
        self.global_model.copy_(consensus)
        self.momentum.zero_()

    def _block_start(self, out: torch.Tensor) -> torch.Tensor:
        """Where the replicas start the next block, the round's target (`Wg + eta*D`, or `Wg`), into `out`."""
        if self.config.nesterov:
            return torch.mul(self.momentum, self.eta, out=out).add_(self.global_model)
        return out.copy_(self.global_model)
