"""Replica groups that survive each other (the 2D layout under `sync.on_group_lost: continue`).

A 2D job's replica groups depend on each other only through the shadow rounds: a group's training
step (TorchRec's all-to-all) pairs its own k ranks and no others, and every group holds a full
replica of the tables and the dense parameters. So when a rank is lost, only its own group has to
end; the others can go on, with the rounds rebuilt over the survivors. `SurvivingGroups` is what
a rank consults when a round failed, and what it knows afterwards:

- **Who is lost** (`agree`). A round fails on every rank whose collective includes the lost one: at
  once if its process died, after `sync.timeout_s` if it is stopped, or through the round's
  aborted flag if its loop raised (`sync_algos.base`). The evidence is the job's notice board
  (`shadowgba.ps.membership`): ranks that posted an abort, and ranks whose heartbeat stopped. A
  group with a lost rank is lost as a whole: its all-to-all is broken, so its surviving ranks end
  too (they raise, naming the lost rank).
- **The same answer everywhere.** Ranks see the evidence at different moments, so the decision is
  the first proposal made for this generation of the membership, a compare-and-set in the job's
  store (`NoticeBoard.decide`), which every survivor reads; a rank whose own group is in it ends.
  Decisions are cumulative and numbered: a second loss is decision 1, and so on. A round that
  failed without evidence of a lost peer (within a bounded search) is no group loss: the original
  error ends the rank, as under `fail`.
- **The groups after** (`groups`): the dense round's group over every surviving rank and this
  rank's replica group over the surviving groups' ranks at its position, made by the survivors
  alone (`use_local_synchronization`: a lost rank takes no part). The runtime restarts the
  algorithm there at the survivors' average (its consensus start): a failed round may have left
  its state unequal, and EASGD's and BMUF's constants follow the rank count.

Nothing a survivor holds is rolled back, and its training thread never waits for any of this: the
rounds are the shadow thread's (foreground mode: the round in the training thread waits).
"""

from __future__ import annotations

import datetime
import json
import time
from typing import TYPE_CHECKING, Sequence

import torch.distributed as dist

from shadowgba.errors import SyncError

if TYPE_CHECKING:
    from shadowgba.ps.membership import NoticeBoard

DECISION = "groups_lost"
"""The notice board's kind of decision: `{"groups": [...], "ranks": [...]}` in JSON, the replica
groups lost so far and the ranks found lost in them."""


class SurvivingGroups:
    """Which replica groups of a 2D job are still in it, as every survivor agrees, and their groups."""

    def __init__(self, trainer_ranks: Sequence[int], rank: int, group_size: int, notices: NoticeBoard,
                 timeout_s: float) -> None:
        """`trainer_ranks`: the job's trainers in order, cut into replica groups of `group_size`
        (`shadowgba.layout`); `rank`: this one's global rank; `notices`: the job's notice board."""
        self.trainer_ranks = tuple(trainer_ranks)
        self.rank = rank
        self.group_size = group_size
        self.notices = notices
        self.timeout_s = timeout_s
        self.lost: tuple[int, ...] = ()
        """The replica groups lost so far (indices), as the job decided."""
        self.lost_ranks: tuple[int, ...] = ()
        """The global ranks found lost (dead, stopped, or aborted) that made those groups lost."""
        self.decisions = 0
        """Decisions taken so far: the number of the next one."""

    def group_of(self, rank: int) -> int:
        """The replica group of global rank `rank`."""
        return self.trainer_ranks.index(rank) // self.group_size

    def survivors(self) -> tuple[int, ...]:
        """The global ranks of the groups not lost."""
        return tuple(rank for rank in self.trainer_ranks if self.group_of(rank) not in self.lost)

    def agree(self, error: BaseException, flagged: Sequence[int] = ()) -> tuple[int, ...]:
        """After a round failed with `error` (or its flags named `flagged` global ranks as aborted):
        the replica groups the job now takes as lost, besides those before. Raises `SyncError`
        (`error` its cause) when this rank's own group is among them, or when no lost peer shows up
        on the notice board within `timeout_s` (the round failed for another reason)."""
        peers = [rank for rank in self.survivors() if rank != self.rank]
        deadline = time.monotonic() + self.timeout_s
        while (decided := self.notices.decision(DECISION, self.decisions)) is None:
            lost = set(flagged) | set(self.notices.aborted_peers(peers)) | set(self.notices.silent_peers(peers))
            if lost:
                proposal = {"groups": sorted({*self.lost, *(self.group_of(rank) for rank in lost)}),
                            "ranks": sorted({*self.lost_ranks, *lost})}
                decided = self.notices.decide(DECISION, self.decisions, json.dumps(proposal))
                break
            if not self.notices.reachable or time.monotonic() > deadline:
                raise SyncError(f"a round failed and no peer is known to be lost (sync.on_group_lost: continue "
                                f"keeps groups going only without a lost rank): {error!r}") from error
        if decided is None:
            raise SyncError(f"rank {self.rank} could not reach the job's store to agree on the lost replica "
                            f"groups after: {error!r}") from error
        before, decision = self.lost, json.loads(decided)
        self.lost, self.lost_ranks = tuple(decision["groups"]), tuple(decision["ranks"])
        self.decisions += 1
        if self.group_of(self.rank) in self.lost:
            raise SyncError(f"{self.describe()}: this rank's group dropped out of the job (sync.on_group_lost: "
                            "continue); the other groups train on") from error
        return tuple(group for group in self.lost if group not in before)

    def describe(self) -> str:
        """The losses so far, naming the lost ranks and their groups."""
        ranks = ", ".join(map(str, self.lost_ranks))
        members = [rank for rank in self.trainer_ranks if self.group_of(rank) in self.lost]
        return (f"rank {ranks} lost (dead, stopped past sync.timeout_s, or its loop raised), so replica group "
                f"{', '.join(map(str, self.lost))} (ranks {', '.join(map(str, members))}) is out")

    def groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """Collective over the survivors: (the dense rounds' group of every surviving rank, this rank's
        replica group over the surviving groups)."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        position = self.trainer_ranks.index(self.rank) % self.group_size
        replicas = [rank for rank in self.survivors() if self.trainer_ranks.index(rank) % self.group_size == position]
        dense = dist.new_group(list(self.survivors()), timeout=timeout, use_local_synchronization=True)
        return dense, dist.new_group(replicas, timeout=timeout, use_local_synchronization=True)
