"""Asynchronous embedding tables on the parameter servers, behind TorchRec's EmbeddingBagCollection API.

    ps = Transport.start(num_servers=2)                                # every rank (job.transport)
    # server ranks
    ps.serve("embedding", EmbeddingShard(tables, config, ps.roles.server_index, ps.roles.num_servers))
    ps.stop()
    # trainer ranks
    ebc = PSEmbeddingBagCollection(tables, config, ps)                  # instead of EmbeddingBagCollection
    loss = model(batch); loss.backward()                                # model calls ebc(kjt) -> KeyedTensor
    ebc.push_gradients(); dense_optimizer.step()                        # the push does not wait
    ebc.flush(); ps.stop()                                              # at the end, or before read_table()

Tables are row-sharded: row `id` lives on server `id % num_servers`, at local row `id // num_servers`.

A trainer step has no collective:
- forward: per table, the ids of all its features de-duplicated (`torch.unique`); one `lookup` call per
  server covering every table, all in flight at once; per table a leaf tensor of the unique rows
  (requires grad), pooled per feature by `F.embedding_bag` with the KJT's offsets, so autograd leaves
  the row gradients in the leaf's `.grad`.
- `push_gradients()`: one `push` call per server carrying every table's row gradients, the batch
  size and the token that server's lookup returned, sent to *every* server even without rows, so
  that every shard counts every batch's samples and aggregate mode closes a global batch at the same
  push on every shard.
- NaN / Inf rows never land (`config.on_nonfinite`, `sync.on_nonfinite`): the trainer checks its
  row gradients before a push; a non-finite push goes to every server marked so and without its
  rows, and the trainer's `NonFiniteGuard` (given by `shadowgba.dense_sync`) skips or fails its
  step. Every shard then drops it alike (its samples not counted, so the shards' global steps stay
  together) and counts it (`nonfinite_dropped`) under `skip`; under `fail` it is refused naming the
  trainer, and so is every later push of any trainer, so every trainer's job ends naming it. A push
  whose rows a shard finds non-finite although it was not marked (a client without the check) is
  treated the same on that shard.
- It is an explicit call rather than a backward hook because the trainer owns the step boundary
  (GBA hands its token over there): a hook fires once per table, inside autograd's thread, never for a
  table the loss does not reach, and would have to block backward when too many pushes are in flight.
- At most `max_in_flight` steps of pushes are in flight; the next `push_gradients()` waits for the
  oldest. A lookup may still run before this trainer's own pending pushes are applied: a trainer's
  rows are at most `max_in_flight` of its own steps stale (Hogwild). A failed push is raised at the
  next `forward()`, `push_gradients()` or `flush()`.

A shard (`EmbeddingShard`) holds one lock; the transport's server threads call it concurrently. Every request is
validated completely before anything changes (a `ValueError` "push refused: ..." names the table and
the problem), so a refused request leaves the shard untouched, across all its tables. Modes:
- hogwild: a push is applied on arrival (duplicate ids summed), racing with other trainers' pushes
  at the granularity of whole pushes.
- aggregate (GBA): the dense GBA shards' rule, `sync_algos.gba.GlobalBatchRule`, on each shard's
  own global step k (its applied updates). A lookup returns k as its token, and the push of the
  gradients computed on those rows carries it back; the rule refuses a token from the future and
  weighs the push by its staleness (`config.decay`, GBA's dense default: drop beyond 2). A kept
  push adds `weight * num_samples * grad` to a sparse buffer per table (the touched rows and their
  sums, so memory is bounded by the rows touched in one global batch); a dropped one (weight 0)
  changes nothing but the counters. Once `global_batch` samples have arrived the buffer divided by
  those samples, the sample-weighted mean of the pushed gradients, is applied once, the buffer
  cleared and k advanced.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import zlib
from typing import Literal, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, pooling_type_to_str
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from shadowgba.checkpoint import state_from_bytes, state_to_bytes
from shadowgba.errors import CheckpointError, ConfigError, ServerRestarted, SetupError, SyncError
from shadowgba.nonfinite import NonFiniteGuard
from shadowgba.ps.transport import Transport
from sync_algos.base import is_finite
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
    """aggregate: weight of a push by its staleness (GBA: the dense shards' `sync.options.decay`);
    ignored in hogwild mode, where every push is applied on arrival."""
    on_nonfinite: Literal["skip", "fail"] = "skip"
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
    each must belong to this shard (`id % num_servers == server_index`).
    """

    def __init__(
        self, tables: Sequence[EmbeddingBagConfig], config: PSEmbeddingConfig, server_index: int, num_servers: int
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
        self._failure: str | None = None
        """Under on_nonfinite fail, why the job failed: every later push is refused with it."""
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
        finite = finite is True and all(is_finite(values) for _, _, values in checked)  # one pass, outside the lock
        with self._lock:
            if self._failure is not None:
                raise SyncError(f"push refused: the job failed: {self._failure}")
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
        message = f"{'a trainer' if trainer is None else f'trainer {trainer}'}'s row gradients have NaN or inf values"
        if self.config.on_nonfinite == "fail":
            self._failure = f"{message} (sync.on_nonfinite: fail)"
            raise SyncError(f"push refused: {self._failure}")
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
                "failure": self._failure,
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


@dataclasses.dataclass
class _Step:
    """What the last forward with grad enabled left for `push_gradients()`."""

    unique_ids: dict[str, torch.Tensor]
    leaves: dict[str, torch.Tensor]
    batch_size: int
    tokens: list[int]
    """Per server, the token its lookup returned."""


class PSEmbeddingBagCollection(nn.Module):
    """`EmbeddingBagCollection` (KJT in, KeyedTensor out; sum or mean pooling) on the PS's shards.

    Holds no parameters: the rows live on the servers, which serve an `EmbeddingShard` under
    `service` built from the same tables and config. After each backward, call `push_gradients()`.
    One training thread drives it, as it drives the model's forward and backward.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        config: PSEmbeddingConfig,
        transport: Transport,
        service: str = DEFAULT_SERVICE,
    ) -> None:
        super().__init__()
        num_servers = transport.roles.num_servers
        if num_servers < 1:
            raise SetupError(f"PSEmbeddingBagCollection needs at least one server, got num_servers={num_servers}")
        self.config = config
        self.transport = transport
        """The trainer's transport to the servers holding the rows."""
        self.num_servers = num_servers
        self.service = service
        self._tables = checked_tables(tables)
        self._embedding_names = [name for names in get_embedding_names_by_table(self._tables) for name in names]
        self._lengths_per_key = [table.embedding_dim for table in self._tables for _ in table.feature_names]
        self._step: _Step | None = None
        self._in_flight: collections.deque[list[torch.futures.Future]] = collections.deque()
        self.pushes_lost_to_restart = 0
        """Row pushes that were in flight when their server restarted (`ServerRestarted`), lost."""
        self.guard: NonFiniteGuard | None = None
        """The trainer's guard (`shadowgba.dense_sync` sets it): told of a push with NaN / Inf rows."""

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The tables, as `EmbeddingBagCollection.embedding_bag_configs()` (TorchRec's DLRM reads it)."""
        return self._tables

    def is_weighted(self) -> bool:
        """Per-sample weights are not supported, as an unweighted `EmbeddingBagCollection`."""
        return False

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of every feature, in table order, as `EmbeddingBagCollection.forward`."""
        self._settle(self.config.max_in_flight)
        if self._step is not None and any(leaf.grad is not None for leaf in self._step.leaves.values()):
            raise RuntimeError(
                "the row gradients of the previous batch were never pushed: call push_gradients() after backward()"
            )
        if features.variable_stride_per_key():
            raise SetupError("variable batch sizes per feature (VBE) are not supported")
        jagged = features.to_dict()
        ids = {
            table.name: torch.cat([jagged[feature].values() for feature in table.feature_names]).long().cpu()
            for table in self._tables
        }
        unique_ids, inverse = {}, {}
        for name, table_ids in ids.items():
            unique_ids[name], inverse[name] = torch.unique(table_ids, return_inverse=True)
        fetched, tokens = self._fetch(unique_ids)
        leaves = {
            name: table_rows.to(features.device()).requires_grad_(torch.is_grad_enabled())
            for name, table_rows in fetched.items()
        }
        pooled = []
        for table in self._tables:
            positions = inverse[table.name].to(features.device())
            start = 0
            for feature in table.feature_names:
                bags = jagged[feature]
                end = start + bags.values().numel()
                pooled.append(F.embedding_bag(
                    positions[start:end], leaves[table.name], bags.offsets(),
                    mode=pooling_type_to_str(table.pooling), include_last_offset=True,
                ))
                start = end
        self._step = _Step(unique_ids, leaves, features.stride(), tokens) if torch.is_grad_enabled() else None
        return KeyedTensor(
            keys=self._embedding_names, length_per_key=self._lengths_per_key, values=torch.cat(pooled, dim=1)
        )

    def push_gradients(self) -> None:
        """Send the last backward's row gradients to the servers; waits only if too many are in flight."""
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("push_gradients() needs a forward() with gradients enabled first")
        grads = {
            name: (step.unique_ids[name], leaf.grad.detach().cpu())
            for name, leaf in step.leaves.items()
            if leaf.grad is not None
        }
        finite = all(is_finite(rows) for _, rows in grads.values())
        if not finite and self.guard is not None:
            self.guard.note("row gradients of PS-hosted tables")
        requests = self._split(grads) if finite else [{} for _ in range(self.num_servers)]  # NaN stays here
        trainer = self.transport.roles.trainer_index
        self._in_flight.append([
            self.transport.call_async(server, self.service, "push", request, step.batch_size, step.tokens[server],
                                      trainer, finite)
            for server, request in enumerate(requests)
        ])
        self._settle(self.config.max_in_flight)

    def flush(self) -> None:
        """Wait until every push is applied (or raise the first that failed)."""
        self._settle(0)

    def server_stats(self) -> list[dict[str, object]]:
        """Each server's `EmbeddingShard.stats()`: pushes, updates, and under GBA the staleness
        histogram and decayed / dropped pushes of the rows."""
        return [self.transport.call(server, self.service, "stats") for server in range(self.num_servers)]

    def read_table(self, name: str) -> torch.Tensor:
        """The whole table, gathered from the servers (tests, checkpoints)."""
        return self._fetch({name: torch.arange(self._table(name).num_embeddings)})[0][name]

    def load_table(self, name: str, weight: torch.Tensor) -> None:
        """Overwrite the whole table on the servers (tests, checkpoints); optimizer state is kept."""
        ids = torch.arange(self._table(name).num_embeddings)
        futures = [
            self.transport.call_async(server, self.service, "load_rows", request)
            for server, request in enumerate(self._split({name: (ids, weight.detach().cpu())}))
        ]
        for future in futures:
            future.wait()

    # ----------------------------------------------------------------------------- checkpoints
    # Stateful (torch.distributed.checkpoint): trainer 0 alone gathers and saves every shard's state;
    # the other trainers' state_dict() is empty. The rows live on the servers, so every trainer
    # would save the same thing: one copy is written once, and it is one consistent snapshot (taken
    # after the checkpointer's barrier, when every trainer has flushed its pushes). Rows and
    # accumulators are reassembled into whole tables in global row order (plain tensors under
    # "tables.<name>.weight" / ".accumulator"); what is per shard (aggregate-mode buffers, global
    # step, counters) rides along serialized per server ("shards.server<s>").

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):  # type: ignore[override]
        """Called by a parent module's `state_dict()` (with a prefix or destination): nothing, as
        an `EmbeddingBagCollection` without parameters. Called on its own (a checkpoint): on
        trainer 0 every shard's state, gathered (collective with the servers only); {} elsewhere."""
        if args or destination is not None or prefix:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        self.flush()
        if not self._saving_trainer():
            return {}
        exported = self.transport.call_each(self.service, "export_state", [()] * self.num_servers)
        tables: dict[str, dict[str, torch.Tensor]] = {}
        for table in self._tables:
            weight = torch.empty(table.num_embeddings, table.embedding_dim, dtype=torch.float32)
            entry = {"weight": weight}
            if self.config.optimizer == "rowwise_adagrad":
                entry["accumulator"] = torch.empty(table.num_embeddings, dtype=torch.float32)
            for server, shard in enumerate(exported):
                for key, value in entry.items():
                    value[server::self.num_servers] = shard["tables"][table.name][key]
            tables[table.name] = entry
        shards = {}
        for server, shard in enumerate(exported):
            rest = {**shard, "tables": {
                name: {key: value for key, value in entry.items() if key.startswith("pending")}
                for name, entry in shard["tables"].items()
            }}
            shards[f"server{server}"] = state_to_bytes(rest)
        return {"tables": tables, "shards": shards}

    def load_state_dict(self, state_dict: Mapping[str, object], strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Restore `state_dict()` output onto the servers (trainer 0; the others have nothing to do).
        A shard refuses a state of another layout (ValueError "import refused: ...")."""
        if not self._saving_trainer():
            return None
        self.flush()
        tables, shards = state_dict["tables"], state_dict["shards"]
        if sorted(shards) != [f"server{server}" for server in range(self.num_servers)]:
            raise CheckpointError(f"import refused: state of {len(shards)} servers, this job has {self.num_servers}")
        imports = []
        for server in range(self.num_servers):
            shard = state_from_bytes(shards[f"server{server}"], f"server{server}")
            for table in self._tables:
                entry = shard["tables"][table.name]
                entry["weight"] = tables[table.name]["weight"][server::self.num_servers].clone()
                accumulator = tables[table.name].get("accumulator")
                entry["accumulator"] = (accumulator[server::self.num_servers].clone() if accumulator is not None
                                        else torch.zeros(0, dtype=torch.float32))
            imports.append((shard,))
        self.transport.call_each(self.service, "import_state", imports)
        return None

    def prepare_checkpoint(self) -> None:
        """Before a checkpoint's barrier (`shadowgba.checkpoint.Checkpointer`): this trainer's pushes land."""
        self.flush()

    def _saving_trainer(self) -> bool:
        return self.transport.roles.trainer_index == 0

    def _table(self, name: str) -> EmbeddingBagConfig:
        for table in self._tables:
            if table.name == name:
                return table
        raise SetupError(f"unknown table '{name}'; tables: {[table.name for table in self._tables]}")

    def _split(self, rows_by_table: RowsByTable) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Per server, the (ids, rows) pairs of the ids it owns; every server gets a request."""
        requests: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(self.num_servers)]
        for name, (ids, rows) in rows_by_table.items():
            owners = ids % self.num_servers
            for server, request in enumerate(requests):
                mine = owners == server
                request[name] = (ids[mine], rows[mine])
        return requests

    def _fetch(self, ids_by_table: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Rows of `ids_by_table`, one lookup per server, all in flight at once; and per server the
        token of its rows."""
        # split each id's position along with it, so that every reply lands at its ids' places
        requests = self._split({name: (ids, torch.arange(len(ids))) for name, ids in ids_by_table.items()})
        futures = [
            self.transport.call_async(
                server, self.service, "lookup_with_token", {name: ids for name, (ids, _) in request.items()}
            )
            for server, request in enumerate(requests)
        ]
        dims = {table.name: table.embedding_dim for table in self._tables}
        rows = {name: torch.empty(len(ids), dims[name], dtype=torch.float32) for name, ids in ids_by_table.items()}
        tokens = []
        for server, (request, future) in enumerate(zip(requests, futures)):
            try:
                server_rows, token = future.wait()
            except ServerRestarted:  # the new process of the server answers from its restored rows
                server_rows, token = self.transport.call(server, self.service, "lookup_with_token",
                                                         {name: ids for name, (ids, _) in request.items()})
            tokens.append(token)
            for name, values in server_rows.items():
                rows[name][request[name][1]] = values
        return rows, tokens

    def _settle(self, max_left: int) -> None:
        """Retire finished steps of pushes, waiting while more than `max_left` are in flight. A push
        in flight when its server restarted is lost (counted in `pushes_lost_to_restart`)."""
        while self._in_flight and (len(self._in_flight) > max_left or all(f.done() for f in self._in_flight[0])):
            for future in self._in_flight.popleft():
                try:
                    future.wait()  # raises the service's error, e.g. "push refused: ..."
                except ServerRestarted:
                    self.pushes_lost_to_restart += 1


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
