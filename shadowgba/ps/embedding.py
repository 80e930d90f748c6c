"""Asynchronous embedding tables on the parameter servers, behind TorchRec's EmbeddingBagCollection API.

    ps = start_transport(num_servers=2)                                # every rank (job.transport)
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

The servers' side, `EmbeddingShard` (one lock, validation before change, hogwild and aggregate
modes): `shadowgba.ps.embedding_shard`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, pooling_type_to_str
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from shadowgba.errors import CheckpointError, ServerRestarted, SetupError
from shadowgba.nonfinite import NonFiniteGuard
from shadowgba.ps.embedding_shard import DEFAULT_SERVICE, PSEmbeddingConfig, RowsByTable, checked_tables
from shadowgba.ps.trainer_end import TrainerTransport
from shadowgba.serialized import state_from_bytes, state_to_bytes
from sync_algos.base import all_finite

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
        transport: TrainerTransport,
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
            raise SetupError(
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
            raise SetupError("push_gradients() needs a forward() with gradients enabled first")
        grads = {
            name: (step.unique_ids[name], leaf.grad.detach().cpu())
            for name, leaf in step.leaves.items()
            if leaf.grad is not None
        }
        finite = all_finite(rows for _, rows in grads.values())
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
