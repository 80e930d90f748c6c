"""Where the ranks of a job with parameter servers meet, and which attempt of the job this is.

This rank's place (`shadowgba.job.roles.Roles`) is found here. In a torchrun job (`torchrun_roles`)
every rank knows its place from RANK / WORLD_SIZE, and the trainers' groups are built once every
rank has arrived; in the elastic layout (`elastic_roles`, `sync.ps.num_trainers`) every process is
started on its own, names its rank in `SHADOWGBA_RANK`, and meets the others in the TCPStore
server 0 hosts at MASTER_ADDR:MASTER_PORT, with no process group at all. A job without servers
needs none of this: its roles are `Roles.assign(rank, world_size, 0)` on the default group.

Invariants:
- Ranks meet in the store that MASTER_ADDR:MASTER_PORT already names (`env://`): under torchrun
  (TORCHELASTIC_USE_AGENT_STORE) a client of the agent's store; without an agent, rank 0's
  default-group TCPStore is multi-tenant and shared. No second port is taken.
- Restarts (`torchrun --max-restarts`): the agent's store outlives an attempt, so every key of the
  transport (its sessions', and the default group's when `torchrun_roles` creates it) lives under
  `attempt_{TORCHELASTIC_RESTART_COUNT}/` (`attempt_store`, `restart_count`): a restarted attempt
  never reads a dead attempt's addresses, nor its notices (`shadowgba.job.notices`).
- No group is built before every rank arrived (`await_every_rank`): a group's own timeout is meant
  for a dead peer, not for a peer still building its model.
- gloo listens on ephemeral ports of the interface that reaches MASTER_ADDR (the PS transport's
  `start_transport` sets GLOO_SOCKET_IFNAME unless the user has: `shadowgba.network`).

Imports: torch and `shadowgba.errors` and this package only, never the transport (`shadowgba.ps`),
which imports this module.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import threading
import time
from typing import Callable

import torch.distributed as dist

from shadowgba.errors import SetupError, SyncError
from shadowgba.job.roles import Roles

ELASTIC_RANK = "SHADOWGBA_RANK"
"""Elastic layout: the environment variable that names this process's place in the job (trainers
0 .. num_trainers - 1, then the servers, as in one torchrun job)."""
ELASTIC_NAMESPACE = "elastic"
"""The key prefix of an elastic job in its servers' store (one job per set of servers)."""
STORE_POLL_S = 0.01
"""How often `await_key` looks for its key: a store access takes well under a millisecond on one host."""


def restart_count() -> int:
    """Which attempt of a torchrun job this is (0: the first; 0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def await_key(store: dist.Store, key: str, within_s: float, ended: threading.Event | None = None,
              superseded: Callable[[], bool] | None = None) -> bool:
    """Whether `key` appeared in `store` within `within_s` (False also once `ended` is set, once
    `superseded()` says the wait is pointless, or when the store fails: its host is gone)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if store.check([key]):
                return True
            if superseded is not None and superseded():
                return False
        except RuntimeError:
            return False
        if time.monotonic() >= deadline or (ended or threading.Event()).wait(STORE_POLL_S):
            return False


