"""What a server rank serves: the services `sync.algo` needs on the parameter servers (GBA's dense
shard or the S-EASGD centre, plus the PS-hosted tables' shard), resumed from and saved to the
servers' own checkpoints (`sync.ps.checkpoint_dir`).

`shadowgba.join` calls `serve` on a server rank only, and imports this module there: a job without
servers never loads it, nor the transport (`shadowgba.ps`) and GBA's server it imports.

Invariants:
- Every service is restored before any is served: a restarted server process answers no trainer
  with the state it had before its checkpoint was read.
- Every service of the rank is saved at the same point of the schedule of one of them (the dense
  shard's global steps, or the centre's exchanges), so a checkpoint is one consistent state.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from shadowgba import optional
from shadowgba.config import SyncConfig
from shadowgba.errors import ConfigError
from shadowgba.gba.server import DenseShard
from shadowgba.gba.shards import DENSE_SERVICE
from shadowgba.job.roles import Roles
from shadowgba.ps.easgd_center import CENTER_SERVICE, ElasticCenter
from shadowgba.ps.server_end import ServerTransport
from shadowgba.ps.server_state import CheckpointWriter, ServerCheckpoints

logger = logging.getLogger("shadowgba")


def serve(config: SyncConfig, roles: Roles, transport: ServerTransport, served: dict[str, Any],
          tables: Sequence[Any] | None, table_options: Any) -> CheckpointWriter | None:
    """A server rank's services for `config.algo` (trainers configure or initialise them), put in
    `served` by name and served on `transport`; with `sync.ps.checkpoint_dir`, first resumed from this
    server's newest checkpoint and then saved on schedule (the writer, which the caller closes).
    `tables`, `table_options`: the PS-hosted tables, if any (`shadowgba.join`'s)."""
    if config.algo == "easgd_ps":
        dense_service, service = CENTER_SERVICE, ElasticCenter()
    else:
        dense_service, service = DENSE_SERVICE, DenseShard(transport.roster, transport.shared_copy)
    served[dense_service] = service
    if tables is not None:
        embedding = optional.ps_embedding_shard("PS-hosted tables")
        served[embedding.DEFAULT_SERVICE] = embedding.EmbeddingShard(list(tables), table_options, roles.server_index,
                                                                     roles.num_servers, transport.roster)
    writer = _restore_and_checkpoint(config, roles, served, dense_service) if config.ps.checkpoint_dir else None
    for name, service in served.items():
        transport.serve(name, service)
    return writer


def _restore_and_checkpoint(config: SyncConfig, roles: Roles, served: dict[str, Any], offering: str) -> CheckpointWriter:
    """Server: take the services' state from this server's newest checkpoint, if any (a restarted
    process, before it serves), and save them on the schedule of service `offering`: every
    `sync.ps.checkpoint_every` global steps of the dense shard (GBA) or exchanges of the centre
    slice (S-EASGD)."""
    checkpoints = ServerCheckpoints(config.ps.checkpoint_dir, roles.server_index)
    saved = checkpoints.latest()
    if saved is not None:
        step, states = saved
        if not set(states) <= set(served):
            raise ConfigError(f"sync.ps.checkpoint_dir: {checkpoints.path_of(step)} holds {sorted(states)}, but this "
                              f"{config.algo} server serves {sorted(served)} (a folder of another job?)")
        for name, state in states.items():
            served[name].restore(state)
        logger.warning("shadowgba: %s resumed from its checkpoint %s", roles.name, checkpoints.path_of(step))
    writer = CheckpointWriter(checkpoints, offering, {name: service.export_state
                                                      for name, service in served.items() if name != offering})
    served[offering].on_checkpoint(config.ps.checkpoint_every, writer.offer)
    return writer
