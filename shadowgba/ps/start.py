"""Joining a job of trainers and parameter servers: `start_transport` makes this rank's end of the
transport (`shadowgba.ps.transport`), a server's or a trainer's, from where it stands in the job
(`shadowgba.job.rendezvous`)."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from shadowgba.network import use_interface_to_master
from shadowgba.job.config import PSConfig
from shadowgba.job.rendezvous import attempt_namespace, elastic_roles, torchrun_roles
from shadowgba.ps.server_end import ServerTransport
from shadowgba.ps.sessions import server_incarnation, trainer_incarnation
from shadowgba.ps.trainer_end import TrainerTransport
from shadowgba.ps.transport import DEFAULT_RPC_TIMEOUT_S


def start_transport(num_servers: int, backend: str = "gloo", timeout_s: float | None = None,
                    rpc_timeout_s: float | None = None, on_trainer_lost: str = PSConfig.on_trainer_lost,
                    num_trainers: int = 0, server_restart_s: float = 0.0,
                    lane_bytes: int | None = None) -> ServerTransport | TrainerTransport:
    """Join the job as trainer or server: this rank's end of the transport.

    One torchrun job (`num_trainers` 0; collective: every rank calls it, in the same order): reads
    torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; initialises the default process
    group (with `backend`) unless it exists, and creates the trainer group (its collectives time
    out after `timeout_s`; None: torch's default). The elastic layout (`num_trainers` > 0: every
    process on its own): reads `SHADOWGBA_RANK` and MASTER_ADDR:MASTER_PORT, where server 0 hosts
    the job's store; no process group is created. Either way every trainer opens a channel to
    every server (replaced after `rpc_timeout_s` of silence; None: `DEFAULT_RPC_TIMEOUT_S`,
    capped at `timeout_s`), and a server that loses a trainer acts on `on_trainer_lost`
    (`sync.ps.on_trainer_lost`). A trainer whose server stops answering waits up to
    `server_restart_s` for a new process of it (`sync.ps.server_restart_s`; elastic layout).
    Each same-host channel's lanes hold `lane_bytes` (`sync.ps.lane_mb`; None: `LANE_BYTES`; 0: no
    same-host path, `sync.ps.same_host`: every channel's tensors go over gloo TCP).
    """
    use_interface_to_master()
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    timeout_s = timeout.total_seconds() if timeout is not None else dist.default_pg_timeout.total_seconds()
    if num_trainers:
        roles, store, namespace = elastic_roles(num_trainers, num_servers, timeout_s)
        generation, owns_default_group, sync_group = 0, False, None
    else:
        roles, store, generation, owns_default_group, sync_group = torchrun_roles(num_servers, backend, timeout)
        namespace = attempt_namespace()
    rpc_timeout_s = min(DEFAULT_RPC_TIMEOUT_S if rpc_timeout_s is None else rpc_timeout_s, timeout_s)
    incarnation = (server_incarnation(store, generation, roles.server_index) if roles.is_server
                   else trainer_incarnation(store, generation, roles.trainer_index))
    if roles.is_server:
        return ServerTransport(roles, store, namespace, generation, timeout_s, rpc_timeout_s, owns_default_group,
                               incarnation, lane_bytes, on_trainer_lost)
    return TrainerTransport(roles, store, namespace, generation, timeout_s, rpc_timeout_s, owns_default_group,
                            sync_group, incarnation, lane_bytes, server_restart_s)
