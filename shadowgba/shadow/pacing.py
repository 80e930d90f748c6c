"""When the shadow thread starts its next round.

Three limits, the latest one wins: `sync.interval_ms` after the last round started (a floor: on few
CPU cores an unpaced loop steals the trainers' CPU); with `sync.interval_steps: N`, once the
fastest rank has taken about N training steps since then; and `sync.max_round_share`: the rounds
take at most that share of the wall time, so a round that took d seconds is followed by a pause
that makes the start-to-start time at least d / share. The second makes the round rate follow
the steps, as TorchRec's "sync every N batches" does, whatever a step costs: a fixed time is many
steps of a fast model (replicas drift apart between rounds) and a fraction of a step of a slow one
(rounds that average nearly nothing new, for their CPU and bytes).

Each round's collective carries every rank's step count since its previous round
(`sync_algos.base.FlaggedAllReduce.steps`), so every rank knows the fastest one's pace without a
collective of its own: its step time is the time between the last two round starts over the most
steps any rank took in between. A fast group is never slowed: nothing here waits for a step, and a
slow rank starts its rounds on the fast rank's pace, not its own.

The share bounds what the rounds take of what they compete with the training steps for: the link,
which a step's embedding all-to-all crosses too, and the CPU cores, where a round's copies and the
collective's reduction and network work run. A round's duration measures both (it is long where
the link is slow or the cores are busy), so the rounds space out by themselves where they cost the
steps most, and come as often as the floor lets them on a fast link. The duration is the round's
cost without waiting: each rank's own time includes its wait for the ranks that came to the
collective later (their pacing, not the round's cost), so the rounds carry every rank's time for
its previous round and the least of them is used (`sync_algos.base`: the last rank to come waited
for nobody). Of those, the median of the last few rounds': one round stalled by a passing hiccup
does not pause the next many.
"""

from __future__ import annotations

import collections
import statistics
import time


class RoundPacer:
    """Paces one shadow thread's rounds; read and written by that thread only (live settings are
    plain attribute writes, taken at the next pause)."""

    RECENT_ROUNDS = 5
    """Rounds whose median duration the share limit uses."""

    def __init__(self, interval_ms: float, interval_steps: int, max_round_share: float = 1.0) -> None:
        self.interval_s = interval_ms / 1e3
        """The least time between two round starts."""
        self.interval_steps = interval_steps
        """Steps of the fastest rank between two round starts; 0: time alone."""
        self.max_round_share = max_round_share
        """The most of the wall time rounds may take, in (0, 1]; 1: no limit beyond the others."""
        self._durations: collections.deque[float] = collections.deque(maxlen=self.RECENT_ROUNDS)
        self.own_last_s = 0.0
        """This rank's time for its last round, waiting included: what it sends with the next one."""
        self.fastest_step_s: float | None = None
        """The fastest rank's step time as of the last round; None until two rounds have run in
        which some rank stepped."""
        self._started: float | None = None
        self._previous_start: float | None = None
        self._step_at_round = 0

    def round_started(self, step: int) -> int:
        """A round starts now, with this rank at training step `step`: the steps it took since its
        previous round, which the round's collective carries to every rank."""
        self._previous_start, self._started = self._started, time.monotonic()
        steps, self._step_at_round = step - self._step_at_round, step
        return steps

    def round_ended(self, fastest_steps: int, previous_cost_s: float = 0.0) -> None:
        """The round just run carried `fastest_steps`, the most steps any rank took since its
        previous round, and `previous_cost_s`, what that previous round cost (0: unknown): update
        the fastest rank's step time and the rounds' recent cost."""
        if self._started is not None:
            self.own_last_s = time.monotonic() - self._started
        if previous_cost_s > 0:
            self._durations.append(previous_cost_s)
        if fastest_steps > 0 and self._previous_start is not None and self._started is not None:
            self.fastest_step_s = (self._started - self._previous_start) / fastest_steps

    def pause_s(self) -> float:
        """How long to wait, from now, before the next round starts."""
        interval = self.interval_s
        if self.interval_steps and self.fastest_step_s is not None:
            interval = max(interval, self.interval_steps * self.fastest_step_s)
        if self.max_round_share < 1.0 and self._durations:
            interval = max(interval, statistics.median(self._durations) / self.max_round_share)
        if self._started is None:
            return interval
        return max(0.0, interval - (time.monotonic() - self._started))
