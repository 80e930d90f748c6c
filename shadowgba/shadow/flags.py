"""What a round's flags mean (`RoundFlags`): the verdict every rank reaches alike on the NaN / Inf and
aborted ranks a collective of the shadow rounds reported (`sync_algos.base` carries the flags).

Invariants:
- The flags are the same on every rank of the collective, and the verdict depends on them and on
  the config alone, so every rank ends the rounds, or goes on, alike.
- An aborted peer is named by rank, never blamed: it may have left because of another failure
  (`shadowgba.job.blame` decides the cause). Where replica groups survive a lost one, the verdict
  is `PeersAborted`, which `shadowgba.shadow.epoch_rounds` turns into the job's decision.
"""

from __future__ import annotations

import logging
from typing import Sequence

from shadowgba.errors import PeerLost, SyncError
from shadowgba.metrics import SyncMetrics
from shadowgba.nonfinite import nonfinite_failure

logger = logging.getLogger("shadowgba")


class PeersAborted(SyncError):
    """A round's flags named aborted peers (`ranks`, global), where the rounds may survive them."""

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class RoundFlags:
    """One trainer's verdicts on its rounds' flags. `on_nonfinite`: `sync.on_nonfinite`; `surviving`:
    replica groups survive a lost one (`sync.on_group_lost: continue`); `metrics`: where skipped
    NaN / Inf rounds are counted."""

    def __init__(self, on_nonfinite: str, surviving: bool, metrics: SyncMetrics) -> None:
        self.on_nonfinite = on_nonfinite
        self.surviving = surviving
        self.metrics = metrics
        self._nonfinite_seen: tuple[int, ...] = ()
        """The last verdict's NaN / Inf ranks: a warning is logged once per change."""

    def verdict(self, nonfinite: Sequence[int], aborted: Sequence[int], where: str) -> BaseException | None:
        """The failure that ends the rounds (a peer that aborted; NaN / Inf under `on_nonfinite: fail`),
        or None: NaN / Inf under `skip` is counted and warned about. Raises `PeersAborted` where the
        groups survive an aborted peer."""
        if aborted:
            message = (f"rank {', '.join(map(str, aborted))} aborted: its training loop raised (see that rank's log); "
                       f"{where} left it out")
            if self.surviving:
                raise PeersAborted(message, aborted)
            # names no culprit: the aborted rank may have left because of another one (`shadowgba.job.blame`)
            return PeerLost(f"{message} and this rank's rounds ended with it")
        failure = nonfinite_failure(self.on_nonfinite, f"rank {', '.join(map(str, nonfinite))} sent NaN / Inf "
                                    f"weights to {where}; they were left out, so no other replica took them")
        if nonfinite and failure is not None:
            return SyncError(failure, ranks=nonfinite)
        if nonfinite:
            self.metrics.record_nonfinite_skip()
            if tuple(nonfinite) != self._nonfinite_seen:
                logger.warning("shadowgba: %s left out rank %s: its weights hold NaN / Inf (sync.on_nonfinite: skip); "
                               "it keeps its own weights and no other replica takes them", where,
                               ", ".join(map(str, nonfinite)))
        self._nonfinite_seen = tuple(nonfinite)
        return None
