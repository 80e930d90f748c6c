"""Membership: who is in the job, who left, and why. One place for every verdict on a peer.

Two views, both fed by the transport and read by the runtimes and the `Job`:

- `NoticeBoard` (every rank, with or without servers): keys in the job's store. A failed rank posts
  why it left (`post_abort`), so a peer whose collective fails once that rank is gone can name it
  (`aborted_peers`). A rank killed or stuck posts nothing, so every trainer also beats there
  (`Heartbeat`), and `silent_peers` names the ranks whose beat stopped. The store is the default
  group's (torchrun's agent store under torchrun, which outlives every rank); keys carry the
  torchrun attempt, so a restarted attempt never reads a dead one's notices.
- `Roster` (a server): the trainers' arrivals at the barriers (`stop`, `barrier(name)`) and the
  first failure this server knows of: a trainer's abort notice, or this server's own verdict that a
  trainer was lost (its channel fell silent past `sync.timeout_s`, or closed with no new session
  within `RECONNECT_GRACE_S`). Once set, the failure is final for the server: every later call,
  barrier poll and `stop()` is refused with it, which is how every survivor learns of the loss.

Invariant (why no survivor hangs): a trainer that leaves the job either says so (abort notice),
or its channels to the servers fail (killed: at once; stopped: after `sync.timeout_s`), and each
server turns that into the roster's failure; every trainer's calls and barrier polls go to the
servers, so each survivor raises `PeerLost` naming the lost trainer at its next call or poll.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import threading
import time
from typing import Sequence

import torch.distributed as dist

BEAT_INTERVAL_S = 1.0
"""How often a `Heartbeat` beats, and about how often `silent_peers` reads the beats."""
HEARTBEAT_LEFT = "left"
"""The heartbeat of a rank that left the job normally (`Heartbeat.stop`)."""
HEARTBEAT_SILENT_S = 3 * BEAT_INTERVAL_S
"""How long `silent_peers` waits for a heartbeat to advance before it names that rank: a few beats."""


def restart_count() -> int:
    """Which attempt of a torchrun job this is (0: the first; 0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class NoticeBoard:
    """The notice board of the job named `job` (the same on every rank) in `store` (default: the
    default group's). Reads and writes never raise: the store's host may be gone."""

    def __init__(self, job: str, store: dist.Store | None = None) -> None:
        self.job = job
        self._store = store

    def post_abort(self, rank: int, reason: str) -> None:
        """Put `reason` on the board as rank `rank`'s: why it left."""
        self._set(self._key(rank), reason)

    def aborted_peers(self, ranks: Sequence[int]) -> dict[int, str]:
        """The ranks among `ranks` that posted an abort, with their reasons."""
        reasons = {rank: self._read(self._key(rank)) for rank in ranks}
        return {rank: reason for rank, reason in reasons.items() if reason is not None}

    def heartbeat(self, rank: int) -> "Heartbeat":
        """A started `Heartbeat` of rank `rank` on this board."""
        return Heartbeat(self, rank).start()

    def silent_peers(self, ranks: Sequence[int], within_s: float = HEARTBEAT_SILENT_S) -> list[int]:
        """The ranks among `ranks` whose heartbeat did not advance for `within_s`, left ones excepted:
        dead or stuck. Returns as soon as every other one has beaten, so with live peers it waits
        about `BEAT_INTERVAL_S`. Empty when the board cannot be read."""
        keys = {rank: self._key(rank, "beat") for rank in ranks}
        first = {rank: self._read(key) for rank, key in keys.items()}
        waiting = {rank for rank, beat in first.items() if beat != HEARTBEAT_LEFT}
        deadline = time.monotonic() + within_s
        while waiting and time.monotonic() < deadline:
            time.sleep(BEAT_INTERVAL_S / 4)
            waiting = {rank for rank in waiting if self._read(keys[rank]) in (first[rank], None)}
        return sorted(waiting)

    def _key(self, rank: int, kind: str = "aborted") -> str:
        return f"shadowgba/attempt_{restart_count()}/{self.job}/{kind}/{rank}"

    def _store_now(self) -> dist.Store:
        return self._store if self._store is not None else dist.distributed_c10d._get_default_store()

    def _set(self, key: str, value: str) -> None:
        try:
            self._store_now().set(key, value)
        except Exception:  # noqa: BLE001 (the store's host is gone: the peers learn only that the rank left)
            pass

    def _read(self, key: str) -> str | None:
        try:
            store = self._store_now()
            return store.get(key).decode() if store.check([key]) else None
        except Exception:  # noqa: BLE001 (the store's host is gone: nothing can be read)
            return None


class Heartbeat:
    """A rank's heartbeat on a `NoticeBoard`: a counter that a thread of its own advances every
    `BEAT_INTERVAL_S` while the rank is in the job, marked as left when it leaves normally."""

    def __init__(self, board: NoticeBoard, rank: int) -> None:
        self._board = board
        self._key = board._key(rank, "beat")
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="shadowgba-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        """Start beating (returns self)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and mark this rank as left: from then on its silence names no failure."""
        self._ended.set()
        self._thread.join()
        self._board._set(self._key, HEARTBEAT_LEFT)

    def _beat(self) -> None:
        for count in itertools.count():
            self._board._set(self._key, str(count))
            if self._ended.wait(BEAT_INTERVAL_S):
                return


@dataclasses.dataclass
class Roster:
    """A server's view of the trainers (see the module docstring); thread-safe."""

    num_trainers: int
    arrived: dict[str, set[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(set))
    """Per barrier key ('stop', or a `barrier()` name and use), the trainer indices that arrived."""
    failure: str | None = None
    """The first failure: a trainer's abort notice or this server's verdict on a lost trainer."""
    changed: threading.Condition = dataclasses.field(default_factory=threading.Condition)

    def arrive(self, key: str, trainer: int) -> None:
        """Trainer `trainer` arrived at barrier `key`."""
        with self.changed:
            self.arrived[key].add(trainer)
            self.changed.notify_all()

    def has_arrived(self, key: str, trainer: int) -> bool:
        with self.changed:
            return trainer in self.arrived[key]

    def missing(self, key: str) -> tuple[list[int], str | None]:
        """(the trainers not yet arrived at `key`, the failure or None)."""
        with self.changed:
            return [i for i in range(self.num_trainers) if i not in self.arrived[key]], self.failure

    def fail(self, message: str) -> None:
        """Record a failure (a trainer's abort notice, or a verdict); only the first one counts."""
        with self.changed:
            if self.failure is None:
                self.failure = message
            self.changed.notify_all()

    def await_all(self, key: str) -> str | None:
        """Block until every trainer arrived at `key` or a failure is known; the failure or None."""
        with self.changed:
            self.changed.wait_for(lambda: len(self.arrived[key]) == self.num_trainers or self.failure is not None)
            return self.failure


def lost_trainer(trainer: int, rank: int, silent_s: float, why: str, observer: str, detail: str) -> str:
    """A server's verdict on a lost trainer, as every survivor reads it."""
    return (f"trainer {trainer} (rank {rank}) stopped answering for {silent_s:.0f} s ({why}); it probably died "
            f"({observer}'s channel: {detail})")
