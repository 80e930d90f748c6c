"""Membership: who is in the job, who left, and why. One place for every verdict on a peer.

Two views, both fed by the transport and read by the runtimes and the `Job`:

- `NoticeBoard` (every rank, with or without servers): keys in the job's store. A failed rank posts
  why it left (`post_abort`), so a peer whose collective fails once that rank is gone can name it
  (`aborted_peers`). A rank killed or stuck posts nothing, so every trainer also beats there
  (`Heartbeat`), and `silent_peers` names the ranks whose beat stopped. The store is the default
  group's (torchrun's agent store under torchrun, which outlives every rank); keys carry the
  torchrun attempt, so a restarted attempt never reads a dead one's notices.
- `Roster` (a server): the trainers' arrivals at the barriers (`stop`, `barrier(name)`), who is
  a member, who departed (when and why), and the job's failure if any. A trainer is lost when this
  server's channel to it falls silent past `sync.timeout_s`, or closes with no new session within
  `RECONNECT_GRACE_S`, or it says so (abort notice). Under `sync.ps.on_trainer_lost: continue`
  that process *departs*: no barrier or `stop()` waits for it, its sessions are refused from then
  on (a stopped process that resumes learns it left), and a new process of the same trainer
  index (a higher incarnation) joins again. Under `fail` the loss is the job's failure, final for
  the server: every later call, barrier poll and `stop()` is refused with it.

Invariant (why no survivor hangs): a trainer that leaves the job either says so (abort notice),
or its channels to the servers fail (killed: at once; stopped: after `sync.timeout_s`), and each
server turns that into a departure or the failure. A departure removes the trainer from every
count a survivor waits on (barriers, `stop()`); a failure is read by each survivor at its next
call or barrier poll, which raises `PeerLost` naming the lost trainer.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import itertools
import os
import threading
import time
from typing import Any, Callable, Sequence

import torch.distributed as dist

from shadowgba.network import StoreUnreachable, bounded

BEAT_INTERVAL_S = 1.0
"""How often a `Heartbeat` beats, and about how often `silent_peers` reads the beats."""
HEARTBEAT_LEFT = "left"
"""The heartbeat of a rank that left the job normally (`Heartbeat.stop`)."""
HEARTBEAT_SILENT_S = 3 * BEAT_INTERVAL_S
"""How long `silent_peers` waits for a heartbeat to advance before it names that rank: a few beats."""
NOTICE_TIMEOUT_S = 5.0
"""The longest one read or write of the notice board waits for the store. On a healthy network an
access takes milliseconds; past this, the store is taken as unreachable from this rank."""


def restart_count() -> int:
    """Which attempt of a torchrun job this is (0: the first; 0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class NoticeBoard:
    """The notice board of the job named `job` (the same on every rank) in `store` (default: the
    default group's). Reads and writes never raise, and none waits longer than `NOTICE_TIMEOUT_S`:
    the store's host may be gone, or this rank cut off from it (a network partition), and a rank
    must still end within a bounded time. `reachable` says whether the last access got through."""

    def __init__(self, job: str, store: dist.Store | None = None, attempt: int | None = None) -> None:
        """`attempt`: the keys' attempt (default this torchrun attempt's, `restart_count`); a board
        shared by several torchrun jobs (`shadowgba.shadow.survival`) names one for all of them."""
        self.job = job
        self.attempt = restart_count() if attempt is None else attempt
        self._given = store
        self._store: dist.Store | None = None
        self._lock = threading.Lock()
        self._stuck: threading.Thread | None = None
        """An access that did not return within `NOTICE_TIMEOUT_S` and may still be blocked."""
        self.reachable = True
        """Whether the last read or write reached the store (False: it failed or timed out)."""

    def post_abort(self, rank: int, reason: str) -> None:
        """Put `reason` on the board as rank `rank`'s: why it left."""
        self._set(self._key(rank), reason)

    def aborted_peers(self, ranks: Sequence[int]) -> dict[int, str]:
        """The ranks among `ranks` that posted an abort, with their reasons (those read before the
        store stopped answering, if it did)."""
        reasons = {}
        for rank in ranks:
            reason = self._read(self._key(rank))
            if not self.reachable:
                break
            if reason is not None:
                reasons[rank] = reason
        return reasons

    def heartbeat(self, rank: int) -> "Heartbeat":
        """A started `Heartbeat` of rank `rank` on this board."""
        return Heartbeat(self, rank).start()

    def silent_peers(self, ranks: Sequence[int], within_s: float = HEARTBEAT_SILENT_S) -> list[int]:
        """The ranks among `ranks` whose heartbeat did not advance for `within_s`, left ones excepted:
        dead or stuck. Returns as soon as every other one has beaten, so with live peers it waits
        about `BEAT_INTERVAL_S`. Empty when the board cannot be read (then `reachable` is False)."""
        keys = {rank: self._key(rank, "beat") for rank in ranks}
        first = {rank: self._read(key) for rank, key in keys.items() if self.reachable}
        waiting = {rank for rank, beat in first.items() if beat != HEARTBEAT_LEFT}
        deadline = time.monotonic() + within_s
        while waiting and self.reachable and time.monotonic() < deadline:
            time.sleep(BEAT_INTERVAL_S / 4)
            waiting = {rank for rank in waiting if self._read(keys[rank]) in (first[rank], None)}
        return sorted(waiting) if self.reachable else []

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
                return None
        try:
            value = bounded(lambda: operation(self._store_now()), NOTICE_TIMEOUT_S)
        except StoreUnreachable as unreachable:
            with self._lock:
                self._stuck = unreachable.thread or self._stuck
                self.reachable = False
            return None
        self.reachable = True
        return value


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
        """Stop beating and mark this rank as left: from then on its silence names no failure. Waits
        at most about `NOTICE_TIMEOUT_S` for a beat in flight."""
        self._ended.set()
        self._thread.join(NOTICE_TIMEOUT_S + BEAT_INTERVAL_S)
        self._board._set(self._key, HEARTBEAT_LEFT)

    def _beat(self) -> None:
        for count in itertools.count():
            self._board._set(self._key, str(count))
            if self._ended.wait(BEAT_INTERVAL_S):
                return


@dataclasses.dataclass(frozen=True)
class Departure:
    """A trainer process that left the job without ending it (`sync.ps.on_trainer_lost: continue`)."""

    trainer: int
    """The trainer's index."""
    incarnation: int
    """Which process of that trainer left (1: its first; a restarted one takes the next number)."""
    at: float
    """When this server decided it (`time.time()`)."""
    why: str
    """The verdict (`lost_trainer`), or the trainer's own abort notice."""


@dataclasses.dataclass
class Roster:
    """A server's view of the trainers (see the module docstring); thread-safe.

    Every trainer index is a member until it departs; a departure is of one process of it (its
    incarnation), and a newer incarnation of the same index joins again. Under `on_lost`
    "fail" a loss is instead the job's `failure`."""

    num_trainers: int
    on_lost: str = "fail"
    """`sync.ps.on_trainer_lost`: "continue" (a lost trainer departs) or "fail" (the job ends)."""
    arrived: dict[str, set[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(set))
    """Per barrier key ('stop', or a `barrier()` name and use), the trainer indices that arrived."""
    failure: str | None = None
    """The first failure: a trainer's abort notice or this server's verdict on a lost trainer."""
    departures: list[Departure] = dataclasses.field(default_factory=list)
    """Every departure, oldest first (the membership's history)."""
    incarnations: dict[int, int] = dataclasses.field(default_factory=dict)
    """Per trainer index, the newest incarnation seen (a session opened, or a departure)."""
    departed: set[int] = dataclasses.field(default_factory=set)
    """The trainer indices whose newest incarnation departed and none has joined since."""
    released: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Per barrier key, the members that had arrived when it was first found complete: what every
    trainer released there reads as who met (`met`), whatever departs or joins afterwards."""
    changed: threading.Condition = dataclasses.field(default_factory=threading.Condition)

    def join(self, trainer: int, incarnation: int) -> str | None:
        """A session of trainer `trainer`'s process `incarnation` opens: None when it may (a newer
        process replaces the older one, which departs), the reason when that process has departed."""
        with self.changed:
            newest = self.incarnations.get(trainer, 0)
            if incarnation < newest or (incarnation == newest and trainer in self.departed):
                return self._refusal(trainer, incarnation)
            if incarnation > newest:
                if newest and trainer not in self.departed:
                    self._depart(trainer, newest, f"replaced by a new process of it (incarnation {incarnation})")
                self.incarnations[trainer] = incarnation
                self.departed.discard(trainer)
                for arrivals in self.arrived.values():  # a new process meets every barrier afresh
                    arrivals.discard(trainer)
                self.changed.notify_all()
            return None

    def lose(self, trainer: int, incarnation: int, message: str) -> bool:
        """Trainer `trainer`'s process `incarnation` was lost or aborted (`message` says how): it
        departs (continue), or the job fails (fail). True when it departed now (it was a member)."""
        with self.changed:
            if self.on_lost == "fail":
                self.fail(message)
                return False
            if incarnation != self.incarnations.get(trainer, incarnation) or trainer in self.departed:
                return False  # an older process, or one that left already
            self.incarnations[trainer] = incarnation
            self._depart(trainer, incarnation, message)
            return True

    def abort(self, trainer: int, incarnation: int, message: str) -> None:
        """Trainer `trainer`'s process `incarnation` says it failed (`message`): the job's failure,
        whatever `on_lost` says (a failure of the user's code or data is no preemption, and would meet
        every trainer), unless that process had departed already (then it only confirms it left)."""
        with self.changed:
            if incarnation == self.incarnations.get(trainer, incarnation) and trainer not in self.departed:
                self.fail(message)

    def _depart(self, trainer: int, incarnation: int, why: str) -> None:
        self.departures.append(Departure(trainer, incarnation, time.time(), why))
        self.departed.add(trainer)
        self.changed.notify_all()

    def _refusal(self, trainer: int, incarnation: int) -> str:
        left = [d for d in self.departures if d.trainer == trainer and d.incarnation == incarnation]
        why = f"it departed at {time.strftime('%H:%M:%S', time.localtime(left[-1].at))}: {left[-1].why}" if left else \
            "a newer process of it has joined"
        return (f"trainer {trainer}'s process (incarnation {incarnation}) is no longer in the job ({why}); "
                "start the trainer again to rejoin (sync.ps.on_trainer_lost: continue)")

    def arrive(self, key: str, trainer: int) -> None:
        """Trainer `trainer` arrived at barrier `key`."""
        with self.changed:
            self.arrived[key].add(trainer)
            self.changed.notify_all()

    def has_arrived(self, key: str, trainer: int) -> bool:
        with self.changed:
            return trainer in self.arrived[key]

    def missing(self, key: str) -> tuple[list[int], str | None]:
        """(the members not yet arrived at `key`, the failure or None): a departed trainer is
        waited for by no barrier."""
        with self.changed:
            missing = [i for i in range(self.num_trainers) if i not in self.arrived[key] and i not in self.departed]
            if not missing and key not in self.released:
                self.released[key] = tuple(sorted(self.arrived[key] - self.departed))
            return missing, self.failure

    def met(self, key: str) -> tuple[int, ...] | None:
        """The members that met at barrier `key` (None before it was complete): the same answer for
        every trainer it released."""
        with self.changed:
            return self.released.get(key)

    def fail(self, message: str) -> None:
        """Record a failure (a trainer's abort notice, or a verdict); only the first one counts."""
        with self.changed:
            if self.failure is None:
                self.failure = message
            self.changed.notify_all()


def lost_trainer(trainer: int, rank: int, silent_s: float, why: str, observer: str, detail: str) -> str:
    """A server's verdict on a lost trainer, as every survivor reads it."""
    return (f"trainer {trainer} (rank {rank}) stopped answering for {silent_s:.0f} s ({why}); it probably died "
            f"({observer}'s channel: {detail})")
