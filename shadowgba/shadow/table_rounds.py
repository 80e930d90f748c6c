"""The 2D layout's table rounds inside the shadow runtime's rounds (`TableRounds`, held by `ShadowSync`).

After each dense round, a 2D job averages fragments of its table shards with the same shards on
its replica group (`TableFragments`): a round-robin cycle over every fragment, or, under
`sync.tables.touched_rows`, over the rows that either partner touched since their last average; in
shadow mode as many fragments as the cycle's bound in steps and the link's byte budget ask for
(`shadowgba.shadow.cycle_budget`), in foreground mode a whole cycle. A
fragment is snapshotted at a step boundary and its delta handed back there (`WriteBack`), as the
dense replica's is; the final sync at `close()` averages every fragment once more and assigns it.

Invariants:
- Every partner runs the same table rounds after the same dense round (the caller decides from
  flags that are equal on every rank), so the replica group's collectives pair up.
- An aborting rank still enters the collective, with an empty contribution and its aborted marker,
  so no partner waits for it; the next dense round tells every rank.
- What the runtime owns (its flags' verdict, its step count, how a heal is reported) reaches these
  rounds only through the callables given to the constructor: they touch no private state of it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Sequence

import torch.distributed as dist

from shadowgba.metrics import SyncMetrics
from shadowgba.shadow.cycle_budget import CycleBudget
from shadowgba.shadow.tables import TableFragments
from shadowgba.shadow.writeback import WriteBack

CheckFlags = Callable[[Sequence[int], Sequence[int], str], bool]
"""The runtime's verdict on a collective's flags: (NaN / Inf ranks, aborted ranks, where) -> whether
the rounds must end (`ShadowSync._check_flags`)."""
GlobalRanks = Callable[[Sequence[int], dist.ProcessGroup], tuple[int, ...]]
"""A group's ranks as the job's global ranks, which the logs name."""


@dataclasses.dataclass
class TableRounds:
    """A trainer's table rounds on its replica group, and their counters (see the module docstring)."""

    tables: TableFragments
    """This rank's table shards, in fragments."""
    metrics: SyncMetrics
    """The runtime's metrics, where each round is recorded."""
    shadow_mode: bool
    """Rounds run in the shadow thread (`sync.mode: shadow`), where a touched-rows cycle is planned."""
    heals: bool
    """A fragment whose rows held NaN / Inf takes the partners' consensus (`sync.on_nonfinite: skip`)."""
    aborting: threading.Event
    """Set while this rank aborts."""
    check_flags: CheckFlags
    """The runtime's verdict on flags: the same as a dense round's."""
    global_ranks: GlobalRanks
    """The runtime's mapping of a group's ranks to the job's."""
    step: Callable[[], int]
    """The training step now."""
    record_heal: Callable[[str, str], None]
    """How the runtime reports a heal: (what, extra)."""
    dense_gap_steps: int = 0
    """The most steps of the fastest rank the config lets pass between two dense rounds (the floor,
    `sync.max_gap_steps`, or the user's rarer `interval_steps`), as configured at the start, not as
    changed live: every partner must stop alike. The shadow table rounds after a dense round take
    at most half of it (`CycleBudget.group_steps`). 0: no floor, no such stop."""

    def __post_init__(self) -> None:
        config = self.tables.config
        self.budget = CycleBudget(config.cycle_steps, config.link_mb_per_step, self.tables.fragment_numel,
                                  group_steps=(self.dense_gap_steps + 1) // 2)
        """How many fragments the shadow rounds take after a dense round, and when they stop for it."""

    def run(self, count: int | None, writeback: WriteBack | None, steps: int = 0) -> bool:
        """`count` table rounds on the replica group, each one fragment: snapshot it at a step
        boundary, average it with the partners, hand the delta back (`writeback`; None: the final
        sync, in the training thread after the rounds ended, assigns the average). `count` None: after
        a dense round, in shadow mode as many as `budget` asks for (the dense round came `steps`
        steps of the fastest rank after the one before), stopping early once a partner has taken
        `budget.group_steps` steps since they began, in foreground mode a whole cycle (TorchRec's
        `sync()`: every table each time). Returns True when a snapshot
        was cancelled (this rank is aborting): it then sends an empty contribution with its aborted
        marker, which the partners leave out, so nobody waits for it in this collective; its next
        dense round tells every rank. NaN / Inf rows are left out on every partner alike and acted
        on as in a dense round (`check_flags`)."""
        tables = self.tables
        buffer = tables.buffer
        planned = False
        if writeback is None:
            tables.start_full_cycle()
        elif self.shadow_mode and tables.touched is not None and not tables.queue:
            if self.aborting.is_set():
                tables.allreduce.sum(None, stop=False, aborted=True)
                return True
            started = time.perf_counter()
            if tables.plan_touched_cycle() is not None:
                return False  # a partner is aborting: the next dense round tells every rank
            self.metrics.record_table_round(time.perf_counter() - started, tables.mask_bytes, fragment=False)
            if not tables.queue:
                return False  # no partner touched a row since the last cycle
            planned = True
        budgeted = count is None and self.shadow_mode
        if count is None and not self.shadow_mode:
            count = len(tables.fragments)
        elif count is None:
            if tables.touched is not None:  # the touched-rows cycle under way (planned above when new)
                left, starts = len(tables.queue), planned
            else:  # the rest of the full rotation, or a new one
                left = (len(tables.fragments) - 1 - tables.cursor) or len(tables.fragments)
                starts = left == len(tables.fragments)
            count = self.budget.fragments_now(steps, left, started=starts)
        began, done = self.step(), 0
        while done < count:
            started = time.perf_counter()
            if writeback is None:
                tables.copy_to(buffer)
            elif self.aborting.is_set() or not writeback.snapshot(buffer):
                tables.allreduce.sum(None, stop=False, aborted=True)
                return True
            tables.allreduce.steps = self.step() - began  # the trailer: every partner sees the most
            reduced = tables.average(buffer, delta=writeback is not None)
            done += 1
            self.metrics.record_table_round(time.perf_counter() - started, tables.allreduce.bytes_per_call)
            replace = not reduced.own_counted and reduced.heals and self.heals
            if (reduced.own_counted or replace) and writeback is None:
                tables.copy_from(buffer)
                self.record_applied(replace)
            elif reduced.own_counted or replace:
                writeback.apply(buffer, replace)
            if self.check_flags(self.global_ranks(reduced.nonfinite_ranks, tables.group), (), "a table round"):
                return False
            if budgeted and self.budget.stop(reduced.fastest_steps, done):
                break  # the dense round behind these comes first; the cycle goes on after it
        if budgeted:
            self.budget.averaged(done, left, count)
        return False

    def record_applied(self, replaced: bool) -> None:
        """A fragment's average reached the table shards (at a step boundary, or in the final sync);
        `replaced`: they were healed, so is their optimizer state."""
        self.tables.mark_applied(self.step())
        if replaced:
            self.tables.restart_state()
            self.record_heal(f"table fragment {self.tables.cursor} (rows and their optimizer state)", "")

    def fragment_ages(self) -> dict[str, float]:
        """The tables' counters for `metrics`: cycles done, the age of the fragments now in steps,
        over the run how many steps a fragment had gone unaveraged when it was refreshed, and the
        shadow cycles' length in steps of the fastest rank (the last and the longest, `CycleBudget`),
        the bound the last one was held to, how many were held to a bound, how many overran theirs
        and by at most how many steps, and how many times the table rounds after a dense round
        stopped for the dense rounds behind them."""
        tables = self.tables
        oldest, mean = tables.ages(self.step())
        return {"table_cycles": tables.cycles, "fragment_age_steps_max": oldest, "fragment_age_steps_mean": mean,
                "table_cycle_steps_last": self.budget.last_cycle_steps or 0,
                "table_cycle_steps_max": self.budget.longest_cycle_steps,
                "table_cycle_bound_steps_last": self.budget.last_cycle_bound or 0,
                "table_cycles_timed": self.budget.timed_cycles,
                "table_cycles_over_bound": self.budget.over_bound,
                "table_cycle_overrun_steps_max": self.budget.overrun_max,
                "table_groups_stopped": self.budget.stopped_early,
                "fragment_refresh_age_steps_max": tables.refresh_age_max,
                "fragment_refresh_age_steps_mean": tables.refresh_age_total / max(tables.refreshed, 1)}
