"""A rank's heartbeat on the job's notice board: how a peer tells a rank killed or stuck (it posts
nothing) from one that is alive.

Invariants:
- A rank in the job beats every `BEAT_INTERVAL_S` from a thread of its own, so a training step or a
  collective that holds the rank's other threads does not silence it.
- A rank that leaves normally marks its beat `HEARTBEAT_LEFT` (`Heartbeat.stop`): its silence then
  names no failure (`NoticeBoard.silent_peers` skips it). Only a rank gone without a word is silent.
"""

from __future__ import annotations

import itertools
import threading

from shadowgba.job.notices import BEAT_INTERVAL_S, HEARTBEAT_LEFT, NOTICE_TIMEOUT_S, NoticeBoard


class Heartbeat:
    """A rank's heartbeat on a `NoticeBoard`: a counter that a thread of its own advances every
    `BEAT_INTERVAL_S` while the rank is in the job, marked as left when it leaves normally."""

    def __init__(self, board: NoticeBoard, rank: int) -> None:
        self._board = board
        self._rank = rank
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="shadowgba-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        """Start beating (returns self)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and mark this rank as left: from then on its silence names no failure. Waits
        at most about `NOTICE_TIMEOUT_S` for a beat in flight."""
        self._ended.set()
        self._thread.join(NOTICE_TIMEOUT_S + BEAT_INTERVAL_S)
        self._board.beat(self._rank, HEARTBEAT_LEFT)

    def _beat(self) -> None:
        for count in itertools.count():
            self._board.beat(self._rank, str(count))
            if self._ended.wait(BEAT_INTERVAL_S):
                return
