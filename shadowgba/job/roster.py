"""A server's roster of the trainers: who is a member, who departed (when and why), who arrived at
each barrier, and the job's failure if any. The servers' one failure record: every service a
server hosts (GBA's dense shard, PS-hosted tables, the S-EASGD centre) refuses with what it says.

A trainer is lost when a server's channel to it falls silent past `sync.timeout_s`, or closes with
no new session within the transport's reconnect grace, or it says so (abort notice). Under
`sync.ps.on_trainer_lost: continue` that process *departs*: no barrier or `stop()` waits for it,
its sessions are refused from then on (a stopped process that resumes learns it left), and a new
process of the same trainer index (a higher incarnation) joins again. Under `fail` the loss is the
job's failure, final for the server: every later call, barrier poll and `stop()` is refused with it.

One failure record per server: the services it hosts record their own failures here too (a
non-finite push under `sync.on_nonfinite: fail`, a trainer's report of one), and every refusal
names the ranks the failure names (`refusal`, `failed`), so that a trainer that reads it blames
those ranks, never itself (`shadowgba.job.blame`). A trainer's index is its global rank
(`shadowgba.job.roles`), so the roster names ranks without knowing the roles.

Invariant (why no survivor hangs): a trainer that leaves the job either says so (abort notice),
or its channels to the servers fail (killed: at once; stopped: after `sync.timeout_s`), and each
server turns that into a departure or the failure. A departure removes the trainer from every
count a survivor waits on (barriers, `stop()`); a failure is read by each survivor at its next
call or barrier poll, which raises `PeerLost` naming the lost trainer.

The trainers' side of the failure path is the notice board (`shadowgba.job.notices`) and its
verdict (`shadowgba.job.blame`). The roster lives in the job's package, not the transport's,
because it is membership: the transport (`shadowgba.ps.server_end`) only feeds it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Sequence

from shadowgba.errors import PeerLost

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
    """The first failure: a trainer's abort notice, this server's verdict on a lost trainer, or a
    service's (a non-finite push under `sync.on_nonfinite: fail`)."""
    failed: tuple[int, ...] = ()
    """The global ranks `failure` names (empty: it names none this server knows)."""
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
                self.fail(message, (trainer,))
                return False
            if incarnation != self.incarnations.get(trainer, incarnation) or trainer in self.departed:
                return False  # an older process, or one that left already
            self.incarnations[trainer] = incarnation
            self._depart(trainer, incarnation, message)
            return True

    def abort(self, trainer: int, incarnation: int, message: str, ranks: Sequence[int]) -> None:
        """Trainer `trainer`'s process `incarnation` says it failed (`message`, naming `ranks` as the
        cause: its own, or a peer's it ended after): the job's failure, whatever `on_lost` says (a
        failure of the user's code or data is no preemption, and would meet every trainer), unless
        that process had departed already (then it only confirms it left)."""
        with self.changed:
            if incarnation == self.incarnations.get(trainer, incarnation) and trainer not in self.departed:
                self.fail(message, ranks)

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

    def missing(self, key: str) -> tuple[list[int], str | None, tuple[int, ...]]:
        """(the members not yet arrived at `key`, the failure or None, the ranks it names): a departed
        trainer is waited for by no barrier."""
        with self.changed:
            missing = [i for i in range(self.num_trainers) if i not in self.arrived[key] and i not in self.departed]
            if not missing and key not in self.released:
                self.released[key] = tuple(sorted(self.arrived[key] - self.departed))
            return missing, self.failure, self.failed

    def met(self, key: str) -> tuple[int, ...] | None:
        """The members that met at barrier `key` (None before it was complete): the same answer for
        every trainer it released."""
        with self.changed:
            return self.released.get(key)

    def fail(self, message: str, ranks: Sequence[int]) -> None:
        """Record a failure naming `ranks` (a trainer's abort notice, a verdict, a service's refusal);
        only the first one counts."""
        with self.changed:
            if self.failure is None:
                self.failure, self.failed = message, tuple(ranks)
            self.changed.notify_all()

    def refusal(self, what: str) -> PeerLost | None:
        """The error `what` (e.g. `ps0 refuses dense.push`) is refused with once the job failed, naming
        the failure and its ranks; None while it has not."""
        with self.changed:
            if self.failure is None:
                return None
            return PeerLost(f"{what}: the job failed: {self.failure}", ranks=self.failed)


def lost_trainer(trainer: int, rank: int, silent_s: float, why: str, observer: str, detail: str) -> str:
    """A server's verdict on a lost trainer, as every survivor reads it."""
    return (f"trainer {trainer} (rank {rank}) stopped answering for {silent_s:.0f} s ({why}); it probably died "
            f"({observer}'s channel: {detail})")
