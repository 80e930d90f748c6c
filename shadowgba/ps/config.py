"""`PSConfig`: the `sync.ps` section, the parameter-server ranks of a job."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class PSConfig:
    """Parameter-server ranks (gba, easgd_ps): the last `num_servers` ranks of the job."""

    num_servers: int = 0
    """Server ranks; they host GBA's dense shards or the S-EASGD centre and, when the tables are
    on the servers, the embedding shards. 0: every rank trains."""
    max_in_flight: int = 2
    """PS-hosted tables: steps of row-gradient pushes a trainer may have in flight before it waits."""
    rpc_timeout_s: float = 60.0
    """How long a trainer's channel to a server may hear nothing (no reply, no heartbeat; a live server
    beats 4 times in that time) before the trainer opens a new session there: a server whose acceptor
    does not take it within `transport.ALIVE_WITHIN_S` is named lost (`PeerLost`); one that does gets
    the calls in flight again (each run once however often it is sent) until `sync.timeout_s` after
    the call began, so a trainer stopped with a call in flight, or a slow call, is no failure.
    Must not exceed `trainer_timeout_s`."""
    trainer_timeout_s: float = 300.0
    """How long a server at the end of the job waits for a trainer that has neither finished nor
    answered a ping before it gives up on it, naming it (`PeerLost`). Must be at least
    `rpc_timeout_s`, so that a call still in flight fails before its server gives up."""

    def __post_init__(self) -> None:
        if not 0 < self.rpc_timeout_s <= self.trainer_timeout_s:
            raise ValueError(
                f"rpc_timeout_s must be > 0 and <= trainer_timeout_s ({self.trainer_timeout_s:g}), got {self.rpc_timeout_s:g}"
            )
        if self.num_servers < 0:
            raise ValueError(f"num_servers must be >= 0, got {self.num_servers}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
