"""The survivors' decisions: which replica groups of a 2D job are in it (`sync.on_group_lost:
continue`), as every member agrees, and which rejoin. Membership only: the shadow rounds that act on
these decisions (regroup, heal a joining group) are `shadowgba.shadow.epoch_rounds`.

A 2D job's replica groups depend on each other only through the shadow rounds: a group's training
step (TorchRec's all-to-all) pairs its own k ranks and no others, and every group holds a full
replica of the tables and the dense parameters. So when a rank is lost, only its own group has to
end; the others can go on, with the rounds rebuilt over the survivors; and a new process set of
that group can come back, take a partner's replica, and train on. `SurvivingGroups` is what a rank
consults around the rounds, and what it knows:

- **Epochs.** The job's membership (which replica groups are in) changes by numbered *decisions*
  on the job's notice board (`shadowgba.job.notices`), each the first proposal made for its
  number (a compare-and-set in the store), so every rank reads the same history and applies it in
  order. Epoch e is the membership after e decisions; epoch 0 is every group.
- **Who is lost** (`agree`, after a round failed). A round fails on every rank whose collective
  includes the lost one: at once if its process died, after `sync.timeout_s` if it is stopped, or
  through the round's aborted flag if its loop raised (`sync_algos.base`). The evidence is the
  notice board, read by the one rule every rank uses (`shadowgba.job.blame.gone_peers`): ranks
  that posted an abort, and ranks whose heartbeat stopped; the first ranks to ask read it, the
  others their decision (`shadowgba.job.blame.decided_by_lookers`). A group with a lost
  rank is lost as a whole: its all-to-all is broken, so its surviving ranks end too (they raise,
  naming the lost rank). A round that failed without evidence of a lost peer (within a bounded
  search) is no group loss: the original error ends the rank, as under `fail`.
- **Who joins** (`request_join`, `joins_waiting`, `admit`). A replica group launched as a torchrun
  job of its own (`sync.replica_jobs`) that runs again after it was lost (its agent restarted it,
  or the user did) asks to join on the board. Each survivor polls for such a request before its
  rounds and flags what it saw in the round's trailer (`sync_algos.base.JOINING`); after the first
  round in which every rank flagged one, all of them decide the next epoch with the waiting groups
  in, alike, at the same point of their rounds. The joining ranks wait for that decision
  (`wait_to_join`), then meet the survivors in the new epoch's groups, where a survivor's replica
  (dense parameters; table shards with their optimizer state) is broadcast to them (the runtime).
- **The groups of an epoch** (`groups`): the dense round's group over every member rank and this
  rank's replica group over the member groups' ranks at its position. In one job for all groups,
  `dist.new_group`s made by the members alone (`use_local_synchronization`: a lost rank takes no
  part); with a job per group, groups made from the store the jobs share (`shadowgba.groups`). The
  runtime restarts the algorithm there at the members' average (its consensus start): a failed
  round may have left its state unequal, and EASGD's and BMUF's constants follow the rank count.

Nothing a survivor holds is rolled back, and its training thread never waits for any of this: the
rounds are the shadow thread's (foreground mode: the round in the training thread waits).

Invariant: every member applies the same decisions in the same order (`_apply` runs only on a
decision read from the board, never on a proposal of its own that lost), so the members' epochs,
groups and incarnations agree whatever rank proposed what.

Imports: `shadowgba.groups`, `shadowgba.errors` and this package only.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from typing import Sequence

import torch
import torch.distributed as dist

from shadowgba import groups as made_groups
from shadowgba.errors import ConfigError, SetupError, SyncError
from shadowgba.job.blame import DECISION_POLL_S, LOOKERS_PATIENCE_S, decided_by_lookers, found_nothing, gone_peers
from shadowgba.job.notices import HEARTBEAT_SILENT_S, NOTICE_TIMEOUT_S, NoticeBoard
from shadowgba.job.rendezvous import agent_ranks

DECISION = "replica_epoch"
"""The notice board's kind of decision: `{"groups": [...], "lost_ranks": [...], "joined": {...},
"joins": n}` in JSON: the member groups of the next epoch, the ranks found lost so far, the groups
let in by it (group: incarnation), and how many join requests had been made by then."""
JOIN_REQUEST = "replica_join"
"""Board entry per replica group: the incarnation of it that waits to join."""
JOIN_COUNT = "replica_join_count"
"""Board counter: join requests made so far (each joining rank adds one)."""
ENDED = "replica_rounds_ended"
"""Board entry: the members' rounds ended (every one of them closed), so no group can join any more."""
INCARNATION = "replica_incarnation"
"""Board counter per replica group: its process sets so far (a torchrun restart is the next one).
One above the number the members let in means the one they know is gone: evidence of a loss."""
JOIN_POLL_S = 0.5
"""How often a joining rank reads the board for the decision that lets it in."""
MEETING = "replica_meeting"
"""Board counter per set of groups an epoch makes: the member ranks come to make them so far."""
MEETING_LAG_S = LOOKERS_PATIENCE_S + HEARTBEAT_SILENT_S + NOTICE_TIMEOUT_S
"""How far behind another member a rank may legitimately come to a new epoch's groups, whatever
`sync.timeout_s`: a rank that is no looker waits out the lookers (one of them may be in the lost
group, and end before it decides), looks itself (a heartbeat's silence), and reads a busy board
once. A shorter wait for the members would end a survivor whose partner is merely slower to learn
the decision (seen with `sync.timeout_s` 4 on two loaded cores)."""


@dataclasses.dataclass
class ReplicaJobsConfig:
    """A 2D job launched as one torchrun job per replica group (`sync.replica_jobs`), so that a
    group's agent restarts that group alone (`--max-restarts`) and it rejoins the others."""

    store: str | None = None
    """`host:port` of the job's replica store (`python -m shadowgba.replica_store --port P`), a
    process that outlives every group, where the groups meet and keep their notice board. Set, each
    torchrun job is one replica group: its ranks are its sharding group (`sharding_group_size` must
    be its world size), and `group` says which one it is. null: one torchrun job for all groups."""
    group: int = -1
    """Which replica group this torchrun job is (0 ... `num_groups` - 1); its ranks are job-wide
    ranks `group * k ... group * k + k - 1`."""
    num_groups: int = 0
    """How many replica groups the job has (R); the job starts once every group came."""
    name: str = "shadowgba"
    """The job's name in the store: the keys of jobs that share one store do not meet."""
    join_timeout_s: float = 600.0
    """How long a group that runs again (after it was lost) waits to be let in; the members notice
    a dead group within `sync.timeout_s`, and let it in after their next round."""

    def __post_init__(self) -> None:
        if self.store is None:
            return
        host, _, port = self.store.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"replica_jobs.store must be host:port, got {self.store!r}")
        if self.num_groups < 1 or not 0 <= self.group < self.num_groups:
            raise ConfigError(f"replica_jobs: group must be in [0, num_groups) with num_groups >= 1, got group "
                              f"{self.group} of num_groups {self.num_groups}")
        if self.join_timeout_s <= 0:
            raise ConfigError(f"replica_jobs.join_timeout_s must be > 0, got {self.join_timeout_s}")

    @property
    def address(self) -> tuple[str, int]:
        """The store's (host, port)."""
        assert self.store is not None
        host, _, port = self.store.rpartition(":")
        return host, int(port)


def launch_warning(rank: int, group_size: int) -> str | None:
    """Why `sync.on_group_lost: continue` keeps no group going under this launch, said by the first
    worker of each torchrun agent that started ranks of several replica groups of `group_size`
    (one torchrun job for all groups); None otherwise. An agent ends every worker it started once
    one of them fails, the other groups' with it."""
    ranks = agent_ranks()
    if ranks is None or rank != ranks[0] or ranks[0] // group_size == ranks[-1] // group_size:
        return None
    return (f"sync.on_group_lost: continue, but this torchrun agent started ranks {ranks[0]}-{ranks[-1]}, of "
            f"replica groups {ranks[0] // group_size}-{ranks[-1] // group_size}: when one of its ranks fails, the "
            "agent ends every rank it started, the other groups' too, so none trains on. Launch one torchrun agent per "
            "replica group (torchrun --nnodes R --node-rank g --nproc-per-node k) or a torchrun job per group "
            "(sync.replica_jobs)")


class SurvivingGroups:
    """Which replica groups of a 2D job are in it, as every member agrees, and their groups."""

    def __init__(self, trainer_ranks: Sequence[int], rank: int, group_size: int, notices: NoticeBoard,
                 timeout_s: float, store: dist.Store | None = None, device: torch.device | None = None,
                 rejoins: bool = False) -> None:
        """`trainer_ranks`: the job's trainers in order, cut into replica groups of `group_size`
        (`shadowgba.layout`); `rank`: this one's job-wide rank; `notices`: the job's notice board.
        `store`: where the groups of an epoch are made, one that outlives every group: the store
        a torchrun job per replica group shares, or the job's own (`shadowgba.job.store`); None:
        the default group's (`dist.new_group`), where that one outlives every rank. `rejoins`: a
        lost group can come back (a torchrun job per replica group), so the board is read for
        join requests before each round."""
        self.trainer_ranks = tuple(trainer_ranks)
        self.rank = rank
        self.group_size = group_size
        self.notices = notices
        self.timeout_s = timeout_s
        self.store = store
        self.rejoins = rejoins
        self.device = device if device is not None else torch.device("cpu")
        self.members: tuple[int, ...] = tuple(range(len(self.trainer_ranks) // group_size))
        """The replica groups in the job now (indices)."""
        self.lost_ranks: tuple[int, ...] = ()
        """The ranks found lost (dead, stopped, or aborted) that made groups lost."""
        self.joined: dict[int, int] = {}
        """The groups let in by the last decision, with their incarnations."""
        self.incarnations: dict[int, int] = {}
        """Per group let in since the start, the process set let in last (the start's is 1): an older
        request on the board is stale."""
        self.epoch = 0
        """Decisions applied so far: the number of the next one."""
        self.joins_handled = 0
        """Join requests made before the last decision (`JOIN_COUNT`)."""
        self._made = 0
        """Sets of groups made in this epoch (names the next set's store prefix)."""
        self.rejoining = False
        """Whether this rank's group was let in to a running job (`wait_to_join`): it takes a
        member's replica at its start."""

    @property
    def lost(self) -> tuple[int, ...]:
        """The replica groups out of the job now."""
        return tuple(group for group in range(len(self.trainer_ranks) // self.group_size) if group not in self.members)

    def group_of(self, rank: int) -> int:
        """The replica group of job-wide rank `rank`."""
        return self.trainer_ranks.index(rank) // self.group_size

    def survivors(self) -> tuple[int, ...]:
        """The ranks of the member groups, in job order."""
        return tuple(rank for rank in self.trainer_ranks if self.group_of(rank) in self.members)

    def agree(self, error: BaseException, flagged: Sequence[int] = ()) -> None:
        """After a round failed with `error` (or its flags named `flagged` ranks as aborted): take
        the job's next decision, proposing the groups of the lost ranks found on the board as lost
        if none was made yet. Applies that one decision (another member's may have let a group in
        instead: the caller then meets in the next epoch, and a round that fails again comes back
        here). Raises `SyncError` (`error` its cause) when this rank's own group is out, or when no
        lost peer shows up within `timeout_s` (the round failed for another reason), unless groups
        were just let in: then they are taken as lost (they did not meet the members)."""
        peers = [rank for rank in self.survivors() if rank != self.rank]
        deadline = time.monotonic() + self.timeout_s
        decided = None if flagged else decided_by_lookers(self.notices, DECISION, self.epoch)
        while decided is None and (decided := self.notices.decision(DECISION, self.epoch)) is None:
            lost = set(flagged) | set(gone_peers(self.notices, peers).ranks)
            lost |= {rank for rank in peers if self.group_of(rank) in self._renewed()}
            if not lost and time.monotonic() > deadline and self.joined:
                lost = {rank for rank in peers if self.group_of(rank) in self.joined}
            if lost:
                out = {self.group_of(rank) for rank in lost}
                decided = self._decide([group for group in self.members if group not in out],
                                       sorted({*self.lost_ranks, *lost}), {}, self.joins_handled)
                break
            found_nothing(self.notices, DECISION, self.epoch)  # ranks waiting for a looker look too
            if not self.notices.reachable or time.monotonic() > deadline:
                raise SyncError(f"a round failed and no peer is known to be lost (sync.on_group_lost: continue "
                                f"keeps groups going only without a lost rank): {error!r}") from error
        if decided is None:
            raise SyncError(f"rank {self.rank} could not reach the job's store ({self.notices.unreachable_why}) to "
                            f"agree on the lost replica groups after: {error!r}") from error
        self._apply(decided)
        if self.group_of(self.rank) not in self.members:
            raise SyncError(f"{self.describe()}: this rank's group dropped out of the job (sync.on_group_lost: "
                            "continue); the other groups train on") from error

    def _renewed(self) -> set[int]:
        """The member groups whose process set on the board is newer than the one let in: the one
        the members knew is gone (its successor may already have cleared its notices)."""
        counts = {group: self.notices.count(INCARNATION, group) for group in self.members}
        return {group for group, count in counts.items() if count is not None and count > self.incarnations.get(group, 1)}

    def request_join(self, incarnation: int) -> None:
        """Ask to let this rank's group (its `incarnation`-th process set) into the running job (one
        rank of the group asks)."""
        self.notices.post(JOIN_REQUEST, self.group_of(self.rank), str(incarnation))
        if self.notices.count(JOIN_COUNT, add=1) is None:
            raise SetupError(f"replica group {self.group_of(self.rank)} could not reach the replica store to ask to "
                             "rejoin the job")

    def joins_waiting(self) -> bool:
        """Whether a join request came after the last decision (a store read before each round;
        none without `rejoins`, where a lost group's processes cannot come back)."""
        if not self.rejoins:
            return False
        count = self.notices.count(JOIN_COUNT)
        return count is not None and count > self.joins_handled

    def admit(self) -> None:
        """Collective in effect (every member, after the same round): take the job's next decision,
        proposing the groups waiting to join let in if none was made yet (no group waiting, e.g. a
        request of a group the members have not yet found lost: the same members, the request
        counted as handled; it is asked again once that group is out). Applies that one decision,
        whatever it says (another member's may be a loss), so every member stays in the same epoch.
        `SyncError` when the store cannot be reached within `timeout_s`: this rank would fall behind."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            decided = self.notices.decision(DECISION, self.epoch)
            if decided is None:
                count = self.notices.count(JOIN_COUNT)
                waiting = {group: self.notices.read(JOIN_REQUEST, group) for group in self.lost}
                if count is not None and self.notices.reachable:
                    joined = {group: int(incarnation) for group, incarnation in waiting.items()
                              if incarnation is not None and int(incarnation) > self.incarnations.get(group, 1)}
                    lost_ranks = [rank for rank in self.lost_ranks if self.group_of(rank) not in joined]
                    decided = self._decide(sorted({*self.members, *joined}), lost_ranks, joined, count)
            if decided is not None:
                self._apply(decided)
                return
            if time.monotonic() > deadline:
                raise SyncError(f"rank {self.rank} could not reach the replica store within {self.timeout_s:g} s to "
                                "let a waiting replica group in")
            time.sleep(JOIN_POLL_S)

    def mark_ended(self) -> None:
        """The rounds ended on every member (their last round): a group asking to join from now on
        is told so at once instead of waiting for a round that never comes."""
        if self.rejoins:
            self.notices.post(ENDED, 0, str(self.epoch))

    def wait_to_join(self, incarnation: int, timeout_s: float) -> None:
        """A rank of a group that asked to join (`request_join`): replay the job's decisions until
        one lets this group's `incarnation` in. `SetupError` past `timeout_s`, or once the members'
        rounds ended (they finished training: there is nothing left to join)."""
        group, deadline = self.group_of(self.rank), time.monotonic() + timeout_s
        while True:
            decided = self.notices.decision(DECISION, self.epoch)
            if decided is not None:
                self._apply(decided)
                if self.joined.get(group) == incarnation:
                    self.rejoining = True
                    return
                continue
            if self.notices.read(ENDED, 0) is not None:
                raise SetupError(f"replica group {group} asked to join the running job after its other groups had "
                                 f"finished training (groups {list(self.members)}): there is nothing left to join")
            if time.monotonic() > deadline:
                raise SetupError(
                    f"replica group {group} asked to join the running job and was not let in within {timeout_s:g} s "
                    f"(sync.replica_jobs.join_timeout_s): the members are groups {list(self.members)}; a group they "
                    "have not found lost (its old processes still run, or are stopped) cannot join again")
            time.sleep(JOIN_POLL_S)

    def heal_source(self) -> int:
        """After a decision that let groups in: the replica group's index of the member whose
        replica the joining ranks take (the same on every partner of a position): the first group
        that did not just join. Each position's partners take it from that group's rank there."""
        return self.members.index(next(group for group in self.members if group not in self.joined))

    def describe(self) -> str:
        """The losses so far, naming the lost ranks and their groups."""
        ranks = ", ".join(map(str, self.lost_ranks))
        lost = [group for group in self.lost]
        members = [rank for rank in self.trainer_ranks if self.group_of(rank) in lost]
        return (f"rank {ranks} lost (dead, stopped past sync.timeout_s, or its loop raised), so replica group "
                f"{', '.join(map(str, lost))} (ranks {', '.join(map(str, members))}) is out")

    def groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """Collective over the members: (the dense rounds' group of every member rank, this rank's
        replica group over the member groups)."""
        position = self.trainer_ranks.index(self.rank) % self.group_size
        replicas = [rank for rank in self.survivors() if self.trainer_ranks.index(rank) % self.group_size == position]
        self._made += 1
        self._meet()
        if self.store is None:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            dense = dist.new_group(list(self.survivors()), timeout=timeout, use_local_synchronization=True)
            return dense, dist.new_group(replicas, timeout=timeout, use_local_synchronization=True)
        prefix = f"shadowgba/{self.notices.job}/epoch{self.epoch}/set{self._made}"
        dense = made_groups.from_store(self.store, f"{prefix}/dense", self.survivors(), self.rank, self.timeout_s,
                                       self.device)
        replica = made_groups.from_store(self.store, f"{prefix}/replica{position}", replicas, self.rank,
                                         self.timeout_s, self.device)
        return dense, replica

    def _meet(self) -> None:
        """Wait until every member rank has come to make this epoch's next set of groups, for
        `sync.timeout_s` or `MEETING_LAG_S`, whichever is longer; the groups' own making and
        collectives then keep `sync.timeout_s`. `SyncError` when a member does not come (a group let
        in that never started, or a rank lost meanwhile): the next decision's evidence decides."""
        members, wait_s = len(self.survivors()), max(self.timeout_s, MEETING_LAG_S)
        deadline = time.monotonic() + wait_s
        arrived = self.notices.count(f"{MEETING}_{self.epoch}", self._made, add=1)
        while arrived is not None and arrived < members and time.monotonic() < deadline:
            time.sleep(DECISION_POLL_S / 5)
            arrived = self.notices.count(f"{MEETING}_{self.epoch}", self._made)
        if arrived is None:
            raise SyncError(f"rank {self.rank} could not reach the job's store ({self.notices.unreachable_why}) to "
                            f"meet epoch {self.epoch}'s members")
        if arrived < members:
            raise SyncError(f"{arrived} of the {members} member ranks came to make epoch {self.epoch}'s groups within "
                            f"{wait_s:.0f} s")

    def _decide(self, members: Sequence[int], lost_ranks: Sequence[int], joined: dict[int, int],
                joins: int) -> str | None:
        proposal = {"groups": list(members), "lost_ranks": list(lost_ranks),
                    "joined": {str(group): incarnation for group, incarnation in joined.items()}, "joins": joins}
        return self.notices.decide(DECISION, self.epoch, json.dumps(proposal))

    def _apply(self, decided: str) -> None:
        decision = json.loads(decided)
        self.members, self.lost_ranks = tuple(decision["groups"]), tuple(decision["lost_ranks"])
        self.joined = {int(group): incarnation for group, incarnation in decision["joined"].items()}
        self.incarnations.update(self.joined)
        self.joins_handled = max(self.joins_handled, decision["joins"])
        self.epoch += 1
        self._made = 0
