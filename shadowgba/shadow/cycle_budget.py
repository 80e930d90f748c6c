"""How many table fragments a 2D job's shadow rounds average after a dense round (`CycleBudget`): enough
for the cycle under way to end within a bound in steps, within a byte budget per link.

A table cycle (`shadowgba.shadow.tables`: every row, or every row some partner touched since the
last cycle) used to take one fragment per dense round, so its length in steps was its fragments
times the dense rounds' spacing: at the production preset's tables, no cycle under Zipf 1.05 ids
finished within a slow replica group's 175 steps. Now, after each dense round, the table rounds take

    k = ceil(left / rounds_left),   rounds_left = max(1, (cycle_steps - steps_so_far) / steps_per_round)

fragments, the dense rounds' pace being the steps of the fastest rank since the last one: the
cycle's rest spread over the dense rounds left before its deadline. The byte budget caps k: each
step of the fastest rank credits `link_mb_per_step` MiB to this rank's replica-group link (at most
`cycle_steps` steps' worth), each fragment spends its size, and a round takes at least one fragment
(a cycle always moves on). Every input is the same on every partner (the fragment count left, the
fastest rank's steps, which the dense round's trailer carries, the config), so the partners'
table collectives pair up.

The bound: a cycle that moves B MiB ends within max(cycle_steps, B / link_mb_per_step) steps of the
fastest rank after it started, plus one dense round's spacing (at most `sync.max_gap_steps`), as
long as the link carries the budget in that time. With touched rows, B is the rows touched in the
cycle before (at most a full cycle plus the masks).
"""

from __future__ import annotations

import math


class CycleBudget:
    """The fragment count of each table round group; `fragment_numel`: one fragment's values (4 bytes
    each). `cycle_steps` 0: one fragment after each dense round."""

    def __init__(self, cycle_steps: int, link_mb_per_step: float, fragment_numel: int) -> None:
        self.cycle_steps = cycle_steps
        self.budget_per_step = link_mb_per_step * 2**20 / 4 / fragment_numel
        """Fragments' worth of budget a step of the fastest rank credits."""
        self.credit = 0.0
        """Fragments' worth of budget not spent yet (negative: a round that took one on credit)."""
        self.steps = 0
        """Steps of the fastest rank since the cycle under way started."""
        self.last_cycle_steps: int | None = None
        """The last cycle finished while training: its length in steps of the fastest rank."""
        self.longest_cycle_steps = 0

    def fragments_now(self, steps: int, left: int, started: bool = False) -> int:
        """A dense round ended, `steps` steps of the fastest rank after the one before, with `left`
        fragments of the cycle still to average (`started`: a cycle that starts now): how many to
        average now (0 when none are left)."""
        self.steps = 0 if started else self.steps + steps
        if left <= 0:
            return 0
        if not self.cycle_steps:
            count = 1
        else:
            self.credit = min(self.credit + steps * self.budget_per_step, self.cycle_steps * self.budget_per_step)
            rounds_left = max(1.0, (self.cycle_steps - self.steps) / max(steps, 1))  # at the last spacing
            count = max(1, min(math.ceil(left / rounds_left), math.floor(self.credit)))
            self.credit -= min(count, left)
        count = min(count, left)
        if count == left:
            self.last_cycle_steps = self.steps
            self.longest_cycle_steps = max(self.longest_cycle_steps, self.steps)
        return count
