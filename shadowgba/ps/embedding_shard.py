"""A parameter server's shard of the PS-hosted embedding tables (`shadowgba.ps.embedding` is the
trainers' side, behind TorchRec's EmbeddingBagCollection API).

Tables are row-sharded: row `id` lives on server `id % num_servers`, at local row `id // num_servers`.

A shard (`EmbeddingShard`) holds one lock; the transport's server threads call it concurrently. Every request is
validated completely before anything changes (a `ValueError` "push refused: ..." names the table and
the problem), so a refused request leaves the shard untouched, across all its tables. Modes:
- hogwild: a push is applied on arrival (duplicate ids summed), racing with other trainers' pushes
  at the granularity of whole pushes.
- aggregate (GBA): the dense GBA shards' rule, `sync_algos.gba.GlobalBatchRule`, on each shard's
  own global step k (its applied updates). A lookup returns k as its token, and the push of the
  gradients computed on those rows carries it back; the rule refuses a token from the future and
  weighs the push by its staleness (`config.decay`: GBA's `sync.gba.row_decay`, by default full
  weight up to its `max_staleness`). A kept push adds `weight * num_samples * grad` to a sparse
  buffer per table (the touched rows and their sums, so memory is bounded by the rows touched in
  one global batch); a dropped one (weight 0) changes nothing but the counters. Once `global_batch`
  samples have arrived the buffer divided by those samples, the sample-weighted mean of the pushed
  gradients, is applied once, the buffer cleared and k advanced.
"""

from __future__ import annotations

import dataclasses
import threading
import zlib
from typing import Literal, Mapping, Sequence

import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, pooling_type_to_str

from shadowgba.errors import CheckpointError, ConfigError, SetupError, SyncError
from shadowgba.job.roster import Roster
from shadowgba.nonfinite import DEFAULT_ON_NONFINITE, nonfinite_failure
from sync_algos.base import all_finite, is_finite
from sync_algos.gba import AggregationConfig, Admission, GlobalBatchRule
from sync_algos.staleness import StalenessCounts, StalenessDecayConfig

DEFAULT_SERVICE = "embedding"
"""Service name under which servers serve their `EmbeddingShard` unless told otherwise."""

RowsByTable = Mapping[str, tuple[torch.Tensor, torch.Tensor]]
"""Per table name: (global row ids, one row of values or gradients per id)."""


@dataclasses.dataclass
class PSEmbeddingConfig:
    """How PS-hosted embedding tables are initialised and updated."""

    optimizer: Literal["sgd", "rowwise_adagrad"] = "sgd"
    """Row update on the servers. sgd: w -= lr * g. rowwise_adagrad: one accumulator a per row
    (starting at 0), a += mean(g^2) over the row, w -= lr * g / (sqrt(a) + eps), as TorchRec's
    (fbgemm's) row-wise Adagrad without weight decay."""
    lr: float = 0.01
    """Learning rate of the row update."""
    eps: float = 1e-8
    """rowwise_adagrad: added to sqrt(a) in the denominator."""
    mode: Literal["hogwild", "aggregate"] = "hogwild"
    """hogwild: every push is applied on arrival. aggregate: pushes are buffered until
    `global_batch` samples have arrived, then their sample-weighted mean is applied once (GBA)."""
    global_batch: int = 0
    """aggregate: samples per global step (GBA: sync-mode trainer count x local batch); must be > 0
    there, ignored in hogwild mode."""
    decay: StalenessDecayConfig = dataclasses.field(default_factory=StalenessDecayConfig)
    """aggregate: weight of a push by its staleness (GBA: `sync.gba.row_decay`);
    ignored in hogwild mode, where every push is applied on arrival."""
    on_nonfinite: Literal["skip", "fail"] = DEFAULT_ON_NONFINITE
    """A push with NaN / Inf row gradients (`sync.on_nonfinite`): skip: every shard drops and counts
    it, the trainer carries on; fail: it is refused naming the trainer, and so is every later push."""
    max_in_flight: int = 2
    """Steps whose pushes a trainer may have in flight; the next `push_gradients()` waits for the
    oldest. Bounds the trainer's memory and how stale its own rows can be."""
    seed: int = 0
    """Seed of the initial values: each shard of a table runs the table's `init_fn` under a seed
    derived from (seed, table name, server index, server count)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.eps < 0:
            raise ConfigError(f"eps must be >= 0, got {self.eps}")
        if self.mode == "aggregate" and self.global_batch < 1:
            raise ConfigError(f"global_batch must be >= 1 sample in aggregate mode, got {self.global_batch}")
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {self.max_in_flight}")


@dataclasses.dataclass
class _ShardTable:
    """One table's rows on one shard, with optimizer state and the aggregate-mode buffer."""

    config: EmbeddingBagConfig
    weight: torch.Tensor
    accumulator: torch.Tensor
    pending_rows: torch.Tensor = dataclasses.field(init=False)
    pending_grads: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.clear_pending()

    def clear_pending(self) -> None:
        """Empty the aggregate-mode buffer (fresh tensors: views would keep the old storage alive)."""
        self.pending_rows = torch.empty(0, dtype=torch.int64)
        self.pending_grads = self.weight.new_empty(0, self.weight.shape[1])


