"""When the shadow thread starts its next round: the arithmetic of its pause.

Four limits, the latest one wins:
- `sync.interval_ms` after the last round started: the least time between two starts;
- with `sync.interval_steps: N`, once the fastest rank has taken about N training steps since then;
- `sync.max_round_share`: the rounds take at most that share of the wall time, so a round that took
  d seconds is followed by a pause that makes the start-to-start time at least d / share;
- `sync.max_step_cost`: the rounds cost the training threads at most that share of their time. A
  round that cost them c seconds (`shadowgba.shadow.round_cost`: their steps' slowdown while it was
  in flight, or the CPU it took from cores that had none idle) is followed by a pause that makes
  the start-to-start time at least c / share.

The floor on the round rate caps the two share limits, which the pacing sets by itself: a round
starts at most `sync.max_gap_steps` steps of the fastest rank after the last one started, however
dear the rounds are. Until two rounds have measured the fastest rank's pace the floor cannot be put
in time, and the share limits wait for it: the job's first round holds the ranks' start-up (a
replica group still importing, building its model), and its cost once paused a slow group's next
round for 7 s, 30 steps of the fast group without a dense round. `interval_ms` and
`interval_steps` are the user's, and stand: the floor never starts a round sooner than they ask.
Here the floor caps the pause in time; the training thread enforces it in steps too
(`shadowgba.shadow.schedule`), and raises a late round's priority.

The step limit makes the round rate follow the steps, as TorchRec's "sync every N batches" does,
whatever a step costs. The share limits make it follow what a round costs: the link's time (the
round's duration is long where the link is slow, and a step's embedding all-to-all crosses the same
link) and the training threads' time (on a CPU-bound host a round's copies and reduction come out of
the steps, however short the round is in wall time). So the rounds space out by themselves where
they are dear, and come as often as `interval_ms` lets them where they are nearly free.

Each round's collective carries every rank's step count since its previous round
(`sync_algos.base.FlaggedAllReduce.steps`), so every rank knows the fastest one's pace without a
collective of its own: its step time is the time between the last two round starts over the most
steps any rank took in between. A fast group is never slowed: nothing here waits for a step, and a
slow rank starts its rounds on the fast rank's pace, not its own.

A round's duration is counted without waiting: each rank's own time includes its wait for the ranks
that came to the collective later (their pacing, not the round's cost), so the rounds carry every
rank's time for its previous round and the least of them is used (`sync_algos.base`: the last rank
to come waited for nobody). Durations and costs are the medians of the last few rounds': one round
stalled by a passing hiccup does not pause the next many.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Callable


class RoundPacer:
    """Paces one shadow thread's rounds; read and written by that thread only (live settings are
    plain attribute writes, taken at the next pause). `clock`: monotonic seconds (a test's fake)."""

    RECENT_ROUNDS = 5
    """Rounds whose median duration and cost the share limits use."""

    def __init__(self, interval_ms: float, interval_steps: int, max_round_share: float = 1.0,
                 max_step_cost: float = 1.0, max_gap_steps: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_ms / 1e3
        """The least time between two round starts."""
        self.interval_steps = interval_steps
        """Steps of the fastest rank between two round starts; 0: time alone."""
        self.max_round_share = max_round_share
        """The most of the wall time rounds may take, in (0, 1]; 1: no limit beyond the others."""
        self.max_step_cost = max_step_cost
        """The most of the training threads' time rounds may cost, in (0, 1]; 1: no such limit."""
        self.max_gap_steps = max_gap_steps
        """The floor: the most steps of the fastest rank between two round starts; 0: none."""
        self._clock = clock
        self._durations: collections.deque[float] = collections.deque(maxlen=self.RECENT_ROUNDS)
        self._costs: collections.deque[float] = collections.deque(maxlen=self.RECENT_ROUNDS)
        self.own_last_s = 0.0
        """This rank's time for its last round, waiting included: what it sends with the next one."""
        self.fastest_step_s: float | None = None
        """The fastest rank's step time as of the last round; None until two rounds have run in
        which some rank stepped."""
        self.limit = "interval_ms"
        """Which limit set the last pause (interval_ms, interval_steps, max_round_share,
        max_step_cost, max_gap_steps): what the metrics' warning names."""
        self._started: float | None = None
        self._previous_start: float | None = None
        self._step_at_round = 0

    def round_started(self, step: int) -> int:
        """A round starts now, with this rank at training step `step`: the steps it took since its
        previous round, which the round's collective carries to every rank."""
        self._previous_start, self._started = self._started, self._clock()
        steps, self._step_at_round = step - self._step_at_round, step
        return steps

    def round_ended(self, fastest_steps: int, previous_cost_s: float = 0.0) -> None:
        """The round just run carried `fastest_steps`, the most steps any rank took since its
        previous round, and `previous_cost_s`, how long that previous round took without waiting
        (0: unknown): update the fastest rank's step time and the rounds' recent durations."""
        if self._started is not None:
            self.own_last_s = self._clock() - self._started
        if previous_cost_s > 0:
            self._durations.append(previous_cost_s)
        if fastest_steps > 0 and self._previous_start is not None and self._started is not None:
            self.fastest_step_s = (self._started - self._previous_start) / fastest_steps

    def cost_measured(self, cost_s: float) -> None:
        """What the last round cost the training threads, in seconds of their time."""
        self._costs.append(cost_s)

    def start_to_start_s(self) -> float:
        """The time from the last round's start to the next one's, as the limits and the floor set
        it (and `limit`, which of them did)."""
        limits = {"interval_ms": self.interval_s}
        if self.interval_steps and self.fastest_step_s is not None:
            limits["interval_steps"] = self.interval_steps * self.fastest_step_s
        floor_s = self.floor_s()
        if floor_s is None and self.max_gap_steps:  # a floor not yet in time: the share limits wait for it
            return self._set_limit(limits)
        if self.max_round_share < 1.0 and self._durations:
            limits["max_round_share"] = statistics.median(self._durations) / self.max_round_share
        if self.max_step_cost < 1.0 and self._costs:
            limits["max_step_cost"] = statistics.median(self._costs) / self.max_step_cost
        for name in ("max_round_share", "max_step_cost"):
            if floor_s is not None and limits.get(name, 0.0) > floor_s:
                del limits[name]
                limits["max_gap_steps"] = floor_s
        return self._set_limit(limits)

    def _set_limit(self, limits: dict[str, float]) -> float:
        """The latest of `limits` (by name), which becomes `limit`."""
        self.limit = max(limits, key=limits.__getitem__)
        return limits[self.limit]

    def floor_s(self) -> float | None:
        """The floor in time: `max_gap_steps` steps of the fastest rank (None: no floor, or no step time yet)."""
        return self.max_gap_steps * self.fastest_step_s if self.max_gap_steps and self.fastest_step_s else None

    def pause_s(self) -> float:
        """How long to wait, from now, before the next round starts."""
        return self._left(self.start_to_start_s())

    def least_pause_s(self) -> float:
        """How long to wait, from now, before the next round may start even when the floor asks for
        it: the set limits (`interval_ms`, `interval_steps`) stand."""
        least = self.interval_s
        if self.interval_steps and self.fastest_step_s is not None:
            least = max(least, self.interval_steps * self.fastest_step_s)
        return self._left(least)

    def _left(self, interval: float) -> float:
        if self._started is None:
            return interval
        return max(0.0, interval - (self._clock() - self._started))