def torchrun_roles(num_servers: int, backend: str, timeout: datetime.timedelta | None
                    ) -> tuple[Roles, dist.Store, int, bool, dist.ProcessGroup | None]:
    """One torchrun job: (this rank's roles with its trainer group, the attempt's store, the transport
    generation, whether the default group was created here, the library's sync group on trainers).
    Roles are checked before any group exists.

    The trainer groups are built only once every rank has arrived (`_await_every_rank`): building a
    group waits for its members for the group's own timeout (`sync.timeout_s`, seconds, meant for
    a dead peer), and ranks reach the start far apart when the default group already existed: a
    server arrives at once while trainers build and shard their model for minutes, and on a loaded
    host even adjacent lines can be seconds apart."""
    owns_default_group = not dist.is_initialized()
    if owns_default_group:
        try:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except KeyError as missing:
            raise SetupError(f"the PS transport needs {missing.args[0]} (as set by torchrun)") from None
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    roles = Roles.assign(rank, world_size, num_servers)
    store = attempt_store(rank, world_size, None if timeout is None else timeout.total_seconds())
    if owns_default_group:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    generation = store.add(f"ps/rank{rank}/starts", 1)  # equal on every rank: each starts every transport
    await_every_rank(store, f"ps/gen{generation}/arrived", world_size, dist.default_pg_timeout.total_seconds())
    trainer_group = dist.new_group(list(roles.trainer_ranks), backend=backend, timeout=timeout)
    sync_group = dist.new_group(list(roles.trainer_ranks), backend=backend, timeout=timeout)
    if roles.is_server:
        return roles, store, generation, owns_default_group, None
    return (dataclasses.replace(roles, trainer_group=trainer_group), store, generation, owns_default_group,
            sync_group)


def await_every_rank(store: dist.Store, key: str, world_size: int, within_s: float) -> None:
    """Count this rank in at `key` and wait until all `world_size` ranks are (the last one in marks
    it, `await_key` polls for the mark); raises naming how many came when some do not within `within_s`."""
    if store.add(key, 1) == world_size:
        store.set(f"{key}/all", "1")
    if not await_key(store, f"{key}/all", within_s):
        raise SyncError(f"only {store.add(key, 0)} of {world_size} ranks started the PS transport "
                           f"within {within_s:g} s")


def elastic_roles(num_trainers: int, num_servers: int, timeout_s: float) -> tuple[Roles, dist.Store, str]:
    """The elastic layout: (this process's roles, from `SHADOWGBA_RANK`, the job's store, its key
    namespace). Server 0 hosts the store at MASTER_ADDR:MASTER_PORT, unless torchrun's agent does
    (`store_hosted_elsewhere`: the servers are a torchrun job, whose restarted server processes find
    the same store); every other process is a client of it, and waits up to `timeout_s` for it to be
    up. No process group is created."""
    try:
        rank = int(os.environ[ELASTIC_RANK])
    except (KeyError, ValueError):
        raise SetupError(f"the elastic layout (sync.ps.num_trainers > 0) needs {ELASTIC_RANK}, this process's "
                           f"place in the job: 0 .. {num_trainers - 1} for a trainer, {num_trainers} .. "
                           f"{num_trainers + num_servers - 1} for a server") from None
    roles = dataclasses.replace(Roles.assign(rank, num_trainers + num_servers, num_servers), elastic=True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=roles.server_index == 0 and not store_hosted_elsewhere(), wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return roles, dist.PrefixStore(ELASTIC_NAMESPACE, store), ELASTIC_NAMESPACE


def store_hosted_elsewhere() -> bool:
    """Whether the store at MASTER_ADDR:MASTER_PORT is hosted outside the job's processes: torchrun's
    agent store (TORCHELASTIC_USE_AGENT_STORE), which outlives the processes it restarts."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def agent_ranks() -> range | None:
    """The global ranks of the workers the torchrun agent of this process started (an agent's
    workers hold consecutive ranks), or None outside torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    first = int(os.environ["RANK"]) - int(os.environ["LOCAL_RANK"])
    return range(first, first + int(os.environ["LOCAL_WORLD_SIZE"]))


def attempt_namespace() -> str:
    """The key prefix of this torchrun attempt, `attempt_{TORCHELASTIC_RESTART_COUNT}`."""
    return f"attempt_{restart_count()}"


def attempt_store(rank: int, world_size: int, timeout_s: float | None = None) -> dist.Store:
    """The `env://` store (MASTER_ADDR:MASTER_PORT; torchrun's agent store under torchrun) under a
    prefix of this attempt's own (`attempt_namespace`): keys written by an earlier attempt of a
    restarted torchrun job (dead workers' addresses) are not read."""
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, **timeout))
    return dist.PrefixStore(attempt_namespace(), store)