class EmbeddingShard:
    """The rows that server `server_index` of `num_servers` owns, of every table (a transport service).

    Public methods are the service: `lookup`, `lookup_with_token`, `push`, `load_rows`, `export_state`,
    `import_state`, `stats`. Ids are global row ids;
    each must belong to this shard (`id % num_servers == server_index`). `roster`: the server's, the
    one record of the job's failure, which a non-finite push under `on_nonfinite: fail` writes and
    every later push is refused with (None: a shard served alone keeps one of its own).
    """

    def __init__(
        self, tables: Sequence[EmbeddingBagConfig], config: PSEmbeddingConfig, server_index: int, num_servers: int,
        roster: Roster | None = None,
    ) -> None:
        if not 0 <= server_index < num_servers:
            raise ValueError(f"server_index must be in [0, {num_servers}), got {server_index}")
        self.config = config
        self.server_index = server_index
        self.num_servers = num_servers
        self._lock = threading.Lock()
        self._tables = {table.name: self._new_table(table) for table in checked_tables(tables)}
        self._pushes = 0
        self._hogwild_updates = 0
        self._rows_applied = 0
        self._rule = (
            GlobalBatchRule(AggregationConfig(decay=config.decay), config.global_batch)
            if config.mode == "aggregate" else None
        )
        """aggregate mode: GBA's rule, owning the global step and the samples toward the global batch."""
        self._staleness = StalenessCounts()
        self._nonfinite_dropped = 0
        self._roster = roster if roster is not None else Roster(0)
        self._restored_at: int | None = None
        """The token (global step) this shard's process was restored at (`restore`); None: never."""
        self._dropped_after_restore = 0

    def lookup(self, ids_by_table: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Current rows of the given ids, per table."""
        return self.lookup_with_token(ids_by_table)[0]

    def lookup_with_token(self, ids_by_table: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """Current rows of the given ids, per table, and the token (this shard's global step) they
        belong to, which the push of their gradients carries back."""
        checked = {name: self._local_rows("lookup", name, ids) for name, ids in ids_by_table.items()}
        with self._lock:
            return {name: table.weight[rows] for name, (table, rows) in checked.items()}, self._update_count()

    def push(self, grads_by_table: RowsByTable, num_samples: int, token: int | None = None,
             trainer: int | None = None, finite: bool = True) -> None:
        """Row gradients of one trainer batch of `num_samples` samples, computed on rows of `token`
        (required in aggregate mode, ignored in hogwild mode); applied per `config.mode`. `trainer`:
        the pushing trainer's index (named when its push is not finite); `finite` False: the trainer
        found NaN / Inf in its rows (they are not sent), dropped or refused per `config.on_nonfinite`."""
        checked = self._checked_rows("push", grads_by_table, nonfinite_allowed=True)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"push refused: num_samples must be an integer >= 1, got {num_samples!r}")
        if self._rule is not None and (isinstance(token, bool) or not isinstance(token, int)):
            raise ValueError(f"push refused: aggregate mode needs the lookup's token, an integer >= 0; got {token!r}")
        finite = finite is True and all_finite(values for _, _, values in checked)  # one pass, outside the lock
        with self._lock:
            if (refusal := self._roster.refusal("push refused")) is not None:
                raise refusal
            if not finite:
                self._nonfinite(trainer)
                return
            if self._restored_at is not None and self._rule is not None and token > self._rule.global_step:
                self._pushes += 1  # rows looked up before this process was restored to an older global step
                self._dropped_after_restore += 1
                return
            admission = self._admit(token, num_samples)
            self._pushes += 1
            if admission is None:
                for table, rows, grads in checked:
                    self._apply(table, *_coalesce(rows, grads))
                self._hogwild_updates += 1
                return
            self._staleness.add(admission.staleness, admission.weight)
            if not admission.dropped:
                for table, rows, grads in checked:
                    table.pending_rows, table.pending_grads = _coalesce(
                        torch.cat([table.pending_rows, rows]), torch.cat([table.pending_grads, grads * admission.scale])
                    )
            if admission.completed_samples:
                for table in self._tables.values():
                    self._apply(table, table.pending_rows, table.pending_grads / admission.completed_samples)
                    table.clear_pending()

    def _nonfinite(self, trainer: int | None) -> None:
        """A push with NaN / Inf rows (the lock held): dropped and counted (skip), or the job fails (fail)."""
        who = "a trainer" if trainer is None else f"trainer {trainer}"
        failure = nonfinite_failure(self.config.on_nonfinite, f"{who}'s row gradients have NaN or inf values")
        if failure is not None:
            ranks = () if trainer is None else (trainer,)  # a trainer's index is its rank (`shadowgba.job.roles`)
            self._roster.fail(failure, ranks)
            raise SyncError(f"push refused: {failure}", ranks=ranks)
        self._pushes += 1
        self._nonfinite_dropped += 1

    def load_rows(self, rows_by_table: RowsByTable) -> None:
        """Overwrite rows (tests, checkpoints); optimizer state and pending gradients are kept."""
        checked = self._checked_rows("load", rows_by_table)
        with self._lock:
            for table, rows, values in checked:
                table.weight[rows] = values

    def export_state(self) -> dict[str, object]:
        """A consistent copy of everything this shard holds (a checkpoint's part): per table its rows,
        row-wise Adagrad accumulators and aggregate-mode buffer, plus the counters, GBA's global step
        and buffered samples, and the staleness counts; with the layout it was made for."""
        with self._lock:
            return {
                "layout": self._layout(),
                "tables": {
                    name: {"weight": table.weight.clone(), "accumulator": table.accumulator.clone(),
                           "pending_rows": table.pending_rows.clone(), "pending_grads": table.pending_grads.clone()}
                    for name, table in self._tables.items()
                },
                "counters": {"pushes": self._pushes, "hogwild_updates": self._hogwild_updates,
                             "rows_applied": self._rows_applied},
                "rule": None if self._rule is None else {
                    "global_step": self._rule.global_step, "buffered_samples": self._rule.buffered_samples},
                "staleness": self._staleness.state_dict(),
            }

    def import_state(self, state: Mapping[str, object]) -> None:
        """Replace everything with `export_state()` output of a shard of the same layout (same server
        index and count, tables, optimizer and mode); anything else is refused (ValueError
        "import refused: ...") before anything changes."""
        if not isinstance(state, Mapping) or state.get("layout") != self._layout():
            theirs = state.get("layout") if isinstance(state, Mapping) else type(state).__name__
            raise CheckpointError(f"import refused: state of shard layout {theirs}, this shard is {self._layout()}")
        tables = state["tables"]
        for name, table in self._tables.items():
            entry = tables[name]
            for key, like in (("weight", table.weight), ("accumulator", table.accumulator)):
                value = entry[key]
                if not isinstance(value, torch.Tensor) or value.shape != like.shape or value.dtype != like.dtype:
                    raise _refused("import", name, f"{key} must be a {like.dtype} tensor of shape "
                                                   f"{tuple(like.shape)}, got {_describe(value)}")
        with self._lock:
            for name, table in self._tables.items():
                entry = tables[name]
                table.weight.copy_(entry["weight"])
                table.accumulator.copy_(entry["accumulator"])
                table.pending_rows, table.pending_grads = entry["pending_rows"].clone(), entry["pending_grads"].clone()
            counters = state["counters"]
            self._pushes, self._hogwild_updates = counters["pushes"], counters["hogwild_updates"]
            self._rows_applied = counters["rows_applied"]
            if self._rule is not None:
                self._rule.global_step = state["rule"]["global_step"]
                self._rule.buffered_samples = state["rule"]["buffered_samples"]
            self._staleness.load_state_dict(state["staleness"])

    def restore(self, state: Mapping[str, object]) -> None:
        """Serve again from `export_state()` output (a new server process, before it serves): row
        pushes of tokens newer than the restored global step (looked up before the restart) are
        dropped and counted, not refused."""
        self.import_state(state)
        with self._lock:
            self._restored_at = self._update_count()

    def _layout(self) -> dict[str, object]:
        return {
            "server_index": self.server_index, "num_servers": self.num_servers,
            "optimizer": self.config.optimizer, "mode": self.config.mode,
            "tables": [[name, table.config.num_embeddings, table.config.embedding_dim]
                       for name, table in self._tables.items()],
        }

    def stats(self) -> dict[str, object]:
        """Counters: pushes, updates (optimizer applications; the global step in aggregate mode),
        rows_applied, pending_rows, pending_samples, nonfinite_dropped (pushes with NaN / Inf rows
        dropped under skip), failure (why pushes are refused under fail), and in aggregate mode the
        pushes' staleness histogram and how many were decayed (0 < weight < 1) and dropped (weight 0)."""
        with self._lock:
            return {
                "pushes": self._pushes,
                "updates": self._update_count(),
                "rows_applied": self._rows_applied,
                "pending_rows": sum(len(table.pending_rows) for table in self._tables.values()),
                "pending_samples": 0 if self._rule is None else self._rule.buffered_samples,
                "nonfinite_dropped": self._nonfinite_dropped,
                "restored_at": self._restored_at,
                "dropped_after_restore": self._dropped_after_restore,
                "failure": self._roster.failure,
                **self._staleness.summary(),
            }

    def _admit(self, token: int | None, num_samples: int) -> Admission | None:
        """GBA's verdict on a push in aggregate mode, None in hogwild mode (the lock held); a
        refused token changes nothing."""
        if self._rule is None:
            return None
        try:
            return self._rule.admit(token, num_samples)
        except ValueError as error:  # a token from the future or a negative one
            raise ValueError(f"push refused: {error}") from None

    def _update_count(self) -> int:
        """Optimizer applications so far (the lock held): in aggregate mode the global step k, the
        token a lookup returns."""
        return self._hogwild_updates if self._rule is None else self._rule.global_step

    def _new_table(self, config: EmbeddingBagConfig) -> _ShardTable:
        local_rows = len(range(self.server_index, config.num_embeddings, self.num_servers))
        weight = torch.empty(local_rows, config.embedding_dim, dtype=torch.float32)
        seed = zlib.crc32(f"{self.config.seed}/{config.name}/{self.server_index}/{self.num_servers}".encode())
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            config.init_fn(weight)
        adagrad = self.config.optimizer == "rowwise_adagrad"
        return _ShardTable(config, weight, accumulator=torch.zeros(local_rows if adagrad else 0, dtype=torch.float32))

    def _local_rows(self, request: str, name: str, ids: torch.Tensor) -> tuple[_ShardTable, torch.Tensor]:
        """The table and local row indices of global `ids`, or a ValueError naming the problem."""
        table = self._tables.get(name)
        if table is None:
            raise ValueError(f"{request} refused: unknown table '{name}'; tables: {sorted(self._tables)}")
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
            raise _refused(request, name, f"ids must be a 1-D int32/int64 tensor, got {_describe(ids)}")
        ids = ids.long()
        problem = id_out_of_range(ids, table.config.num_embeddings)
        if problem:
            raise _refused(request, name, problem)
        foreign = ids[ids % self.num_servers != self.server_index].tolist()
        if foreign:
            owner = foreign[0] % self.num_servers
            raise _refused(request, name, f"id {foreign[0]} belongs to server {owner}, not {self.server_index}")
        return table, ids // self.num_servers

    def _checked_rows(
        self, request: str, rows_by_table: RowsByTable, nonfinite_allowed: bool = False
    ) -> list[tuple[_ShardTable, torch.Tensor, torch.Tensor]]:
        """Validated (table, local rows, values) per entry; values must be float32 rows, and finite
        unless `nonfinite_allowed` (a push, whose caller applies `config.on_nonfinite`)."""
        checked = []
        for name, entry in rows_by_table.items():
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise _refused(request, name, f"expected (ids, rows), got {type(entry).__name__}")
            ids, values = entry
            table, rows = self._local_rows(request, name, ids)
            shape = (len(rows), table.config.embedding_dim)
            if not isinstance(values, torch.Tensor) or values.dtype != table.weight.dtype or values.shape != shape:
                raise _refused(request, name, f"rows must be a {table.weight.dtype} tensor of shape {shape}, "
                                              f"got {_describe(values)}")
            if not nonfinite_allowed and not is_finite(values):
                raise _refused(request, name, "rows contain NaN or infinity")
            checked.append((table, rows, values))
        return checked

    def _apply(self, table: _ShardTable, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """One optimizer step on distinct local `rows`."""
        if self.config.optimizer == "rowwise_adagrad":
            table.accumulator.index_add_(0, rows, grads.pow(2).mean(dim=1))
            grads = grads / (table.accumulator[rows].sqrt() + self.config.eps).unsqueeze(1)
        table.weight.index_add_(0, rows, grads, alpha=-self.config.lr)
        self._rows_applied += len(rows)


def checked_tables(tables: Sequence[EmbeddingBagConfig]) -> list[EmbeddingBagConfig]:
    """Copies of `tables` with feature names defaulted to the table name (as TorchRec does), validated."""
    checked = [
        dataclasses.replace(table, feature_names=list(table.feature_names) or [table.name]) for table in tables
    ]
    names = [table.name for table in checked]
    if len(set(names)) != len(names) or not all(names):
        raise SetupError(f"tables need distinct, non-empty names, got {names}")
    for table in checked:
        if table.data_type != DataType.FP32:
            raise SetupError(f"table '{table.name}': only FP32 tables are supported, got {table.data_type}")
        pooling_type_to_str(table.pooling)  # refuses pooling types other than sum and mean
    return checked


def ids_outside(ids: torch.Tensor, num_embeddings: int | torch.Tensor) -> torch.Tensor:
    """Which of `ids` break the rule every table's ids obey, `0 <= id < num_embeddings` (one table's
    size, or a size per id). PS shards apply it to each request (`id_out_of_range`), the TorchRec batch
    check (`shadowgba.integrations.torchrec.BatchCheck`) to every id of a batch at once."""
    return (ids < 0) | (ids >= num_embeddings)


def id_out_of_range(ids: torch.Tensor, num_embeddings: int) -> str | None:
    """None if every one of `ids` fits a table of `num_embeddings` rows (`ids_outside`), else the first
    that does not, in the words of every refusal: "id 7 out of range [0, 5)"."""
    outside = ids_outside(ids, num_embeddings)
    if not bool(outside.any()):
        return None
    return f"id {ids[outside][0].item()} out of range [0, {num_embeddings})"


def _coalesce(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct rows (sorted) and the sum of the gradients given for each."""
    distinct, inverse = torch.unique(rows, return_inverse=True)
    return distinct, grads.new_zeros(len(distinct), grads.shape[1]).index_add_(0, inverse, grads)


def _refused(request: str, table: str, problem: str) -> ValueError:
    return ValueError(f"{request} refused: table '{table}': {problem}")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
