"""The 2D layout's table rounds inside the shadow runtime's rounds (mixed into `ShadowSync`).

After each dense round, a 2D job averages one fragment of its table shards with the same shards on
its replica group (`TableFragments`): a round-robin cycle over every fragment, or, under
`sync.tables.touched_rows`, over the rows that either partner touched since their last average. A
fragment is snapshotted at a step boundary and its delta handed back there (`WriteBack`), as the
dense replica's is; the final sync at `close()` averages every fragment once more and assigns it.
"""

from __future__ import annotations

import time

from shadowgba.shadow.writeback import WriteBack


class TableRounds:
    """`ShadowSync`'s table rounds and their counters (see the module docstring)."""

    def _table_rounds(self, count: int, writeback: WriteBack | None) -> bool:
        """`count` table rounds on the replica group, each one fragment: snapshot it at a step
        boundary, average it with the partners, hand the delta back (`writeback`; None: the final
        sync, in the training thread after the rounds ended, assigns the average). Returns True when a snapshot
        was cancelled (this rank is aborting): it then sends an empty contribution with its aborted
        marker, which the partners leave out, so nobody waits for it in this collective; its next
        dense round tells every rank. NaN / Inf rows are left out on every partner alike and acted
        on as in a dense round (`_check_flags`)."""
        buffer = self.tables.buffer
        if writeback is None:
            self.tables.start_full_cycle()
        elif self.config.mode == "shadow" and self.tables.touched is not None and not self.tables.queue:
            if self._aborting.is_set():
                self.tables.allreduce.sum(None, stop=False, aborted=True)
                return True
            started = time.perf_counter()
            if self.tables.plan_touched_cycle() is not None:
                return False  # a partner is aborting: the next dense round tells every rank
            self.metrics.record_table_round(time.perf_counter() - started, self.tables.mask_bytes, fragment=False)
            if not self.tables.queue:
                return False  # no partner touched a row since the last cycle
        for _ in range(count):
            started = time.perf_counter()
            if writeback is None:
                self.tables.copy_to(buffer)
            elif self._aborting.is_set() or not writeback.snapshot(buffer):
                self.tables.allreduce.sum(None, stop=False, aborted=True)
                return True
            reduced = self.tables.average(buffer, delta=writeback is not None)
            self.metrics.record_table_round(time.perf_counter() - started, self.tables.allreduce.bytes_per_call)
            replace = not reduced.own_counted and reduced.heals and self._heals
            if (reduced.own_counted or replace) and writeback is None:
                self.tables.copy_from(buffer)
                self._record_table_applied(replace)
            elif reduced.own_counted or replace:
                writeback.apply(buffer, replace)
            if self._check_flags(self._global_ranks(reduced.nonfinite_ranks, self.tables.group), (), "a table round"):
                return False
        return False

    def _fragment_ages(self) -> dict[str, float]:
        """The tables' counters for `metrics`: cycles done, the age of the fragments now in steps,
        and over the run how many steps a fragment had gone unaveraged when it was refreshed."""
        tables = self.tables
        oldest, mean = tables.ages(self._step)
        return {"table_cycles": tables.cycles, "fragment_age_steps_max": oldest, "fragment_age_steps_mean": mean,
                "fragment_refresh_age_steps_max": tables.refresh_age_max,
                "fragment_refresh_age_steps_mean": tables.refresh_age_total / max(tables.refreshed, 1)}

    def _record_table_applied(self, replaced: bool) -> None:
        self.tables.mark_applied(self._step)
        if replaced:
            self.tables.restart_state()
            self._record_heal(f"table fragment {self.tables.cursor} (rows and their optimizer state)", "")
