"""The job's notice board: who left the job, why, and what the job decided. Every rank has one,
with or without servers.

`NoticeBoard` holds keys in the job's store. A failed rank posts why it left (`post_abort`), so a
peer whose collective fails once that rank is gone can name it (`aborted_peers`). A rank killed or
stuck posts nothing, so every trainer also beats there (`shadowgba.job.heartbeat.Heartbeat`), and
`silent_peers` names the ranks whose beat stopped. Reading every peer costs the store a few
requests, not a few per peer: the beats come in one `multi_get`, and the ranks that posted an abort
are listed under one key, so that a thousand survivors looking up a lost rank at once do not bury
the store (and the heartbeats queued behind them) under a million reads. The job's decisions are compare-and-set entries
(`decide`): the first proposal for a number wins and every rank reads the same one (the cause of
a failure, `shadowgba.job.blame`; the surviving replica groups, `shadowgba.job.survivors`). The
store is the default group's (torchrun's agent store under torchrun, which outlives every rank), the
servers' in the elastic layout, or the replica store with a torchrun job per replica group.

Invariants:
- No access raises, and none waits longer than `NOTICE_TIMEOUT_S`: the store's host may be gone,
  or this rank cut off from it (a network partition), and a rank must still end within a bounded
  time. `reachable` says whether the last access got through; a read that did not answers None.
- Keys carry the torchrun attempt (`shadowgba.job.rendezvous.restart_count`), so a restarted
  attempt never reads a dead one's notices.
- A decision, once made, never changes: every rank that reads decision n of a kind reads the same.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Callable, Sequence

import torch.distributed as dist

from shadowgba.job.rendezvous import restart_count
from shadowgba.network import StoreUnreachable, bounded

BEAT_INTERVAL_S = 1.0
"""How often a `Heartbeat` beats (`shadowgba.job.heartbeat`), and about how often `silent_peers` reads the beats."""
HEARTBEAT_LEFT = "left"
"""The heartbeat of a rank that left the job normally (`Heartbeat.stop`)."""
ABORTED_LIST = "aborted_ranks"
"""The board's kind of the list of ranks that posted an abort (`post_abort`), one key for all of them."""
HEARTBEAT_SILENT_S = 3 * BEAT_INTERVAL_S
"""How long `silent_peers` waits for a heartbeat to advance before it names that rank: a few beats."""
NOTICE_TIMEOUT_S = 5.0
"""The longest one read or write of the notice board waits for the store. On a healthy network an
access takes milliseconds; past this, the store is taken as unreachable from this rank."""


