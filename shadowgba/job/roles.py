"""Who is who in a job: `Roles`, this rank's place among the trainers and the parameter servers.

The last `num_servers` ranks are servers (`ps0`, `ps1`, ...), the others trainers (`trainer0`, ...),
in one torchrun job and in the elastic layout alike (`shadowgba.job.rendezvous` finds this rank's
place; a job without servers is every rank a trainer, `Roles.assign(rank, world_size, 0)`).

Invariants:
- Every rank computes the same roles from (world size, `num_servers`): trainer i is global rank i,
  server i is global rank `world_size - num_servers + i`. Nothing is exchanged to agree on them.
- A job keeps at least one trainer (`assign` refuses a server count that leaves none).
- Every failure message names a rank the same way (`describe`, `failure_message`), so a rank's
  own report and its peers' name it in the same words.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from shadowgba.errors import ConfigError

NO_TRAINER_GROUP = ("the elastic layout (sync.ps.num_trainers > 0) has no process group over the trainers, which "
                    "this needs: there, only GBA mode or easgd_ps, with PS-hosted or no tables, runs (no sync mode or "
                    "switch to it, no checkpoint load in GBA mode, no TorchRec-sharded tables)")
"""Why a trainer collective is refused in the elastic layout."""


@dataclasses.dataclass(frozen=True)
class Roles:
    """This rank's place in a job of trainers and parameter servers."""

    rank: int
    """Global rank of this process."""
    world_size: int
    """Number of ranks, servers included."""
    num_servers: int
    """Number of parameter-server ranks (the last ones)."""
    server_ranks: tuple[int, ...]
    """Global ranks of the servers; server i is `server_ranks[i]`, named `ps{i}`."""
    trainer_ranks: tuple[int, ...]
    """Global ranks of the trainers; trainer i is `trainer_ranks[i]`, named `trainer{i}`."""
    trainer_index: int | None
    """Index of this rank among the trainers; None on servers."""
    server_index: int | None
    """Index of this rank among the servers; None on trainers."""
    trainer_group: dist.ProcessGroup | None = dataclasses.field(default=None, compare=False, repr=False)
    """Process group of the trainers (set by `start()` on trainers; None on servers and in the elastic
    layout): TorchRec's and the user's; the library's own collectives run on `sync_group()`."""
    elastic: bool = False
    """The elastic layout (`sync.ps.num_trainers` > 0): every process started on its own, trainers
    come and go, and there is no process group over the trainers (module docstring)."""

    @classmethod
    def assign(cls, rank: int, world_size: int, num_servers: int) -> "Roles":
        """The roles of `rank`, without any group; refuses a server count that leaves no trainer."""
        if isinstance(num_servers, bool) or not isinstance(num_servers, int) or not 0 <= num_servers < world_size:
            raise ConfigError(
                f"num_servers must be an integer in [0, world_size) so that at least one trainer remains; "
                f"got {num_servers!r} with world_size {world_size}"
            )
        first_server = world_size - num_servers
        is_server = rank >= first_server
        return cls(
            rank=rank,
            world_size=world_size,
            num_servers=num_servers,
            server_ranks=tuple(range(first_server, world_size)),
            trainer_ranks=tuple(range(first_server)),
            trainer_index=None if is_server else rank,
            server_index=rank - first_server if is_server else None,
        )

    @property
    def is_server(self) -> bool:
        """Whether this rank is a parameter server."""
        return self.server_index is not None

    @property
    def name(self) -> str:
        """This rank's name in messages: `ps{i}` or `trainer{i}`."""
        return server_name(self.server_index) if self.is_server else f"trainer{self.trainer_index}"

    def describe(self, rank: int) -> str:
        """Global rank `rank` as failures name it: `trainer {i} (rank r)` or `server {i} (ps{i}, rank r)`."""
        if rank in self.trainer_ranks:
            return f"trainer {self.trainer_ranks.index(rank)} (rank {rank})"
        if rank in self.server_ranks:
            index = self.server_ranks.index(rank)
            return f"server {index} ({server_name(index)}, rank {rank})"
        return f"rank {rank}"


def server_name(server_index: int) -> str:
    """The name of server `server_index` in messages: `ps{i}`."""
    return f"ps{server_index}"


def failure_message(roles: Roles, reason: str) -> str:
    """How a failed trainer is named to its peers and servers: `trainer {i} (rank r) aborted: reason`."""
    return f"{roles.describe(roles.rank)} aborted: {reason}"
