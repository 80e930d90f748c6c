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
- Touched rows only (`touched_rows`, shadow mode): a row that no partner has touched since its last
  average is already equal on every partner (up to the last add's rounding), so a cycle of the
  shadow rounds averages only the rows some partner touched since. A row is touched when a
  training forward looked it up (`shadowgba.shadow.touched`: the fused optimizer updates exactly
  those). At a cycle's start the partners sum their touched-row masks in the fragment buffer, so
  the masks cost 4 bytes a row, about 1/row_numel of a full cycle. The rows some partner touched
  are then packed into fragments in the same order on every partner, and the rounds take them one
  at a time. Zipf-skewed ids touch few rows between two cycles, so a cycle moves those rows and the
  masks, not every table: the cycle's length follows the rows the steps touch. A row touched while
  its cycle is under way keeps that progress (the handoff rule) and is flagged for the next cycle,
  which takes it again. The final sync, a foreground round and the start's broadcast go through
  every row.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from shadowgba.errors import CheckpointError, ConfigError, SetupError
from shadowgba.shadow.touched import TouchedRows, Watch
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
    does by default); false averages the weights alone (a healed row's state then starts afresh)."""
    touched_rows: bool = True
    """Shadow rounds average only the rows some partner touched since their last average (module
    docstring): a cycle's length follows the rows the steps touch, not the tables' size. False: every
    cycle goes through every row, as TorchRec's `DMPCollection.sync()` does."""
    cycle_steps: int = 100
    """Shadow rounds: the bound on a cycle's length, in steps of the fastest rank. After each dense
    round the table rounds average as many fragments as the cycle's rest needs to end within this
    many steps of its start, within `link_mb_per_step` (`shadowgba.shadow.cycle_budget`). Each
    cycle is held to a bound stated at its start: max(cycle_steps, B / link_mb_per_step, its
    fragments at the capacity the link and cores were measured to move, less two standard errors)
    steps plus the widest dense round spacing, the table rounds after a dense round ending within
    half the dense rounds' spacing (the dense rounds come first); the metrics count the cycles that
    overran it. 0: one fragment after each dense round, however long the cycle, no bound stated."""
    link_mb_per_step: float = 4.0
    """Shadow rounds: the byte budget of a rank's replica-group link, in MiB of table fragments per
    step of the fastest rank (a round takes at least one fragment). Caps what `cycle_steps` asks for
    where a cycle is larger than the link should carry in that time. > 0."""

    def __post_init__(self) -> None:
        if self.fragment_mb <= 0:
            raise ConfigError(f"fragment_mb must be > 0, got {self.fragment_mb}")
        if self.cycle_steps < 0:
            raise ConfigError(f"cycle_steps must be >= 0 (0: one fragment a dense round), got {self.cycle_steps}")
        if self.link_mb_per_step <= 0:
            raise ConfigError(f"link_mb_per_step must be > 0, got {self.link_mb_per_step}")


@dataclasses.dataclass(frozen=True)
class TableShard:
    """One table's rows on this rank: row-aligned tensors (weights first, then optimizer state)."""

    name: str
    tensors: tuple[torch.Tensor, ...]
    """What the rounds average."""
    state_left_out: tuple[torch.Tensor, ...] = ()
    """The per-row optimizer state the rounds do not average (`optimizer_state: false`): a heal
    cannot take the partners' and starts it afresh (`TableFragments.restart_state`)."""
    watch: Watch | None = None
    """Where the training forwards that look its rows up are announced (`shadowgba.shadow.touched`);
    None: whoever updates them flags them (`TouchedRows.mark`)."""

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
class Picked:
    """Rows `index` (ascending) of shard `shard`: touched rows, averaged without the others."""

    shard: int
    index: torch.Tensor

    @property
    def count(self) -> int:
        return self.index.numel()


@dataclasses.dataclass(frozen=True)
class Fragment:
    """What one round averages: row ranges of one or more shards (small tables share a fragment,
    a large one is cut into several), or picked rows of them (a touched-rows cycle)."""

    rows: tuple[Rows | Picked, ...]
    closes_cycle: bool = False
    """The last fragment of a touched-rows cycle: once its delta is in, the cycle is done."""

    def numel(self, shards: Sequence[TableShard]) -> int:
        return sum(count(rows) * shards[rows.shard].row_numel for rows in self.rows)


def count(rows: Rows | Picked) -> int:
    return rows.count if isinstance(rows, Picked) else rows.stop - rows.start


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


def pack_picked(shards: Sequence[TableShard], picked: Sequence[torch.Tensor], fragment_numel: int) -> list[Fragment]:
    """Fragments of the rows `picked[i]` (ascending row indices) of each shard `i`, in order, each
    filled up to `fragment_numel` values: what a touched-rows cycle averages."""
    fragments: list[Fragment] = []
    current: list[Rows | Picked] = []
    used = 0
    for index, (shard, rows) in enumerate(zip(shards, picked)):
        width, start = max(shard.row_numel, 1), 0
        while start < rows.numel():
            room = (fragment_numel - used) // width
            if room <= 0 and current:
                fragments.append(Fragment(tuple(current)))
                current, used = [], 0
                continue
            stop = min(rows.numel(), start + max(room, 1))
            current.append(Picked(index, rows[start:stop]))
            used += (stop - start) * width
            start = stop
    if current:
        fragments.append(Fragment(tuple(current)))
    if fragments:
        fragments[-1] = Fragment(fragments[-1].rows, closes_cycle=True)
    return fragments


class TableFragments:
    """This rank's table shards as a rotating fragment: `copy_to` / `add_` at step boundaries (the
    interface `shadowgba.shadow.writeback` moves), `average` on the replica group in between."""

    def __init__(self, shards: Sequence[TableShard], group: dist.ProcessGroup, config: TableSyncConfig) -> None:
        if not shards:
            raise SetupError("no table shards to keep in sync")
        self.shards = list(shards)
        self.device = self.shards[0].tensors[0].device
        self.config = config
        self.fragment_numel = max(1, int(config.fragment_mb * 2**20) // 4)
        self.fragments = plan_fragments(self.shards, self.fragment_numel)
        """The full cycle: every row, in fixed fragments."""
        self.touched = TouchedRows([shard.rows for shard in self.shards], [shard.watch for shard in self.shards],
                                   self.device) if config.touched_rows else None
        """Shadow rounds' touched-rows cycles (None: full cycles)."""
        self.queue: list[Fragment] = []
        """The rest of the touched-rows cycle under way: the next `copy_to` takes its first."""
        self._current: Fragment | None = None
        self.buffer = torch.zeros(max(fragment.numel(self.shards) for fragment in self.fragments),
                                  dtype=torch.float32, device=self.device)
        """The fragment's snapshot, then its delta: one fragment's values, the tail zero."""
        self.allreduce = FlaggedAllReduce(group, self.buffer)
        self.group = group
        self.cursor = -1
        """Index of the last fixed fragment a `copy_to` took."""
        self.applied = 0
        """Fragment deltas added since the start."""
        self.cycles = 0
        """Whole cycles averaged (every row, or every touched row, once)."""
        self.applied_at = [0] * len(self.fragments)
        """Per fragment, the training step at which its last delta was added (0: never)."""
        self.refresh_age_max = 0
        self.refresh_age_total = 0
        self.refreshed = 0
        """Over the run: the steps each fragment had gone unaveraged when it was refreshed, and how
        many refreshes."""

    @property
    def current(self) -> Fragment:
        """The fragment the last `copy_to` took (the one `add_` and `copy_from` write to)."""
        assert self._current is not None, "copy_to() comes first"
        return self._current

    def copy_to(self, flat: torch.Tensor) -> None:
        """Move on to the next fragment (of the touched-rows cycle under way, else of the full
        cycle) and copy its rows into `flat` (the tail zeroed)."""
        if self.queue:
            self._current = self.queue.pop(0)
        else:
            self.cursor = (self.cursor + 1) % len(self.fragments)
            self._current = self.fragments[self.cursor]
        used = 0
        for tensor, rows, part in self._parts(flat):
            if isinstance(rows, Picked) and tensor.dtype == part.dtype:
                torch.index_select(tensor, 0, rows.index, out=part)
            elif isinstance(rows, Picked):  # a half-precision table: its rows converted on the way
                part.copy_(tensor.index_select(0, rows.index))
            else:
                part.copy_(tensor[rows.start:rows.stop])
            used += part.numel()
        flat[used:].zero_()

    def add_(self, flat_delta: torch.Tensor) -> None:
        """Rows of the current fragment += their part of `flat_delta`."""
        for tensor, rows, part in self._parts(flat_delta):
            if isinstance(rows, Picked):
                tensor.index_add_(0, rows.index, part.to(tensor.dtype))
            else:
                tensor[rows.start:rows.stop].add_(part)

    def copy_from(self, flat: torch.Tensor) -> None:
        """Rows of the current fragment <- their part of `flat` (the final sync, a heal: exact,
        not a delta)."""
        for tensor, rows, part in self._parts(flat):
            if isinstance(rows, Picked):
                tensor.index_copy_(0, rows.index, part.to(tensor.dtype))
            else:
                tensor[rows.start:rows.stop].copy_(part)

    def restart_state(self) -> None:
        """The current fragment's rows were healed: their optimizer state that the rounds leave out
        (`TableShard.state_left_out`) becomes a new fused optimizer's (zero). It is what the steps
        that diverged left there (NaN, or finite but exploded), and would turn the healed rows NaN
        again at their next update, round after round."""
        for rows in self.current.rows:
            for tensor in self.shards[rows.shard].state_left_out:
                if isinstance(rows, Picked):
                    tensor.index_fill_(0, rows.index, 0.0)
                else:
                    tensor[rows.start:rows.stop].zero_()

    def _parts(self, flat: torch.Tensor) -> list[tuple[torch.Tensor, Rows | Picked, torch.Tensor]]:
        """The current fragment's (tensor, rows) pieces, each with its part of `flat` (row-major)."""
        parts, offset = [], 0
        for rows in self.current.rows:
            for tensor in self.shards[rows.shard].tensors:
                shape = (count(rows), *tensor.shape[1:])
                numel = shape[0] * (tensor[0].numel() if tensor.dim() > 1 else 1)
                parts.append((tensor, rows, flat[offset:offset + numel].view(shape)))
                offset += numel
        return parts

    def plan_touched_cycle(self) -> Reduced | None:
        """Collective on the replica group (the shadow thread, between rounds): sum every partner's
        touched-row masks, a fragment buffer's worth of rows at a time, and queue the rows any of
        them touched as the next cycle's fragments (the same on every partner: the sum is). Rows
        looked up meanwhile are flagged for the next cycle. Returns the reduction that flagged an
        aborted partner (the planning stops there, the queue stays empty and the rows it took go
        to the next planning), else None."""
        assert self.touched is not None
        picked: list[list[torch.Tensor]] = [[] for _ in self.shards]
        payload, start = self.allreduce.payload, 0
        self.touched.take()
        while start < self.touched.rows:
            covered = self.touched.mask(payload, start)
            reduced = self.allreduce.sum(payload, stop=False, exact=True)
            if reduced.aborted_ranks:
                self.touched.put_back()
                return reduced
            self.touched.picked(reduced.total[:covered], start, picked)
            start += covered
        self.touched.drop()
        rows = [torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=self.device) for parts in picked]
        self.queue = pack_picked(self.shards, rows, self.fragment_numel)
        return None

    @property
    def mask_bytes(self) -> int:
        """Bytes this rank sends to sum a cycle's touched-row masks (`plan_touched_cycle`)."""
        assert self.touched is not None
        windows = -(-self.touched.rows // self.allreduce.payload.numel())
        return windows * self.allreduce.bytes_per_call

    def start_full_cycle(self) -> None:
        """Drop what is left of a touched-rows cycle: the next `copy_to`s go through every row (the
        final sync)."""
        self.queue = []

    def regroup(self, group: dist.ProcessGroup) -> None:
        """Average over `group` from now on: the replica group's survivors (`shadowgba.job.survivors`)."""
        self.group = group
        self.allreduce = FlaggedAllReduce(group, self.buffer)

    def restart_rotation(self) -> None:
        """Start the cycle over from its first fragment, with no touched-rows cycle under way: where
        partners that did not share a history (a replica group that rejoined) agree to stand. The
        rows of the cycle dropped (the fragment in flight included) go to the next one."""
        if self.touched is not None:
            for fragment in ([self._current] if self._current is not None else []) + self.queue:
                for rows in fragment.rows:
                    if isinstance(rows, Picked):
                        self.touched.mark(rows.shard, rows.index)
        self.queue = []
        self.cursor = -1

    def check_partners(self) -> None:
        """Collective on the replica group: `SetupError` unless every partner holds the same cycle
        (fragment count and sizes), as the same plan in every group gives; partners that differ
        would exchange rows of different tables."""
        shape = torch.tensor([len(self.fragments), self.numel, self.buffer.numel()], dtype=torch.float64,
                             device=self.device)
        both = torch.cat([shape, -shape])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        if not torch.equal(both[:3], -both[3:]):
            raise SetupError(
                f"the table shards of this rank's replica group differ (fragments, values, buffer from "
                f"{(-both[3:]).long().tolist()} to {both[:3].long().tolist()}, this rank {shape.long().tolist()}): "
                "every replica group must shard the same tables with the same plan")

    def broadcast_(self, source: int = 0) -> None:
        """Collective on the replica group: every partner's rows and optimizer state become those
        of the group's rank `source`, a fragment at a time (the buffer's memory, not a table's). The
        runtime's start: replicas that begin apart would be averaged into rows none of them trained
        with; a replica group that rejoins takes a member's. Starts the rotation over
        (`restart_rotation`), as the members that send do."""
        self.check_partners()
        self.restart_rotation()
        for _ in self.fragments:
            self.copy_to(self.buffer)
            dist.broadcast(self.buffer, group_src=source, group=self.group)
            self.copy_from(self.buffer)
        if self.touched is not None:
            self.touched.clear()

    def mark_applied(self, step: int) -> None:
        """The current fragment's delta reached the rows at training step `step`. A fixed fragment
        is then refreshed; with the last fragment of a touched-rows cycle, every fragment is (the
        rows nobody touched were equal already)."""
        self.applied += 1
        touched_cycle = any(isinstance(rows, Picked) for rows in self.current.rows)
        if touched_cycle and not self.current.closes_cycle:
            return
        for index in range(len(self.fragments)) if touched_cycle else (self.cursor,):
            age = step - self.applied_at[index]
            self.refresh_age_max = max(self.refresh_age_max, age)
            self.refresh_age_total += age
            self.applied_at[index] = step
            self.refreshed += 1
        if touched_cycle or self.cursor == len(self.fragments) - 1:
            self.cycles += 1

    def ages(self, step: int) -> tuple[int, float]:
        """Steps since each fragment's last delta at training step `step`: the oldest and the mean."""
        ages = [step - applied for applied in self.applied_at]
        return max(ages), sum(ages) / len(ages)

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
                "cycles": self.cycles, "applied_at": list(self.applied_at)}

    def check_state(self, state: Any) -> None:
        """`ValueError` unless `state` is a `state_dict()` of this cycle (it changes nothing)."""
        if not isinstance(state, Mapping) or state.get("fragments") != len(self.fragments):
            found = state.get("fragments") if isinstance(state, Mapping) else type(state).__name__
            raise CheckpointError(f"table state is for a cycle of {found} fragments, this job's has {len(self.fragments)} "
                             "(other tables, shards or sync.tables.fragment_mb)")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()` output; `ValueError` (changing nothing) for another cycle."""
        self.check_state(state)
        if self.touched is not None:  # the rows come from a checkpoint: partners' may differ anywhere
            self.touched.mark_all()
        self.cursor, self.applied, self.applied_at = int(state["cursor"]), int(state["applied"]), list(state["applied_at"])
        self.cycles = int(state.get("cycles", self.applied // len(self.fragments)))

    @property
    def numel(self) -> int:
        """Table values (weights and state) this rank keeps in sync."""
        return sum(shard.rows * shard.row_numel for shard in self.shards)

    def held(self) -> dict[str, torch.Tensor]:
        """The buffers this object holds of its own (`SyncMetrics.memory`)."""
        held = {"table_fragment": self.buffer, "table_allreduce": self.allreduce.buffer}
        return held | (self.touched.held() if self.touched is not None else {})

    def close(self) -> None:
        """Stop watching the tables' lookups (the runtime ended)."""
        if self.touched is not None:
            self.touched.close()
