"""How many table fragments a 2D job's shadow rounds average after a dense round (`CycleBudget`): enough
for the cycle under way to end within a bound in steps, within a byte budget per link, and never so
many that the dense rounds behind them come late.

A table cycle (`shadowgba.shadow.tables`: every row, or every row some partner touched since the
last cycle) used to take one fragment per dense round, so its length in steps was its fragments
times the dense rounds' spacing: at the production preset's tables, no cycle under Zipf 1.05 ids
finished within a slow replica group's 175 steps. Now, after each dense round, the table rounds take

    k = ceil(left / rounds_left),   rounds_left = max(1, (cycle_steps - steps_so_far) / steps_per_round)

fragments, the dense rounds' pace being the steps of the fastest rank since the last one: the
cycle's rest spread over the dense rounds left before its deadline. The byte budget caps k: each
step of the fastest rank credits `link_mb_per_step` MiB to this rank's replica-group link (at most
`cycle_steps` steps' worth), each fragment averaged spends its size, and a round takes at least one
fragment (a cycle always moves on).

The dense rounds come first: the table rounds after a dense round stop once some partner has taken
`group_steps` steps since they began (half the most steps the config lets pass between two dense
rounds: the floor `sync.max_gap_steps`, or a user's rarer `interval_steps`; the other half is the
dense round's and its pause's), the rest of the cycle waiting for the next dense round. Without
it, where the cores or the link move a fragment slower than the budget assumes (4 ranks of a 2D job
on 2 shared cores), a late dense round credited many steps' budget, its many fragments made the
next dense round late again, and the dense rounds starved: one in 150 to 200 steps of the fastest
rank against a floor of 10.

They also stop before a fragment forecast to end past `group_steps`: the trailers' spacing within a
group measures the steps a fragment takes (`fragment_steps`), and the next would end about two of
those after the last one started. Checked after a fragment only, the steps alone let the group run
one fragment past them, which is a whole fragment's steps where a fragment is dear: under a 3x
straggler, a fragment waits for the slow partner's step boundary, 3.6 steps of the fast rank, so
the groups ran 3 fragments in 11 steps, against 5, and the fast group went 22 of its steps without
a dense round (docs/benchmarks.md). A measured cost forecasts `FORECAST_GROUPS` groups, then one
group stops by its steps alone and measures it again.

Every input is the same on every partner (the fragment count left, the fastest rank's steps, which
the dense round's trailer carries, the steps each partner took since the table rounds began, which
each fragment's trailer carries, the config), so the partners' table collectives pair up.

The bound each cycle is held to, stated when it starts: a cycle of n fragments (B MiB) ends within

    max(cycle_steps, B / link_mb_per_step, n / capacity) + spacing

steps of the fastest rank after it started.

- `capacity` is what the link and the cores were measured to move: the fragments per step of the
  fastest rank of the table round groups that stopped for the dense round behind them (they ran
  as many as the time allowed, not as many as were planned), over the dense round spacings they
  were part of, summed over the latest such groups that span the last cycle's length, at least
  `cycle_steps`. An average over as many steps as the cycle it forecasts: a window of a few groups
  moves between cycles by more than the spacing leaves as margin, and a link or cores that slow
  down are still seen within a cycle. The bound takes it `CAPACITY_ERRORS` (2) standard errors
  lower, from the groups' spread about it: the mean alone forecast a cycle's rest 10-15% short.
  The groups before the first stopped by a measured fragment cost (`forecast_from`: the job's
  first one or two) are left out: they hold the job's start-up.
- `spacing` is the widest dense round spacing among those groups and now (a cycle starts and ends
  at a dense round).
- Until such groups span `cycle_steps`, the capacity is not taken as measured and the bound is the
  config's (where no group ever stops, nothing has shown the budget too much for the link). If the
  cycle under way was stated so and the capacity is then measured, its bound is stated again from
  that dense round: the steps so far plus its rest at the measured capacity plus the spacing.

A fixed bound from the config alone cannot hold where the cores or the link move a fragment slower
than the budget assumes (4 ranks of a 2D job on 2 shared cores: docs/two_d.md), so the bound states
what the job's own link and cores allow, before the cycle runs (for the job's first, once they are
measured), and the metrics count the cycles that overran it (`over_bound`): a forecast that can be
missed. With touched rows, B is the rows touched in the cycle before (at most a full cycle plus the
masks).
"""

