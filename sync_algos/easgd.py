"""Elastic averaging SGD (Zhang, Choromanska, LeCun 2015) with the centre replicated on every trainer.

Per round on trainer i: `d_i = alpha * (s_i - c)`, the replica moves `w_i <- w_i - d_i`, and the
centre moves by the sum of all pulls, `c <- c + allreduce(d)`. The sum of the replicas plus the
centre is therefore conserved by a round. The centre starts at the replicas' average in the first
round (`SyncAlgorithm.sync`) and stays identical on every rank because it only ever changes by the
same all-reduced amount. A pull holding NaN / Inf is left out of the sum, so the centre only ever takes finite pulls, and
its rank is offered the centre in place of its weights (`sync_algos.base`). The variant whose centre is not replicated but exchanged with by each
trainer alone (ShadowSync's S-EASGD, the centre on the parameter servers) is `easgd_ps`; both
compute the pull with `elastic_pull`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from sync_algos.base import RoundResult, SyncAlgorithm
from sync_algos.registry import register


@dataclasses.dataclass
class EASGDConfig:
    """Knobs of elastic averaging."""

    beta: float = 0.9
    """Total elasticity; the per-trainer coefficient is `alpha = beta / n` unless `alpha` is set."""
    alpha: float | None = None
    """Elastic coefficient per trainer, in (0, 1]; None derives it as `beta / n`."""

    def __post_init__(self) -> None:
        if not 0.0 < self.beta <= 1.0:
            raise ValueError(f"beta must be in (0, 1], got {self.beta}")
        if self.alpha is not None and not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1] or null, got {self.alpha}")


def elastic_pull(snapshot: torch.Tensor, centre: torch.Tensor, alpha: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """EASGD's elastic update, the one place it is written: the pull `d = alpha * (s - c)`, into
    `out` when given (a buffer reused every round instead of two dense-sized temporaries).

    The replica moves to `s - d` and the centre by `+d`, so the exchange conserves their sum. A
    centre that replicas exchange with one at a time (S-EASGD) adds each `d` as it comes; the
    replicated centre adds all of a round's pulls at once (their all-reduced sum).
    """
    return torch.sub(snapshot, centre, out=out).mul_(alpha)


@register
class ElasticAveraging(SyncAlgorithm):
    """EASGD with a replicated centre `c`, updated by all-reduce."""

    name = "easgd"
    Config = EASGDConfig
    state_names = ("center",)
    averages_snapshots = False  # its pulls are differences already; the consensus start runs exact

    def __init__(self, config: EASGDConfig, group: dist.ProcessGroup | None, initial: torch.Tensor,
                 compress: str = "none") -> None:
        super().__init__(config, group, initial, compress)
        self.fit_to_group()
        self.center = initial.clone()

    def fit_to_group(self) -> None:
        self.alpha = self.config.alpha if self.config.alpha is not None else self.config.beta / self.world_size

    def round(self, snapshot: torch.Tensor, stop: bool) -> RoundResult:
        # The pull is computed where it is all-reduced, and the delta t - s = -d is taken from it
        # before the collective overwrites it with the sum of the pulls: no buffer of its own.
        pull = elastic_pull(snapshot, self.center, self.alpha, out=self.allreduce.payload)
        torch.neg(pull, out=snapshot)
        reduced = self.allreduce.sum(pull, stop)
        with self.state_guard:
            self.center += reduced.total  # the finite pulls only (a NaN / Inf pull was sent as zeros)
        return self.result(snapshot, reduced, consensus=self.center)

    def start_at(self, consensus: torch.Tensor) -> None:
        self.center.copy_(consensus)
