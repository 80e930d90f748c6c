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

    def __post_init__(self) -> None:
        if self.num_servers < 0:
            raise ValueError(f"num_servers must be >= 0, got {self.num_servers}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