from __future__ import annotations

import collections
import math


class CycleBudget:
    """The fragment count of each table round group, and each cycle's bound; `fragment_numel`: one
    fragment's values (4 bytes each). `cycle_steps` 0: one fragment after each dense round, no bound
    stated. `group_steps` 0: table rounds that never stop early for the dense rounds behind them."""

    CAPACITY_ERRORS = 2.0
    """The bound takes the measured capacity this many standard errors lower (never below half of
    it): the groups' fragments and spacings vary (a fragment waits for the slow partner's step
    boundary, 0 to 3 steps of the fast rank), and a mean over the last cycle's groups forecast the
    next cycle's rest 10-15% short, more than the spacing the bound adds."""

    FORECAST_GROUPS = 8
    """How many groups a measured `fragment_steps` forecasts for. A group the forecast stops after
    its first fragment measures nothing (it takes two trailers), so the forecast would never see
    fragments grow cheaper (a straggler recovered); the first group past this age stops by its steps
    alone, and measures them again."""

    def __init__(self, cycle_steps: int, link_mb_per_step: float, fragment_numel: int, group_steps: int = 0) -> None:
        self.cycle_steps = cycle_steps
        self.budget_per_step = link_mb_per_step * 2**20 / 4 / fragment_numel
        """Fragments' worth of budget a step of the fastest rank credits."""
        self.group_steps = group_steps
        """The table rounds after a dense round stop once a partner has taken this many steps since
        they began; 0: no such stop."""
        self.credit = 0.0
        """Fragments' worth of budget not spent yet (negative: a round that took one on credit)."""
        self.steps = 0
        """Steps of the fastest rank since the cycle under way started."""
        self.capacity_window: collections.deque[tuple[int, int]] = collections.deque()
        """(fragments, the dense round spacing they were part of) of the latest groups that stopped
        early, spanning the last cycle's length (at least `cycle_steps`) once measured: the capacity
        is their ratio."""
        self.stopped_group: int | None = None
        """The fragments of the last group, if it stopped early (its spacing comes with the next dense round)."""
        self.groups = 0
        """Table round groups so far."""
        self.bound: int | None = None
        """The bound of the cycle under way, in steps of the fastest rank after its start (None: none stated)."""
        self.bound_measured = False
        """The bound under way includes the measured capacity."""
        self.last_cycle_steps: int | None = None
        """The last cycle finished while training: its length in steps of the fastest rank."""
        self.last_cycle_bound: int | None = None
        """The bound the last finished cycle was held to."""
        self.longest_cycle_steps = 0
        self.timed_cycles = 0
        """Cycles finished while training, each against its bound."""
        self.over_bound = 0
        """Cycles that ran longer than their bound."""
        self.overrun_max = 0
        """The most steps a cycle ran past its bound."""
        self.stopped_early = 0
        """Table round groups that stopped for the dense round behind them (`stop`) with fragments
        still planned."""
        self.fragment_steps: float | None = None
        """Steps of the fastest partner a fragment took, as the latest group that averaged two or
        more measured it (the spacing of their trailers); None: not measured yet."""
        self.fragment_steps_group = 0
        """The group that measured `fragment_steps` (`groups` then)."""
        self.forecast_from: int | None = None
        """The first group stopped by a measured `fragment_steps` (None: none measured yet). The
        groups before it do not measure the capacity: they hold the job's start-up (the first masks,
        replica groups still warming up at their own paces), and they stop by the steps alone,
        running a fragment more than the forecast lets the later groups run."""

    @property
    def capacity(self) -> float | None:
        """Fragments per step of the fastest rank the link and cores moved when the time, not the
        budget, limited them (None: not measured over `cycle_steps` steps yet)."""
        measured = self._measured()
        return measured[0] / measured[1] if measured else None

    def _window(self) -> tuple[int, int]:
        """The capacity window's fragments and steps."""
        return sum(count for count, _ in self.capacity_window), sum(spacing for _, spacing in self.capacity_window)

    def _measured(self) -> tuple[int, int] | None:
        """The capacity window's fragments and steps once they measure it (they span `cycle_steps`)."""
        done, span = self._window()
        return (done, span) if done and span >= max(self.cycle_steps, 1) else None

    def _rest_steps(self, left: int) -> int | None:
        """Steps of the fastest rank `left` fragments take at the capacity the window measured, less
        `CAPACITY_ERRORS` standard errors (None: not measured yet). The ratio's standard error, from
        the groups' spread about it: sqrt(sum((f - c * s)^2) / (n - 1) / n) / mean(s), for n groups
        of f fragments in s steps at the capacity c."""
        measured = self._measured()
        if measured is None:
            return None
        done, span = measured
        capacity, groups = done / span, len(self.capacity_window)
        if groups > 1:
            spread = sum((count - capacity * spacing) ** 2 for count, spacing in self.capacity_window) / (groups - 1)
            capacity = max(capacity - self.CAPACITY_ERRORS * math.sqrt(spread / groups) / (span / groups),
                           capacity / 2)
        return math.ceil(left / capacity)

    def fragments_now(self, steps: int, left: int, started: bool = False) -> int:
        """A dense round ended, `steps` steps of the fastest rank after the one before, with `left`
        fragments of the cycle still to average (`started`: a cycle that starts now): how many to
        average now (0 when none are left). `averaged` says how many were."""
        if self.stopped_group is not None:
            self.capacity_window.append((self.stopped_group, steps))
            span = max(self.cycle_steps, self.last_cycle_steps or 0)  # as long as the cycles it forecasts
            while self._window()[1] - self.capacity_window[0][1] >= span:
                self.capacity_window.popleft()
            self.stopped_group = None
        self.steps = 0 if started else self.steps + steps
        if left <= 0:
            return 0
        if not self.cycle_steps:
            return 1
        self._state_bound(left, started, steps)
        self.credit = min(self.credit + steps * self.budget_per_step, self.cycle_steps * self.budget_per_step)
        rounds_left = max(1.0, (self.cycle_steps - self.steps) / max(steps, 1))  # at the last spacing
        return min(left, max(1, min(math.ceil(left / rounds_left), math.floor(self.credit))))

    def _state_bound(self, left: int, started: bool, spacing: int) -> None:
        """State the bound of a cycle of `left` fragments that starts now (`started`), or state the
        one under way again from now once the capacity is measured; `spacing`: the dense round
        spacing that just ended (module docstring)."""
        if not started and (self.bound is None or self.bound_measured):
            return
        measured = self._rest_steps(left)
        if measured is not None:
            spacing = max(spacing, *(gap for _, gap in self.capacity_window))
        if started:
            self.bound = max(self.cycle_steps, math.ceil(left / self.budget_per_step), measured or 0) + spacing
            self.bound_measured = measured is not None
        elif measured is not None:
            self.bound = max(self.bound, self.steps + measured + spacing)
            self.bound_measured = True

    def stop(self, partner_steps: int, done: int) -> bool:
        """Whether the table rounds stop before their next fragment, `done` fragments averaged since
        they began, the last of which some partner started `partner_steps` steps after they began
        (its trailer: alike on every partner). They stop once those steps reach `group_steps`, or
        once the next fragment is forecast to end past them: the last one ends about
        `fragment_steps` after it started, the next as many later (module docstring)."""
        if not self.group_steps:
            return False
        if done >= 2:
            self.fragment_steps, self.fragment_steps_group = partner_steps / (done - 1), self.groups
            if self.forecast_from is None:
                self.forecast_from = self.groups + 1
        if partner_steps >= self.group_steps:
            return True
        trusted = self.fragment_steps is not None and self.groups - self.fragment_steps_group < self.FORECAST_GROUPS
        return trusted and partner_steps + 2 * self.fragment_steps > self.group_steps

    def averaged(self, count: int, left: int, planned: int) -> None:
        """The table rounds after a dense round averaged `count` of the `left` fragments the cycle
        had, `planned` (`fragments_now`) asked for: their budget is spent, a group that stopped early
        measures the capacity, and a cycle that ended is timed against its bound."""
        if self.cycle_steps:
            self.credit -= count
        if count < planned:
            self.stopped_early += 1
            measures = self.forecast_from is not None and self.groups >= self.forecast_from
            self.stopped_group = count if measures else None
        self.groups += 1
        if count == left:
            self.last_cycle_steps = self.steps
            self.longest_cycle_steps = max(self.longest_cycle_steps, self.steps)
            if self.bound is not None:
                self.timed_cycles += 1
                self.over_bound += self.steps > self.bound
                self.overrun_max = max(self.overrun_max, self.steps - self.bound)
                self.last_cycle_bound, self.bound = self.bound, None
