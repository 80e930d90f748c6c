"""EASGD with its centre on the parameter server (ShadowSync's S-EASGD).

Same maths as `easgd` (`d = alpha * (s - c)`, `t = s - d`, `c <- c + d`), but the centre lives on
the PS ranks (`shadowgba.ps.easgd_center`) and each trainer exchanges with it on its own: a round
has no collective, so a slow trainer slows nobody and the stop flag needs no agreement (each
trainer simply leaves its own loop). Needs the PS transport started (`shadowgba.ps.transport`) and
every server rank serving an `ElasticCenter`.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
import torch.distributed as dist

from sync_algos.base import RoundResult, SyncAlgorithm
from sync_algos.easgd import EASGDConfig
from sync_algos.registry import register


@register
class ElasticAveragingPS(SyncAlgorithm):
    """S-EASGD: elastic exchanges with a sharded centre on the parameter servers."""

    name = "easgd_ps"
    Config = EASGDConfig
    uses_collectives: ClassVar[bool] = False

    def __init__(self, config: EASGDConfig, group: dist.ProcessGroup | None, initial: torch.Tensor) -> None:
        super().__init__(config, group, initial)
        from shadowgba.flat_optimizer import shard_bounds  # shadowgba imports sync_algos: not at module load
        from shadowgba.ps import transport
        from shadowgba.ps.easgd_center import CENTER_SERVICE

        self._transport, self._service = transport, CENTER_SERVICE
        self.alpha = config.alpha if config.alpha is not None else config.beta / self.world_size
        self.bounds = shard_bounds(initial.numel(), transport.roles().num_servers)
        self._exchange("init", lambda start, end: (start, end, initial[start:end].clone()))

    def round(self, snapshot: torch.Tensor, stop: bool) -> RoundResult:
        pulls = self._exchange("pull", lambda start, end: (start, end, snapshot[start:end].clone(), self.alpha))
        pull = torch.cat(pulls)
        return RoundResult(snapshot - pull, stop, 2 * pull.numel() * pull.element_size())

    def _exchange(self, method: str, args_for_slice: Callable[[int, int], tuple[Any, ...]]) -> list[Any]:
        """Call `method` on every centre slice in parallel; results in slice order."""
        futures = [
            self._transport.call_async(index, self._service, method, *args_for_slice(start, end))
            for index, (start, end) in enumerate(self.bounds)
        ]
        return torch.futures.wait_all(futures)
