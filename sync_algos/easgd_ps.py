"""EASGD with its centre held elsewhere, exchanged with by each trainer alone (ShadowSync's S-EASGD).

Same maths as `easgd` (`d = alpha * (s - c)`, `t = s - d`, `c <- c + d`, `elastic_pull`), but the
centre is not replicated: it sits behind the `Centre` interface (in shadowgba, on the parameter
servers), and each trainer exchanges with it on its own. A round has no collective, so a slow
trainer slows nobody and the stop flag needs no agreement (each trainer simply leaves its own loop).
A snapshot holding NaN / Inf is not sent to the centre: the round keeps the trainer's own weights
and reports the trainer in `nonfinite_ranks` (only to itself: there is no collective to tell the
others, and no other trainer's weights were at risk). The algorithm is built with its centre as a resource: `build_algorithm("easgd_ps", ..., centre=...)`.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch
import torch.distributed as dist

from sync_algos.base import RoundResult, SyncAlgorithm, is_finite
from sync_algos.easgd import EASGDConfig
from sync_algos.registry import register


class Centre(abc.ABC):
    """S-EASGD's centre `c` as one trainer sees it: the whole flat vector, wherever it is stored.

    Shared by every trainer of the job; an implementation makes each `exchange` atomic with respect
    to the other trainers' (the centre must not move between computing `d` and adding it). The
    centre is the implementation's state, not the algorithm's (`state_dict()` here holds none): a
    checkpoint takes it from the implementation (shadowgba: `CenterClient`, a `Stateful`).
    """

    @abc.abstractmethod
    def init(self, initial: torch.Tensor) -> None:
        """Start the centre at `initial`, the flat dense weights that every trainer holds at start;
        every trainer calls it, and the calls after the first one change nothing."""

    @abc.abstractmethod
    def exchange(self, snapshot: torch.Tensor, alpha: float) -> torch.Tensor:
        """One elastic exchange with snapshot `s`: move the centre by `d = alpha * (s - c)` and return `d`."""


@register
class ElasticAveragingPS(SyncAlgorithm):
    """S-EASGD: each trainer's elastic exchanges with a shared `Centre`."""

    name = "easgd_ps"
    Config = EASGDConfig
    uses_collectives: ClassVar[bool] = False

    def __init__(
        self, config: EASGDConfig, group: dist.ProcessGroup | None, initial: torch.Tensor, centre: Centre
    ) -> None:
        """`group` is the trainers' group (its size sets `alpha = beta / n`); `centre` the shared centre."""
        super().__init__(config, group, initial)
        self.alpha = config.alpha if config.alpha is not None else config.beta / self.world_size
        self.centre = centre
        self.centre.init(initial)

    def round(self, snapshot: torch.Tensor, stop: bool) -> RoundResult:
        if not is_finite(snapshot):  # never sent: the shared centre would pass it to every trainer
            snapshot.zero_()
            return RoundResult(stop, 0, nonfinite_ranks=(self.rank,), kept_local=True, last=stop,
                               fastest_steps=self.allreduce.steps)
        pull = self.centre.exchange(snapshot, self.alpha)
        torch.neg(pull, out=snapshot)  # the delta t - s = -d
        return RoundResult(stop, 2 * pull.numel() * pull.element_size(), last=stop, fastest_steps=self.allreduce.steps)
