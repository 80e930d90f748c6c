"""Which table rows a rank's training steps may have updated since a touched-rows cycle last took
them (`TableFragments.plan_touched_cycle`, `sync.tables.touched_rows`).

A fused kernel's optimizer updates, in backward, exactly the rows its forward looked up, so a row
is *touched* when a training forward looked it up: each shard's `watch` (a hook on its kernel's
forward, `shadowgba.integrations.torchrec.fused_table_shards`) hands this rank the ids, and they
are flagged here: two bytes a row (the live flags and those a planning took). Inferring it from the values instead (a per-row optimizer state,
or the first weight, against what the last average left there) missed rows that moved while that
value did not: row-wise Adagrad's sum growing by less than float32 keeps (a small gradient after
large ones moves the row, its sum rounds to no change), a weight decay applied with a zero
gradient, a first column whose gradient is zero. Such a row stayed apart from its replicas until
the final sync.

A cycle's planning `take`s the flags (a swap with a second set, so that the training thread flags
rows meanwhile in the live set, which the next cycle takes), reads them a window at a time
(`mask`) and `drop`s them once the cycle is queued, or `put_back`s them if the planning stopped.
So a row looked up while its cycle is under way is taken again by the next one: its round's delta
keeps that progress (the handoff rule), which the partners have not seen.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

Watch = Callable[[Callable[[torch.Tensor], None]], Callable[[], None]]
"""`watch(flag)`: from now on call `flag(rows)` with the row ids of every training forward that looks
up rows of a shard; returns the function that stops it."""


class TouchedRows:
    """Flags, one per row of every shard in order, of the rows looked up since a cycle took them."""

    def __init__(self, rows: Sequence[int], watches: Sequence[Watch | None], device: torch.device) -> None:
        """`rows[i]`: shard i's row count; `watches[i]`: its `Watch` (None: its rows are flagged by
        whoever updates them, with `mark`)."""
        self.offsets = [0]
        for count in rows:
            self.offsets.append(self.offsets[-1] + count)
        self._live, self._taken = (torch.zeros(self.rows, dtype=torch.bool, device=device) for _ in range(2))
        self._lock = threading.Lock()
        self._unwatch = [watch(lambda ids, shard=shard: self.mark(shard, ids))
                         for shard, watch in enumerate(watches) if watch is not None]

    @property
    def rows(self) -> int:
        return self.offsets[-1]

    def mark(self, shard: int, ids: torch.Tensor) -> None:
        """Rows `ids` of shard `shard` are (about to be) updated."""
        with self._lock:
            self._live[self.offsets[shard]:self.offsets[shard + 1]].index_fill_(0, ids.long(), True)

    def mark_all(self) -> None:
        """Every row may differ from its replicas (tables loaded from a checkpoint after the start)."""
        with self._lock:
            self._live.fill_(True)

    def take(self) -> None:
        """A cycle's planning starts: the rows flagged so far are its own; new flags go to the next."""
        with self._lock:
            self._live, self._taken = self._taken, self._live

    def mask(self, out: torch.Tensor, start: int) -> int:
        """Fill `out` with 1.0 for each taken row of rows `start ...` (all shards' rows in order), as
        many as fit; the rest 0. Returns how many rows it covered."""
        covered = min(self.rows - start, out.numel())
        out.zero_()
        out[:covered].copy_(self._taken[start:start + covered])
        return covered

    def drop(self) -> None:
        """The planning queued the taken rows."""
        self._taken.zero_()

    def put_back(self) -> None:
        """The planning stopped (a partner aborted): the taken rows go to the next cycle."""
        with self._lock:
            self._live |= self._taken
        self._taken.zero_()

    def picked(self, summed: torch.Tensor, start: int, picked: list[list[torch.Tensor]]) -> None:
        """Add the rows `summed` (the partners' masks summed, from row `start`) marks touched to
        `picked[shard]`."""
        for index, (low, high) in enumerate(zip(self.offsets, self.offsets[1:])):
            lo, hi = max(start, low), min(start + summed.numel(), high)
            if lo < hi:
                picked[index].append(torch.nonzero(summed[lo - start:hi - start]).flatten() + (lo - low))

    def clear(self) -> None:
        """Every row is equal to its replicas (the start's broadcast)."""
        with self._lock:
            self._live.zero_()
        self._taken.zero_()

    def close(self) -> None:
        """Stop watching the shards' lookups."""
        for unwatch in self._unwatch:
            unwatch()
        self._unwatch = []

    def held(self) -> dict[str, torch.Tensor]:
        """The flags (`SyncMetrics.memory`)."""
        return {"table_touched_flags": self._live, "table_touched_taken": self._taken}
