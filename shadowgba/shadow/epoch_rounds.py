"""The shadow rounds' side of the surviving replica groups (`EpochRounds`, held by `ShadowSync` in a 2D
job under `sync.on_group_lost: continue`).

The job's package decides who is in the job (`shadowgba.job.survivors.SurvivingGroups`: epochs,
losses, joins); this module acts on those decisions in the rounds: after a failed round, the job's
decision on who is lost and the rounds rebuilt over the survivors; after a round in which every
rank saw a group waiting to join, the decision that lets it in, and the heal that gives the joining
ranks a member's replica.

Invariants:
- Runs on the thread that runs the rounds (the shadow thread, or the training thread in
  foreground mode), never beside a round: the runtime's group is swapped only through `regroup`,
  under the runtime's round lock.
- Every member enters the same epoch after the same round (the decisions are read from the board,
  `SurvivingGroups._apply`), so the new groups' collectives pair up; a decision that changed no
  member makes no group.
- The runtime's state reaches this object only through its constructor's arguments (its write-backs,
  snapshot buffer, table fragments, metrics, and `regroup`): nothing here reads its private attributes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from shadowgba import groups as made_groups
from shadowgba.errors import SyncError
from shadowgba.job.survivors import SurvivingGroups
from shadowgba.metrics import SyncMetrics
from shadowgba.shadow.flags import PeersAborted
from shadowgba.shadow.tables import TableFragments
from shadowgba.shadow.writeback import WriteBack, wait_for_device

logger = logging.getLogger("shadowgba")


@dataclasses.dataclass
class EpochRounds:
    """The rounds' side of the epochs (see the module docstring)."""

    survival: SurvivingGroups
    """The job's decisions on the member groups."""
    metrics: SyncMetrics
    """The runtime's metrics, where losses and joins are counted."""
    aborting: threading.Event
    """Set while this rank aborts: a failed round is then no group loss."""
    writeback: WriteBack
    """The dense replica's write-back: a heal snapshots through it, at a step boundary."""
    snapshot: torch.Tensor
    """The buffer a round snapshots the dense replica into; a heal broadcasts it."""
    tables: TableFragments | None
    """The table shards (None outside a job with table replicas)."""
    table_writeback: WriteBack | None
    """Their write-back."""
    regroup: Callable[[dist.ProcessGroup], dist.ProcessGroup]
    """The runtime's rounds move to the given group (the algorithm restarted there at the members'
    average); returns the group they ran on."""

    def admit(self) -> None:
        """After a round in which every rank saw a replica group waiting to join: take the job's
        next decision (`SurvivingGroups.admit`) and meet in its epoch (`enter_epoch`)."""
        before = self.survival.members
        self.survival.admit()
        self.enter_epoch(before)

    def run(self, run_round: Callable[[], bool]) -> bool:
        """`run_round()` (True: the rounds end); a round that failed (a collective's error, or peers'
        aborted flags: `PeersAborted`) is followed by the job's decision on which replica groups are
        lost and the rounds rebuilt over the survivors (False: they go on), unless this rank's group
        is lost or no lost peer is found: then the error is raised, as without survivors. Meeting in
        the new epoch can fail too (a decision read here may have let in a group that does not come,
        or another rank was lost meanwhile): each failure takes the next decision, one per group at most."""
        try:
            return run_round()
        except Exception as error:
            if self.aborting.is_set():
                raise
            failure: BaseException = error
            flagged = error.ranks if isinstance(error, PeersAborted) else ()
        survival = self.survival
        for _ in range(len(survival.trainer_ranks) // survival.group_size):
            before = survival.members
            survival.agree(failure, flagged)
            try:
                self.enter_epoch(before)
                return False
            except Exception as error:  # noqa: BLE001 - the next decision's evidence decides
                failure, flagged = error, ()
        raise SyncError(f"the rounds could not meet in a new epoch after {failure!r}") from failure

    def enter_epoch(self, before: tuple[int, ...]) -> None:
        """After the job's next decision changed the member groups from `before`: meet in the new
        epoch's groups (`SurvivingGroups.groups`) and restart the rounds there at the members'
        average (`regroup`: the consensus start; a failed round may have left the algorithm's state
        unequal, and EASGD's and BMUF's constants follow the rank count). Groups let in take a
        replica first, on each position's replica group (`heal`). The old groups are released."""
        survival = self.survival
        if survival.members == before:
            return  # a decision that changed nobody (a join request counted, nobody waiting)
        started = time.perf_counter()
        dense, replica = survival.groups()
        old_groups = []
        if self.tables is not None:
            old_groups.append(self.tables.group)
            self.tables.regroup(replica)
        if survival.joined:
            self.heal(replica, survival.heal_source())
        old_groups.insert(0, self.regroup(dense))
        for group in old_groups:
            made_groups.release(group)
        lost = [group for group in before if group not in survival.members]
        self.metrics.record_groups_lost(len(lost))
        self.metrics.record_groups_joined(len(survival.joined))
        if lost:
            logger.warning("shadowgba: %s; the rounds go on over ranks %s, from their average", survival.describe(),
                           ", ".join(map(str, survival.survivors())))
        if survival.joined:
            logger.warning("shadowgba: replica group %s rejoined (epoch %d) and took the replica of group %s in %.1f s; "
                           "the rounds go on over ranks %s, from their average", ", ".join(map(str, survival.joined)),
                           survival.epoch, survival.members[survival.heal_source()], time.perf_counter() - started,
                           ", ".join(map(str, survival.survivors())))

    def heal(self, replica: dist.ProcessGroup, source: int) -> None:
        """A member's side of a joining group's heal, collective on this rank's new replica group
        (the joining rank's side is `ShadowSync.start()`): the replica group's rank `source` broadcasts
        its dense weights, then its table shards with their optimizer state a fragment at a time, every
        partner having checked that all hold the same cycle and started the rotation over. Members
        snapshot at step boundaries, as a round does (a pending delta is applied first), and keep
        their own. `SyncError` if this rank is aborting meanwhile (its partners' next round learns
        why)."""
        if not self.writeback.snapshot(self.snapshot):
            raise SyncError("this rank is aborting: it leaves the heal of a joining replica group")
        dist.broadcast(self.snapshot, group_src=source, group=replica)
        wait_for_device(self.snapshot.device)  # the buffer is the next round's: the broadcast must be done
        if self.tables is None or self.table_writeback is None:
            return
        self.tables.check_partners()
        if not self.table_writeback.snapshot(self.tables.buffer):  # a pending delta lands, at its fragment
            raise SyncError("this rank is aborting: it leaves the heal of a joining replica group")
        self.tables.restart_rotation()
        for _ in self.tables.fragments:
            if not self.table_writeback.snapshot(self.tables.buffer):
                raise SyncError("this rank is aborting: it leaves the heal of a joining replica group")
            dist.broadcast(self.tables.buffer, group_src=source, group=replica)
            wait_for_device(self.tables.device)
