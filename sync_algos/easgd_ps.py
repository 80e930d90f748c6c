"""EASGD with its centre held elsewhere, exchanged with by each trainer alone (ShadowSync's S-EASGD).

Same maths as `easgd` (`d = alpha * (s - c)`, `t = s - d`, `c <- c + d`, `elastic_pull`), but the
centre is not replicated: it sits behind the `Centre` interface (in shadowgba, on the parameter
servers), and each trainer exchanges with it on its own. A round has no collective, so a slow
trainer slows nobody and the stop flag needs no agreement (each trainer simply leaves its own loop).
A snapshot holding NaN / Inf is not sent to the centre: the round reports the trainer in
`nonfinite_ranks` (only to itself: there is no collective to tell the others, and no other
trainer's weights were at risk) and offers it the centre, read without moving it, in place of its
weights (`RoundResult.healed`, as in the collective algorithms). The algorithm is built with its centre as a resource: `build_algorithm("easgd_ps", ..., centre=...)`.

A trainer starts where the centre is (`Centre.init` returns it): at the start of a job that is the
initial weights every trainer holds; a trainer that joins a job already running (a restarted
process in a job whose trainers come and go) starts from the job's consensus, not from its own
initial weights. Without a process group (`group` None where torch.distributed is not initialised)
the algorithm runs on this trainer alone: `trainers` then says how many share the centre.
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
    def init(self, initial: torch.Tensor) -> torch.Tensor:
        """Start the centre at `initial`, this trainer's flat dense weights at its start, unless it
        has started already (the calls after the first one change nothing); return the centre as it
        is then: where this trainer starts."""

    @abc.abstractmethod
    def exchange(self, snapshot: torch.Tensor, alpha: float) -> torch.Tensor:
        """One elastic exchange with snapshot `s`: move the centre by `d = alpha * (s - c)` and return `d`."""

    @abc.abstractmethod
    def read(self) -> torch.Tensor:
        """The centre as it is, unmoved: what a trainer whose own weights diverged starts again from."""


@register
class ElasticAveragingPS(SyncAlgorithm):
    """S-EASGD: each trainer's elastic exchanges with a shared `Centre`."""

    name = "easgd_ps"
    Config = EASGDConfig
    uses_collectives: ClassVar[bool] = False

    def __init__(
        self, config: EASGDConfig, group: dist.ProcessGroup | None, initial: torch.Tensor, centre: Centre,
        trainers: int | None = None,
    ) -> None:
        """`group` is the trainers' group; `centre` the shared centre; `trainers` how many trainers
        share it (`alpha = beta / trainers`; default the group's size). `initial` is overwritten
        with the centre: where this trainer starts."""
        super().__init__(config, group, initial)
        trainers = self.world_size if trainers is None else trainers
        if trainers < 1:
            raise ValueError(f"trainers must be >= 1, got {trainers}")
        self.alpha = config.alpha if config.alpha is not None else config.beta / trainers
        self.centre = centre
        initial.copy_(self.centre.init(initial))

    def round(self, snapshot: torch.Tensor, stop: bool) -> RoundResult:
        if not is_finite(snapshot):  # never sent: the shared centre would pass it to every trainer
            centre = self.centre.read()
            snapshot.copy_(centre)
            return RoundResult(stop, centre.numel() * centre.element_size(), nonfinite_ranks=(self.rank,),
                               kept_local=True, last=stop, fastest_steps=self.allreduce.steps, healed=True,
                               previous_cost_ms=self.allreduce.previous_ms)
        pull = self.centre.exchange(snapshot, self.alpha)
        torch.neg(pull, out=snapshot)  # the delta t - s = -d
        return RoundResult(stop, 2 * pull.numel() * pull.element_size(), last=stop, fastest_steps=self.allreduce.steps,
                           previous_cost_ms=self.allreduce.previous_ms)
