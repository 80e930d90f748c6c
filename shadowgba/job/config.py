"""`PSConfig`: the `sync.ps` section, the parameter-server ranks of a job and how the job treats them.

It lives with the job, not with the transport (`shadowgba.ps`), because every job reads it, a job
without servers included (`num_servers: 0`), before it knows whether it has a transport at all:
the roles (`shadowgba.job.roles`) follow from `num_servers` and `num_trainers`. So reading a config
loads no module of `shadowgba.ps`.

Imports: `shadowgba.errors` only.
"""

from __future__ import annotations

import dataclasses

from shadowgba.errors import ConfigError


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
    does not take it within `trainer_end.ALIVE_WITHIN_S` is named lost (`PeerLost`); one that does gets
    the calls in flight again (each run once however often it is sent) until `sync.timeout_s` after
    the call began, so a trainer stopped with a call in flight, or a slow call, is no failure.
    Must not exceed `trainer_timeout_s`."""
    on_trainer_lost: str = "continue"
    """What the servers do when they lose a trainer (its channel silent past `sync.timeout_s`, i.e.
    stopped or stuck, or closed with no new session within `server_end.RECONNECT_GRACE_S`, i.e.
    killed): `continue`: the trainer *departs*: its in-flight pushes are dropped (GBA's global batch
    counts samples, so the survivors fill it), no barrier or `stop()` waits for it, the survivors
    carry on, and a new process of the same trainer rejoins (a stopped one that resumes is refused
    and must restart). `fail`: the whole job ends, every rank naming the trainer.
    Default `continue`: a job that runs for days on a shared cluster loses trainers to preemption
    and pauses as a matter of course, and GBA's design drops a lost worker's batch and token without
    harm to correctness; ending every rank and redoing the work since the last checkpoint costs far
    more. Sync mode's all-reduce needs every trainer: there a loss still ends the job, its
    collective failing on the survivors with an error naming the lost trainer. A trainer that
    *fails* (its code or data raised, `abort()`) ends the job either way."""
    num_trainers: int = 0
    """0: one torchrun job holds every rank, the servers last. > 0: the elastic layout: this many
    trainer indices; the servers and each trainer are processes (or torchrun jobs) of their own,
    started and restarted independently, that meet at MASTER_ADDR:MASTER_PORT, where server 0 hosts
    the job's store; each process names its place in the environment variable SHADOWGBA_RANK
    (trainers 0 .. num_trainers - 1, then the servers). There is no process group over the trainers,
    so only GBA mode or easgd_ps (each trainer exchanging with the centre on its own), with
    PS-hosted (or no) tables, runs: no sync mode or switch, no TorchRec-sharded tables."""
    checkpoint_dir: str | None = None
    """Elastic layout: where the servers save their own state (GBA: the dense shard's slice, optimizer
    state and global step; S-EASGD: the centre's slice; the PS-hosted tables' rows and
    accumulators), server i in `ps{i}/`, every `checkpoint_every` global steps or exchanges with
    the centre slice (the newest `server_state.KEEP_LAST` kept), and where a new
    process of a server resumes from before it serves (`shadowgba.ps.server_state`). A folder every
    server sees. None: the servers save nothing themselves. (In one torchrun job the trainers'
    `Checkpointer` saves the servers' state, and a restart restarts every rank.)"""
    checkpoint_every: int = 100
    """Global steps (GBA) or exchanges with a centre slice (S-EASGD) between two of a server's checkpoints."""
    server_restart_s: float = 0.0
    """Elastic layout with `checkpoint_dir` (GBA: one server): how long a trainer whose server stopped
    answering waits for a new process of it (restarted by its supervisor, e.g. torchrun
    --max-restarts, whose agent hosts the store so that it outlives the server) before its calls
    fail. Meanwhile the trainers wait (their pushes and lookups block); once it is back, what
    they had in flight is dropped and counted, and they train on its restored parameters. 0: a
    server that takes no new session within `trainer_end.ALIVE_WITHIN_S` is lost and the job ends.
    GBA allows one server only: the dense shards of several would have to go back to one global
    step together. S-EASGD allows any number, restarting alone or together (a trainer's exchange
    that a restart cut is sent again to the new process, whose centre slice is its checkpoint's)."""
    lane_mb: float = 32.0
    """Size of each shared-memory lane of a trainer-server channel on one host (one per direction,
    reserved in /dev/shm when the channel opens): a tensor of up to half of it travels through
    shared memory, a larger one over TCP loopback, much slower (docs/benchmarks.md). Raise it when
    a push to one shard exceeds 16 MB: at least twice the largest, e.g. 4 x its size (float32 dense
    parameters / servers x 4 bytes). Costs that much shared memory per direction per trainer-server
    pair on one host, and once more per server for its board (the parameters it sends every
    trainer, written once); a /dev/shm too small for it refuses the lane, and that channel's
    tensors go over TCP."""
    same_host: bool = True
    """Use the same-host fast path between a trainer and a server on one host: the shared-memory
    lanes (`lane_mb`), the server's board (what it sends every trainer, written once) and gloo's
    loop thread at the lowest priority once both lanes are mapped (`shadowgba.ps.lane`, `board`,
    `channel`; what each saves: docs/benchmarks.md). False: every channel carries its tensors over
    gloo TCP, as between hosts: for a host whose /dev/shm or /proc is restricted, or to measure."""
    trainer_timeout_s: float = 300.0
    """How long a server at the end of the job waits for a trainer that has neither finished nor
    answered a ping before it gives up on it, naming it (`PeerLost`). Must be at least
    `rpc_timeout_s`, so that a call still in flight fails before its server gives up."""

    def __post_init__(self) -> None:
        if not 0 < self.rpc_timeout_s <= self.trainer_timeout_s:
            raise ConfigError(
                f"rpc_timeout_s must be > 0 and <= trainer_timeout_s ({self.trainer_timeout_s:g}), got {self.rpc_timeout_s:g}"
            )
        if self.num_servers < 0:
            raise ConfigError(f"num_servers must be >= 0, got {self.num_servers}")
        if self.on_trainer_lost not in ("continue", "fail"):
            raise ConfigError(f"on_trainer_lost must be 'continue' or 'fail', got {self.on_trainer_lost!r}")
        if self.num_trainers < 0:
            raise ConfigError(f"num_trainers must be >= 0, got {self.num_trainers}")
        if self.num_trainers and not self.num_servers:
            raise ConfigError("num_trainers > 0 (the elastic layout) needs num_servers >= 1")
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.checkpoint_dir and not self.num_trainers:
            raise ConfigError("checkpoint_dir (the servers' own checkpoints) needs the elastic layout (num_trainers > 0): "
                             "in one torchrun job the trainers' Checkpointer saves the servers' state")
        if not self.lane_mb > 0:
            raise ConfigError(f"lane_mb must be > 0, got {self.lane_mb:g}")
        if self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.server_restart_s < 0:
            raise ConfigError(f"server_restart_s must be >= 0, got {self.server_restart_s:g}")
        if self.server_restart_s and not self.checkpoint_dir:
            raise ConfigError("server_restart_s > 0 (trainers wait for a restarted server) needs checkpoint_dir, "
                             "the servers' own checkpoints a new server process resumes from")

    @property
    def lane_bytes(self) -> int:
        """`lane_mb` in bytes, as the transport takes it; 0 without the same-host path (`same_host`)."""
        return int(self.lane_mb * (1 << 20)) if self.same_host else 0