class NoticeBoard:
    """The notice board of the job named `job` (the same on every rank) in `store` (default: the
    default group's). Reads and writes never raise, and none waits longer than `NOTICE_TIMEOUT_S`:
    the store's host may be gone, or this rank cut off from it (a network partition), and a rank
    must still end within a bounded time. `reachable` says whether the last access got through."""

    def __init__(self, job: str, store: dist.Store | None = None, attempt: int | None = None) -> None:
        """`attempt`: the keys' attempt (default this torchrun attempt's, `restart_count`); a board
        shared by several torchrun jobs (`shadowgba.job.survivors`) names one for all of them."""
        self.job = job
        self.attempt = restart_count() if attempt is None else attempt
        self._given = store
        self._store: dist.Store | None = None
        self._lock = threading.Lock()
        self._stuck: threading.Thread | None = None
        """An access that did not return within `NOTICE_TIMEOUT_S` and may still be blocked."""
        self.reachable = True
        """Whether the last read or write reached the store (False: it failed or timed out)."""
        self.unreachable_why = ""
        """Why the last access that did not reach the store failed: what an error naming it says."""

    def post_abort(self, rank: int, reason: str) -> None:
        """Put `reason` on the board as rank `rank`'s: why it left; then add `rank` to the list of
        ranks that posted (`ABORTED_LIST`), after the reason, so that a reader finds the reason of
        every rank listed."""
        self._set(self._key(rank), reason)
        self._access(lambda store: store.append(self._key(0, ABORTED_LIST), f"{rank},"))

    def aborted_peers(self, ranks: Sequence[int]) -> dict[int, str]:
        """The ranks among `ranks` that posted an abort, with their reasons (those read before the
        store stopped answering, if it did): one read of the list, then one per rank listed."""
        listed = self._read(self._key(0, ABORTED_LIST))
        posted = {int(rank) for rank in (listed or "").split(",") if rank}
        reasons = {}
        for rank in (rank for rank in ranks if rank in posted):
            reason = self._read(self._key(rank))
            if not self.reachable:
                break
            if reason is not None:
                reasons[rank] = reason
        return reasons

    def beat(self, rank: int, beat: str) -> None:
        """Put `beat` on the board as rank `rank`'s heartbeat: a count, or `HEARTBEAT_LEFT` (`Heartbeat`)."""
        self._set(self._key(rank, "beat"), beat)

    def silent_peers(self, ranks: Sequence[int], within_s: float = HEARTBEAT_SILENT_S) -> list[int]:
        """The ranks among `ranks` whose heartbeat did not advance for `within_s`, left ones excepted:
        dead or stuck. Returns as soon as every other one has beaten, so with live peers it waits
        about `BEAT_INTERVAL_S`. Empty when the board cannot be read (then `reachable` is False)."""
        first = self._beats(ranks)
        waiting = {rank for rank, beat in first.items() if beat != HEARTBEAT_LEFT}
        deadline = time.monotonic() + within_s
        while waiting and self.reachable and time.monotonic() < deadline:
            time.sleep(BEAT_INTERVAL_S / 4)
            now = self._beats(sorted(waiting))
            waiting = {rank for rank in waiting if now.get(rank) in (first[rank], None)}
        return sorted(waiting) if self.reachable else []

    def _beats(self, ranks: Sequence[int]) -> dict[int, str | None]:
        """The heartbeats of `ranks` (None: none posted), empty when the store cannot be reached. One
        `check` and one `multi_get` for all when every rank has beaten (a `multi_get` would wait
        for a missing key), else a read per rank."""
        keys = [self._key(rank, "beat") for rank in ranks]

        def read(store: dist.Store) -> dict[int, str | None]:
            if not keys:
                return {}
            if store.check(keys):
                return {rank: value.decode() for rank, value in zip(ranks, store.multi_get(keys))}
            return {rank: store.get(key).decode() if store.check([key]) else None for rank, key in zip(ranks, keys)}

        return self._access(read) or {}

    def decide(self, kind: str, number: int, proposal: str) -> str | None:
        """The job's decision number `number` of `kind`: `proposal` if this rank's is the first one
        made, else the first one (a compare-and-set in the store, so every rank reads the same);
        None when the store cannot be reached."""
        key = self._key(number, kind)
        value = self._access(lambda store: store.compare_set(key, "", proposal))
        return None if value is None else value.decode()

    def decision(self, kind: str, number: int) -> str | None:
        """Decision number `number` of `kind` if one was made (`decide`), else None."""
        return self._read(self._key(number, kind))

    def post(self, kind: str, number: int, value: str) -> None:
        """Put `value` on the board as entry `number` of `kind` (replacing one there)."""
        self._set(self._key(number, kind), value)

    def read(self, kind: str, number: int) -> str | None:
        """Entry `number` of `kind` (`post`), or None if there is none or the store is unreachable."""
        return self._read(self._key(number, kind))

    def count(self, kind: str, number: int = 0, add: int = 0) -> int | None:
        """Counter `number` of `kind` after adding `add` to it (0: read it); None when the store is
        unreachable."""
        return self._access(lambda store: store.add(self._key(number, kind), add))

    def clear(self, rank: int) -> None:
        """Remove rank `rank`'s abort notice and heartbeat: a new process of that rank (a replica
        group that rejoins) starts with none of its predecessor's."""
        for key in (self._key(rank), self._key(rank, "beat")):
            self._access(lambda store, key=key: store.delete_key(key))

    def _key(self, rank: int, kind: str = "aborted") -> str:
        return f"shadowgba/attempt_{self.attempt}/{self.job}/{kind}/{rank}"

    def _store_now(self) -> dist.Store:
        """The board's own connection to the store, made at first use: a clone of the given (or
        default) store whose operations time out after `NOTICE_TIMEOUT_S`, so that neither the job's
        store timeout (minutes) nor another user of the store's connection holds the board."""
        if self._store is None:
            given = self._given if self._given is not None else dist.distributed_c10d._get_default_store()
            try:
                store = given.clone()
                store.set_timeout(datetime.timedelta(seconds=NOTICE_TIMEOUT_S))
            except (AttributeError, NotImplementedError, RuntimeError):  # a store without clone (HashStore)
                store = given
            self._store = store
        return self._store

    def _set(self, key: str, value: str) -> None:
        self._access(lambda store: store.set(key, value))

    def _read(self, key: str) -> str | None:
        return self._access(lambda store: store.get(key).decode() if store.check([key]) else None)

    def _access(self, operation: Callable[[dist.Store], Any]) -> Any:
        """`operation(store)`'s result, or None when it failed or took longer than `NOTICE_TIMEOUT_S`
        (then `reachable` is False). While an earlier access is still blocked (`network.bounded`
        left it behind), every access fails at once."""
        with self._lock:
            if self._stuck is not None and self._stuck.is_alive():
                self.reachable = False
                self.unreachable_why = f"an earlier access has not returned after {NOTICE_TIMEOUT_S:g} s"
                return None
        try:
            value = bounded(lambda: operation(self._store_now()), NOTICE_TIMEOUT_S)
        except StoreUnreachable as unreachable:
            with self._lock:
                self._stuck = unreachable.thread or self._stuck
                self.reachable = False
                self.unreachable_why = str(unreachable)
            return None
        self.reachable = True
        return value
