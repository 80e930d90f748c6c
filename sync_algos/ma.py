"""Model averaging (MA): every round replaces each replica's snapshot by the average of all snapshots
(of the finite ones: a snapshot holding NaN / Inf is left out, see `sync_algos.base`)."""

from __future__ import annotations

import dataclasses

import torch

from sync_algos.base import RoundResult, SyncAlgorithm
from sync_algos.registry import register


@dataclasses.dataclass
class MAConfig:
    """MA has no knobs: `t = allreduce(s) / n` (n: the ranks whose snapshot is finite)."""


@register
class ModelAveraging(SyncAlgorithm):
    """`t = allreduce(s) / n` (ShadowSync's S-MA when run in the shadow thread)."""

    name = "ma"
    Config = MAConfig

    def round(self, snapshot: torch.Tensor, stop: bool) -> RoundResult:
        return self.averaging_round(snapshot, stop)
