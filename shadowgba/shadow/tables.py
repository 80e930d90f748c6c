"""Table replicas in the background: the table shards a rank holds, averaged with the ranks holding
the same shards in the other replica groups, one bounded fragment at a time.

In a 2D job (`shadowgba.layout`) each rank holds some shards of the embedding tables, and the rank
at the same position of every other replica group holds replicas of the same shards. They drift
apart as each group trains on its own data; this module brings them back together, as TorchRec's
`DMPCollection.sync()` does, but in the shadow thread and without a second copy of the tables:

- A shard is a set of *row-aligned* tensors: the weights and each per-row optimizer state (row-wise
  Adagrad's sum, Adam's moments ...) of one table's rows on this rank, views into the fused
  kernel's own storage (`shadowgba.integrations.torchrec.fused_table_shards`).
- A *fragment* is up to `fragment_mb` of rows across their tensors: a range of rows of a large
  shard, or several small shards whole.
  The fragments of all shards, in order, form the *cycle*; partners enumerate the same shards in the
  same order (the plan is the same in every group), so fragment i names the same rows everywhere.
- A round averages one fragment: the training thread copies its rows into a fragment buffer at a
  step boundary (`copy_to`, which moves on to the next fragment), the shadow thread all-reduces the
  buffer on the replica group and turns it into the delta `avg - s`, and the training thread adds
  that delta to the same rows at a later step boundary (`add_`): the handoff rule
  `w <- w + (t - s)` of the dense parameters, so rows trained while the round was in flight keep
  that progress. The fused optimizer writes the rows inside backward, so they are never read or
  written mid-step.
- Memory: the fragment buffer and the all-reduce buffer (one fragment each, plus the flags), and
  nothing that grows with the tables. MA is the rule for tables whatever `sync.algo` says: EASGD's
  centre or BMUF's global model and momentum would each hold a full copy of every table.
- Non-finite rows: the flagged all-reduce (`sync_algos.base`) leaves a fragment holding NaN / Inf
  out of the average on every partner alike and the rank that sent it keeps its own rows, so NaN in
  one replica never reaches another.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from sync_algos.base import FlaggedAllReduce, Reduced


@dataclasses.dataclass
class TableSyncConfig:
    """How table replicas are kept in sync in a 2D job (`sync.sharding_group_size` > 0)."""

    fragment_mb: float = 4.0
    """Most MiB of table rows (weights plus their optimizer state, as float32) one round averages:
    the bound on the extra memory (this fragment and its all-reduce buffer) and on one round's
    traffic. Shadow mode averages one fragment per round; a foreground round and the final sync go
    through the whole cycle. > 0."""
    optimizer_state: bool = True
    """Average the fused optimizer's per-row state with the weights (as `DMPCollection.sync()`
    does by default); false averages the weights alone."""

    def __post_init__(self) -> None:
        if self.fragment_mb <= 0:
            raise ValueError(f"fragment_mb must be > 0, got {self.fragment_mb}")


@dataclasses.dataclass(frozen=True)
class TableShard:
    """One table's rows on this rank: row-aligned tensors (weights first, then optimizer state)."""

    name: str
    tensors: tuple[torch.Tensor, ...]

    @property
    def rows(self) -> int:
        return self.tensors[0].shape[0]

    @property
    def row_numel(self) -> int:
        """Values per row across the tensors."""
        return sum(tensor[0].numel() if tensor.dim() > 1 else 1 for tensor in self.tensors)


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows `start:stop` of shard `shard`."""

    shard: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Fragment:
    """What one round averages: row ranges of one or more shards (small tables share a fragment,
    a large one is cut into several)."""

    rows: tuple[Rows, ...]

    def numel(self, shards: Sequence[TableShard]) -> int:
        return sum((rows.stop - rows.start) * shards[rows.shard].row_numel for rows in self.rows)


def plan_fragments(shards: Sequence[TableShard], fragment_numel: int) -> list[Fragment]:
    """The cycle: every row of every shard in exactly one fragment, the shards' rows in order, each
    fragment filled up to `fragment_numel` values (a row larger than that is a fragment of its own),
    so a round moves a full fragment however small the tables are."""
    fragments: list[Fragment] = []
    current: list[Rows] = []
    used = 0
    for index, shard in enumerate(shards):
        width, start = max(shard.row_numel, 1), 0
        while start < shard.rows:
            room = (fragment_numel - used) // width
            if room <= 0 and current:  # full: the next rows start a new fragment
                fragments.append(Fragment(tuple(current)))
                current, used = [], 0
                continue
            stop = min(shard.rows, start + max(room, 1))
            current.append(Rows(index, start, stop))
            used += (stop - start) * width
            start = stop
    if current:
        fragments.append(Fragment(tuple(current)))
    return fragments


class TableFragments:
    """This rank's table shards as a rotating fragment: `copy_to` / `add_` at step boundaries (the
    interface `shadowgba.shadow.writeback` moves), `average` on the replica group in between."""

    def __init__(self, shards: Sequence[TableShard], group: dist.ProcessGroup, config: TableSyncConfig) -> None:
        if not shards:
            raise ValueError("no table shards to keep in sync")
        self.shards = list(shards)
        self.device = self.shards[0].tensors[0].device
        self.fragments = plan_fragments(self.shards, max(1, int(config.fragment_mb * 2**20) // 4))
        self.buffer = torch.zeros(max(fragment.numel(self.shards) for fragment in self.fragments),
                                  dtype=torch.float32, device=self.device)
        """The fragment's snapshot, then its delta: one fragment's values, the tail zero."""
        self.allreduce = FlaggedAllReduce(group, self.buffer)
        self.group = group
        self.cursor = -1
        """Index of the fragment the last `copy_to` took (the one `add_` writes to)."""
        self.applied = 0
        """Fragment deltas added since the start (`cycles`)."""
        self.applied_at = [0] * len(self.fragments)
        """Per fragment, the training step at which its last delta was added (0: never)."""
        self.refresh_age_max = 0
        self.refresh_age_total = 0
        """Over the run: the steps each fragment had gone unaveraged when its delta was added."""

    @property
    def current(self) -> Fragment:
        return self.fragments[self.cursor]

    def _pieces(self, fragment: Fragment) -> list[torch.Tensor]:
        return [tensor[rows.start:rows.stop] for rows in fragment.rows for tensor in self.shards[rows.shard].tensors]

    def copy_to(self, flat: torch.Tensor) -> None:
        """Move on to the next fragment and copy its rows into `flat` (the tail zeroed)."""
        self.cursor = (self.cursor + 1) % len(self.fragments)
        used = 0
        for piece, part in self._parts(flat):
            part.copy_(piece)
            used += part.numel()
        flat[used:].zero_()

    def add_(self, flat_delta: torch.Tensor) -> None:
        """Rows of the current fragment += their part of `flat_delta`."""
        for piece, part in self._parts(flat_delta):
            piece.add_(part)

    def copy_from(self, flat: torch.Tensor) -> None:
        """Rows of the current fragment <- their part of `flat` (the final sync: exact, not a delta)."""
        for piece, part in self._parts(flat):
            piece.copy_(part)

    def _parts(self, flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The current fragment's row pieces, each with its part of `flat`."""
        parts, offset = [], 0
        for piece in self._pieces(self.current):
            parts.append((piece, flat[offset:offset + piece.numel()].view_as(piece)))
            offset += piece.numel()
        return parts

    def regroup(self, group: dist.ProcessGroup) -> None:
        """Average over `group` from now on: the replica group's survivors (`shadowgba.shadow.survival`)."""
        self.group = group
        self.allreduce = FlaggedAllReduce(group, self.buffer)

    def broadcast_(self) -> None:
        """Collective on the replica group: every partner's rows and optimizer state become the
        group's first rank's, a fragment at a time (the buffer's memory, not a table's). The
        runtime's start: replicas that begin apart would be averaged into rows none of them trained
        with. Leaves the rotation where it was."""
        src = dist.get_process_group_ranks(self.group)[0]
        for _ in self.fragments:
            self.copy_to(self.buffer)
            dist.broadcast(self.buffer, src=src, group=self.group)
            self.copy_from(self.buffer)

    def mark_applied(self, step: int) -> None:
        """The current fragment's delta reached the rows at training step `step`."""
        age = step - self.applied_at[self.cursor]
        self.refresh_age_max = max(self.refresh_age_max, age)
        self.refresh_age_total += age
        self.applied += 1
        self.applied_at[self.cursor] = step

    def ages(self, step: int) -> tuple[int, float]:
        """Steps since each fragment's last delta at training step `step`: the oldest and the mean."""
        ages = [step - applied for applied in self.applied_at]
        return max(ages), sum(ages) / len(ages)

    @property
    def cycles(self) -> int:
        """Whole cycles of fragments averaged (every row once per cycle)."""
        return self.applied // len(self.fragments)

    def average(self, snapshot: torch.Tensor, delta: bool = True) -> Reduced:
        """Collective on the replica group: `snapshot` (a `copy_to` result) becomes the delta
        `avg - s` of the finite partners' fragments, or zero when this rank's was left out; with
        `delta=False`, the average itself (the final sync assigns it: `s + (avg - s)` is `avg` only
        up to rounding, which would leave the replicas apart by an ulp). A fragment left out for NaN
        / Inf while a partner's counted (`Reduced.heals`) gets the average itself too: its rows and
        their optimizer state become the partners', whatever `delta` says."""
        reduced = self.allreduce.sum(snapshot, stop=False)
        mean = reduced.mean_()
        if reduced.own_counted and mean is not None and delta:
            torch.sub(mean, snapshot, out=snapshot)
        elif (reduced.own_counted or reduced.heals) and mean is not None:
            snapshot.copy_(mean)
        else:
            snapshot.zero_()
        return reduced

    def state_dict(self) -> dict[str, Any]:
        """Where the rotation stands (the fragment count names the cycle it belongs to)."""
        return {"fragments": len(self.fragments), "cursor": self.cursor, "applied": self.applied,
                "applied_at": list(self.applied_at)}

    def check_state(self, state: Any) -> None:
        """`ValueError` unless `state` is a `state_dict()` of this cycle (it changes nothing)."""
        if not isinstance(state, Mapping) or state.get("fragments") != len(self.fragments):
            found = state.get("fragments") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"table state is for a cycle of {found} fragments, this job's has {len(self.fragments)} "
                             "(other tables, shards or sync.tables.fragment_mb)")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()` output; `ValueError` (changing nothing) for another cycle."""
        self.check_state(state)
        self.cursor, self.applied, self.applied_at = int(state["cursor"]), int(state["applied"]), list(state["applied_at"])

    @property
    def numel(self) -> int:
        """Table values (weights and state) this rank keeps in sync."""
        return sum(shard.rows * shard.row_numel for shard in self.shards)

    def held(self) -> dict[str, torch.Tensor]:
        """The buffers this object holds of its own (`SyncMetrics.memory`)."""
        return {"table_fragment": self.buffer, "table_allreduce": self.allreduce.buffer}
