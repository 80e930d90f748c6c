"""When the shadow rounds run, and at what priority (`RoundSchedule`, held by `ShadowSync`).

It puts together the pause's arithmetic (`shadowgba.shadow.pacing`), the measure of what a round
costs the training threads (`shadowgba.shadow.round_cost`, from `shadowgba.cpu_time`'s readings)
and the rounds' priority (`shadowgba.shadow.priority`), across the two threads that see them:

- The shadow thread, around each round: notes its span and CPU, feeds the cost to the pacer, and
  pauses until the pacer's time, or until the training thread says a round is due.
- The training thread, after each step: stamps its end (the steps' slowdown is measured from those
  stamps) and enforces the floor on the round rate in its own steps, with one integer comparison
  per step while nothing is due. Half the floor (`sync.max_gap_steps`) after a round started, a
  round still in flight gets the training threads' priority back (it is starved, or the cores are
  shared with other work); one step before the floor, a paused shadow thread is woken at that
  priority too, so the next round's snapshot is taken at the floor's step at the latest (unless
  `interval_ms` or `interval_steps`, the user's, ask for a later one), and the round the floor
  started is not starved in turn (at niceness 19 beside other busy processes its wake-up, its
  snapshot and half of it would each wait behind them).
- The sync gap: when this rank went more than `sync.warn_gap_steps` steps without a round reaching
  its dense weights, a warning names what held the rounds back, once until a round arrives again.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from shadowgba.config import SyncConfig
from shadowgba.cpu_time import idle_cpu_s, thread_cpu_s
from shadowgba.metrics import SyncMetrics
from shadowgba.shadow.control import LiveSettings
from shadowgba.shadow.pacing import RoundPacer
from shadowgba.shadow.priority import RoundPriority
from shadowgba.shadow.round_cost import RoundCost

logger = logging.getLogger("shadowgba")

NEVER = math.inf
"""A step that never comes: nothing due."""


class RoundSchedule:
    """One trainer's shadow-round schedule (module docstring); `name` names the rank in warnings."""

    def __init__(self, config: SyncConfig, metrics: SyncMetrics, name: str) -> None:
        self.pacer = RoundPacer(config.interval_ms, config.interval_steps, config.max_round_share,
                                config.max_step_cost, config.max_gap_steps)
        self.cost = RoundCost()
        self.priority = RoundPriority(config.rounds_nice)
        self.metrics = metrics
        self.name = name
        self.warn_gap_steps = config.warn_gap_steps
        self._due = threading.Event()
        self._steps_lock = threading.Lock()
        """Guards the steps things fall due at (`_restore_at`, `_due_at`, `_warn_at`, `_next_check`):
        both threads set them, and a write from one must not be lost to the other's `_next_check`."""
        self._threads: set[int] = set()
        self._in_round = False
        self._late = False
        """The round in flight (or the last one) had to get its priority back, or the floor starts the
        next one: the next runs at the training threads' priority."""
        self._round_step = 0
        self._restore_at: float = NEVER
        self._due_at: float = NEVER
        self._applied_step = 0
        self._gap_from = config.first_round_after
        """The step the sync gap counts from: the last round applied's, or the first round's before one."""
        self._warn_at: float = NEVER
        self._next_check: float = NEVER
        self._arm_warning()
        self._span_start = 0.0
        self._cpu_start = 0.0
        self._idle_start = 0.0

    # ------------------------------------------------------------------------------ shadow thread
    def start(self, group_threads: set[int]) -> None:
        """The shadow thread's first act: its rounds run on it and on `group_threads`."""
        self._threads = {threading.get_native_id(), *group_threads}
        self.priority.start(self._threads)

    def round_begins(self) -> None:
        """A round is about to ask for its snapshot."""
        self._due.clear()
        if not self._late:
            self.priority.lower()
        self._late = False
        self._in_round = True
        self._span_start = time.perf_counter()
        self._cpu_start, self._idle_start = thread_cpu_s(self._threads), idle_cpu_s()

    def snapshot_taken(self, step: int) -> int:
        """The round's snapshot was taken at training step `step`: the steps this rank took since its
        previous round (for the round's trailer). The floor's steps count from here."""
        self._round_step = step
        floor = self.pacer.max_gap_steps
        if floor:
            with self._steps_lock:
                self._restore_at = step + max(1, floor // 2)
                self._due_at = step + max(1, floor - 1)
                self._update_next_check()
        return self.pacer.round_started(step)

    def round_finished(self) -> None:
        """The round (its table fragments included) is done: what it cost goes to the pacer and the metrics."""
        end = time.perf_counter()
        cpu_s = thread_cpu_s(self._threads) - self._cpu_start
        cost_s = self.cost.round_ran(self._span_start, end, cpu_s, idle_cpu_s() - self._idle_start)
        self.pacer.cost_measured(cost_s)
        self.metrics.record_round_cost(cost_s, cpu_s)
        self._in_round = False
        with self._steps_lock:
            self._restore_at = NEVER
            self._update_next_check()

    def wait(self, stopping: threading.Event) -> None:
        """Pause until the next round is due (the pacer's time, the floor's step, or a stop), then
        begin it (`round_begins`)."""
        pause = self.pacer.pause_s()
        if pause > 0 and not stopping.is_set():
            self._due.wait(pause)
        least = self.pacer.least_pause_s()  # woken by the floor: interval_ms and interval_steps still stand
        if least > 0 and not stopping.is_set():
            stopping.wait(least)
        self.round_begins()

    def wake(self) -> None:
        """End a pause now (a stop was requested)."""
        self._due.set()

    # ---------------------------------------------------------------------------- training thread
    def step_ended(self, step: int) -> None:
        """A training step ended: stamp it and enforce what falls due at step `step`."""
        self.cost.step_ended(time.perf_counter())
        if step >= self._next_check:
            with self._steps_lock:
                self._check(step)

    def applied(self, step: int) -> None:
        """A round's result reached the dense weights at step `step`."""
        self._applied_step = self._gap_from = step
        self._arm_warning()

    def _check(self, step: int) -> None:
        """Act on what fell due by step `step`: a late round's priority, the floor's wake-up, the gap
        warning (under `_steps_lock`)."""
        if step >= self._restore_at and self._in_round:
            self._late = True
            self.priority.restore()
            self._restore_at = NEVER
        if step >= self._due_at:
            if not self._in_round:  # the floor starts the next round: it runs as a late one
                self._late = True
                self.priority.restore()
            self._due.set()
            self._due_at = NEVER
        if step >= self._warn_at:
            self._warn_at = NEVER
            self._warn(step)
        self._update_next_check()

    def _arm_warning(self) -> None:
        """The gap warning falls due `warn_gap_steps` steps past the last round applied (or the first
        round's step); 0: never."""
        with self._steps_lock:
            self._warn_at = self._gap_from + self.warn_gap_steps + 1 if self.warn_gap_steps else NEVER
            self._update_next_check()

    def _update_next_check(self) -> None:
        self._next_check = min(self._restore_at, self._due_at, self._warn_at)

    def _warn(self, step: int) -> None:
        pacer = self.pacer
        held = (f"a round in flight for {step - self._round_step} steps" if self._in_round
                else f"the pacing's {pacer.limit} limit")
        summary = self.metrics.summary()
        logger.warning(
            "shadowgba: %s: no round reached the dense weights for %d steps (over sync.warn_gap_steps: %d), held back by "
            "%s; the replicas drift apart meanwhile. Rounds per step %.3f, a round costs the training threads "
            "%.1f ms and takes %.1f ms (sync.max_step_cost %g, max_round_share %g, max_gap_steps %d, "
            "interval_ms %g)",
            self.name, step - self._applied_step, self.warn_gap_steps, held, summary["rounds_per_step"],
            summary["round_cost_ms_mean"], summary["round_latency_ms_mean"], pacer.max_step_cost,
            pacer.max_round_share, pacer.max_gap_steps, pacer.interval_s * 1e3)

    # ------------------------------------------------------------------------------ live settings
    def apply_live(self, settings: LiveSettings) -> None:
        """The pacing's part of live settings (a control file, `set_interval_ms`); unset fields stay.
        A new floor counts from the next round's snapshot; a new gap warning from the last round that
        reached the dense weights."""
        pacer = self.pacer
        if settings.interval_ms is not None:
            pacer.interval_s = settings.interval_ms / 1e3
        for name in ("interval_steps", "max_round_share", "max_step_cost", "max_gap_steps"):
            if (value := getattr(settings, name)) is not None:
                setattr(pacer, name, value)
        if settings.warn_gap_steps is not None:
            self.warn_gap_steps = settings.warn_gap_steps
            self._arm_warning()
