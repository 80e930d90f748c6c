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

Every input is the same on every partner (the fragment count left, the fastest rank's steps, which
the dense round's trailer carries, the steps each partner took since the table rounds began, which
each fragment's trailer carries, the config), so the partners' table collectives pair up.

The bound: a cycle that moves B MiB ends within max(cycle_steps, B / link_mb_per_step) steps of the
fastest rank after it started, plus one dense round's spacing (at most `sync.max_gap_steps`), as
long as the link and the cores move the budget within the table rounds' share of the steps (at
most `group_steps` after each dense round); where they cannot, the cycle stretches by that ratio
and the dense rounds keep their floor. With touched rows, B is the rows touched in the cycle before
(at most a full cycle plus the masks).
"""

from __future__ import annotations

import math


class CycleBudget:
    """The fragment count of each table round group; `fragment_numel`: one fragment's values (4 bytes
    each). `cycle_steps` 0: one fragment after each dense round. `group_steps` 0: table rounds
    that never stop early for the dense rounds behind them."""

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
        self.last_cycle_steps: int | None = None
        """The last cycle finished while training: its length in steps of the fastest rank."""
        self.longest_cycle_steps = 0
        self.stopped_early = 0
        """Table round groups that stopped at `group_steps` with fragments still planned."""

    def fragments_now(self, steps: int, left: int, started: bool = False) -> int:
        """A dense round ended, `steps` steps of the fastest rank after the one before, with `left`
        fragments of the cycle still to average (`started`: a cycle that starts now): how many to
        average now (0 when none are left). `averaged` says how many were."""
        self.steps = 0 if started else self.steps + steps
        if left <= 0:
            return 0
        if not self.cycle_steps:
            return 1
        self.credit = min(self.credit + steps * self.budget_per_step, self.cycle_steps * self.budget_per_step)
        rounds_left = max(1.0, (self.cycle_steps - self.steps) / max(steps, 1))  # at the last spacing
        return min(left, max(1, min(math.ceil(left / rounds_left), math.floor(self.credit))))

    def stop(self, partner_steps: int) -> bool:
        """Whether the table rounds stop before their next fragment, some partner having taken
        `partner_steps` steps since they began (the last fragment's trailer: alike on every partner)."""
        return 0 < self.group_steps <= partner_steps

    def averaged(self, count: int, left: int, planned: int) -> None:
        """The table rounds after a dense round averaged `count` of the `left` fragments the cycle
        had, `planned` (`fragments_now`) asked for: their budget is spent, and a cycle that ended
        is timed."""
        if self.cycle_steps:
            self.credit -= count
        self.stopped_early += count < planned
        if count == left:
            self.last_cycle_steps = self.steps
            self.longest_cycle_steps = max(self.longest_cycle_steps, self.steps)
