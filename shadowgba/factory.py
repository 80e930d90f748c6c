"""The front door: `join` a job on every rank, then `dense_sync` on its trainers, whatever the algorithm.

    job = shadowgba.join(config)          # every rank; a server rank serves here until the job ends
    if job.is_server:
        return
    model = DistributedModelParallel(module, device=device, **job.dmp_kwargs())
    with shadowgba.dense_sync(model, optimizer, job, local_batch_size=512) as sync:
        for batch in batches:             # the user's loop (or a TorchRec train pipeline), unchanged
            ...

`join` reads `config.ps.num_servers`: without servers every rank is a trainer and the trainer group
is a new group over every rank whose collectives time out after `sync.timeout_s`; with servers the
last ranks become servers, start serving what `config.algo` needs (GBA's dense shards or the
S-EASGD centre, plus embedding shards when `tables` are given) and return only when every trainer
has called `job.close()`. The trainers' own collectives must then
run on `job.trainer_group`: `job.dmp_kwargs()` gives TorchRec the trainer-only sharding environment
(and no dense DDP), and `dense_sync` refuses a DMP that spans the servers, naming that fix.

With `config.sharding_group_size: k` (the 2D layout, `shadowgba.layout`) the trainers form replica
groups of k ranks: `job.dmp_kwargs()` shards the tables over this rank's group only, the guard
gives every group the same plan, and `dense_sync` hands the shadow runtime this rank's table
shards to average with their replicas in the other groups (`shadowgba.shadow.tables`).

`dense_sync` picks the runtime: `ShadowSync` for ma, easgd, bmuf and easgd_ps (shadow thread or
foreground rounds), `GBASync` for gba (GBA, sync all-reduce, plain async). Both are `DenseSync`s.
For gba it also finds the dense torch optimizer inside TorchRec's keyed / combined optimizers and
infers lockstep from TorchRec-sharded tables (their per-step all-to-all pairs the trainers' steps).

Imports: a job without servers loads no module of the transport (`shadowgba.ps`) nor GBA's runtime.
Membership is the job's own package (`shadowgba.job`); what only a job with servers, or gba, needs
is imported where it is used: `start_transport` in `join`, the services in `shadowgba.serving` on a
server rank, `GBASync` in `dense_sync`, the S-EASGD centre's client in `Job.centre`.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

import sync_algos
from shadowgba import optional, reporting
from shadowgba.batch_size import check_first_batch
from shadowgba.config import PS_ALGOS, SyncConfig, load_config
from shadowgba.dense import trainable_named_parameters
from shadowgba.errors import PeerLost, SetupError
from shadowgba.interface import DenseSync
from shadowgba.job.blame import Blame
from shadowgba.job.heartbeat import Heartbeat
from shadowgba.job.notices import NoticeBoard
from shadowgba.job.roles import NO_TRAINER_GROUP, Roles, failure_message
from shadowgba.job.store import job_store
from shadowgba.job.survivors import INCARNATION, SurvivingGroups, launch_warning
from shadowgba.layout import ReplicaLayout
from shadowgba.network import init_process_group
from shadowgba.nonfinite import NonFiniteGuard
from shadowgba.reporting import MetricsReporter
from shadowgba.shadow.runtime import ShadowSync
from shadowgba.shadow.tables import TableFragments

if TYPE_CHECKING:  # the transport and its services: imported where a job has servers (module docstring)
    from shadowgba.ps.easgd_center import CenterClient
    from shadowgba.ps.embedding import PSEmbeddingBagCollection
    from shadowgba.ps.embedding_shard import PSEmbeddingConfig
    from shadowgba.ps.transport import Transport

logger = logging.getLogger("shadowgba")

_JOB_NUMBERS = itertools.count()
"""Numbers the jobs this process joins (`Job.name`)."""

LOCKSTEP_EVERY = 20
"""With TorchRec-sharded tables (trainers step together anyway), how many GBA steps apart the
trainers agree on leaving GBA, unless `sync.gba.lockstep_every` says otherwise."""


@dataclasses.dataclass(frozen=True)
class Survivors:
    """The trainers still in a job (`Job.survivors`)."""

    group: dist.ProcessGroup
    """A process group of exactly them (the job's `trainer_group` when none departed)."""
    ranks: tuple[int, ...]
    """Their global ranks, in trainer order: `ranks[0]` is the first survivor (the one to write results)."""
    departed: tuple[int, ...]
    """The trainer indices that departed."""
    replica_group: dist.ProcessGroup | None = None
    """In a 2D job, this rank's replica group over the surviving groups (the layout's own when none
    was lost): where its table shards meet their replicas."""


@dataclasses.dataclass
class Job:
    """This rank's place in the job: trainer or server, and the group its trainer collectives use."""

    config: SyncConfig
    """The `sync` section the job was joined with."""
    roles: Roles
    """Rank, trainers, servers, and the trainers' own process group."""
    transport: Transport | None = None
    """With servers: this rank's transport to them (started by `join`, ended by `close` / `abort`)."""
    tables: Sequence[Any] | None = None
    """`EmbeddingBagConfig`s of the PS-hosted tables, if any."""
    table_options: PSEmbeddingConfig | None = None
    """How the PS-hosted tables are initialised and updated."""
    closed: bool = False
    sharding_guard: Any = None
    """On trainers of a job with servers: refuses a DMP over the whole world (`ShardingGuard`)."""
    name: str = dataclasses.field(default_factory=lambda: f"job{next(_JOB_NUMBERS)}")
    """The same on every rank (every rank joins the jobs of a process group in the same order): the
    key of this job's notice board, where a failed trainer posts why (`NoticeBoard.post_abort`)."""
    failure: str | None = None
    """Set by `announce_failure`: how this trainer's failure was named to the job."""
    heartbeat: Heartbeat | None = None
    """On trainers: this trainer's beat on the notice board, by which a peer whose collective failed
    names a trainer that was killed or is stuck (it posts no notice)."""
    layout: ReplicaLayout | None = None
    """In a 2D job (`sync.sharding_group_size` > 0): this rank's sharding and replica groups."""
    survival: SurvivingGroups | None = None
    """In a 2D job under `sync.on_group_lost: continue`, once `dense_sync` made it (with a torchrun
    job per replica group, `join`): which replica groups are in the job (`Job.survivors` reads it)."""
    replica_store: dist.Store | None = None
    """With a torchrun job per replica group (`sync.replica_jobs`): the store the jobs share, where
    the notice board and the groups across the jobs live."""
    own_store: dist.Store | None = None
    """Where the default group's store goes with one process (ranks started by hand, several
    torchrun agents): the job's own store (`shadowgba.job.store`), where the notice board and the
    groups rebuilt after a lost replica group live, so that no exit takes them away."""
    incarnation: int = 1
    """With a torchrun job per replica group: which process set of this rank's group this is (1:
    the first; each restart counts one more, in the replica store)."""
    rounds_group: dist.ProcessGroup | None = None
    """With a torchrun job per replica group: the dense rounds' group across the jobs, made for the
    runtime alone (the job's `trainer_group` is this group's own ranks)."""
    served: dict[str, object] = dataclasses.field(default_factory=dict)
    """On servers: the services this rank served, by name (their `stats()` outlive the job)."""
    _centre: CenterClient | None = dataclasses.field(default=None, init=False, repr=False)

    @property
    def is_server(self) -> bool:
        """Whether this rank was a parameter server (its part of the job is over when `join` returns)."""
        return self.roles.is_server

    @property
    def trainer_group(self) -> dist.ProcessGroup:
        """The process group of the trainers: every trainer collective (TorchRec's included) runs on it."""
        return self.roles.trainer_group

    @property
    def trainer_index(self) -> int:
        """This trainer's index among the trainers (its data shard)."""
        return self.roles.trainer_index

    @property
    def num_trainers(self) -> int:
        """How many ranks train."""
        return len(self.roles.trainer_ranks)

    def dmp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `DistributedModelParallel`: shard over the trainers only (in a 2D
        job, over this rank's sharding group), no dense DDP."""
        if self.roles.elastic:
            raise SetupError(f"Job.dmp_kwargs() (TorchRec-sharded tables): {NO_TRAINER_GROUP}")
        group = self.layout.sharding_group if self.layout is not None else self.trainer_group
        return optional.torchrec_integration("Job.dmp_kwargs()").dmp_kwargs(group)

    def ps_embeddings(self) -> PSEmbeddingBagCollection:
        """The trainer side of the PS-hosted tables given to `join` (an EmbeddingBagCollection)."""
        if self.tables is None or self.table_options is None:
            raise SetupError("ps_embeddings() needs join(config, tables=..., table_options=...)")
        embedding = optional.ps_embedding("Job.ps_embeddings()")
        return embedding.PSEmbeddingBagCollection(list(self.tables), self.table_options, self.require_transport())

    def centre(self) -> CenterClient:
        """Under easgd_ps, the trainer side of the S-EASGD centre on the servers: one per job, the
        `Centre` that `dense_sync` exchanges with, and the `Stateful` that puts the centre in a checkpoint."""
        if self.config.algo != "easgd_ps" or self.is_server:
            role = "server" if self.is_server else "trainer"
            raise SetupError(f"centre() needs a trainer of an easgd_ps job; this is a {role} of sync.algo "
                             f"'{self.config.algo}'")
        if self._centre is None:
            from shadowgba.ps.easgd_center import CenterClient  # a job with servers (module docstring)
            self._centre = CenterClient(self.require_transport())
        return self._centre

    @functools.cached_property
    def notices(self) -> NoticeBoard:
        """This job's notice board (`shadowgba.job.notices`): who left, and why. In the elastic
        layout, in the servers' store (there is no default group); with a torchrun job per replica
        group, in the replica store, one board for all of them; else in `own_store` if there is one."""
        if self.replica_store is not None:
            return NoticeBoard(self.name, self.replica_store, attempt=0)
        return NoticeBoard(self.name, self.transport.store if self.roles.elastic else self.own_store)

    @property
    def store(self) -> dist.Store:
        """A store every rank reaches until the job's last process ends, whichever left first (for
        what runs after training, e.g. a harness's posts): the replica store, the job's own
        (`own_store`), or the default group's, which then outlives every rank."""
        if self.replica_store is not None:
            return self.replica_store
        return self.own_store if self.own_store is not None else dist.distributed_c10d._get_default_store()

    def require_transport(self) -> Transport:
        """The transport to the servers; `SetupError` in a job without servers."""
        if self.transport is None:
            raise SetupError("this needs a job with servers (sync.ps.num_servers >= 1)")
        return self.transport

    def survivors(self, name: str = "survivors") -> "Survivors":
        """Collective over the trainers still in the job, never over departed ones: the group for what
        runs after training (a barrier, gathers, an evaluation), which the job's `trainer_group`
        cannot carry once a trainer departed (`sync.ps.on_trainer_lost: continue`; a collective
        with a stopped process waits for its timeout, then fails naming nobody). Every surviving
        trainer calls it with the same `name`. With servers they meet at the servers' barrier, which
        waits for no departed trainer, and agree on who met there; in a 2D job under
        `sync.on_group_lost: continue` the survivors are the ranks of the replica groups still in
        it, as the rounds agreed (`survival`). Any other job loses no trainer (a lost one ends the
        job): its survivors are every trainer, on `trainer_group`. Not in the elastic layout (no
        group over the trainers). `PeerLost` if this trainer itself departed."""
        if self.roles.elastic:
            raise SetupError(f"Job.survivors(): {NO_TRAINER_GROUP}")
        if self.is_server:
            raise SetupError("Job.survivors() is for trainers")
        ranks = self.roles.trainer_ranks
        if self.transport is not None:
            met = self.transport.meet(f"shadowgba.survivors.{name}")
        elif self.survival is not None:
            met = tuple(ranks.index(rank) for rank in self.survival.survivors())
        else:
            met = tuple(range(len(ranks)))
        if self.roles.trainer_index not in met:
            raise PeerLost(f"{self.roles.name} departed the job before Job.survivors('{name}'): the trainers "
                           f"{list(met)} met without it")
        departed = tuple(index for index in range(len(ranks)) if index not in met)
        replicas = self.layout.replica_group if self.layout is not None else None
        if not departed and self.replica_store is None:
            return Survivors(self.trainer_group, ranks, (), replicas)
        members = tuple(ranks[index] for index in met)
        if self.survival is not None:  # the 2D members: their group, and this rank's replica group among them
            group, replicas = self.survival.groups()
        else:  # the departed take no part in making it
            group = dist.new_group(list(members), timeout=datetime.timedelta(seconds=self.config.timeout_s),
                                   use_local_synchronization=True)
        if departed:
            logger.warning("shadowgba: %s: trainers %s departed the job; the survivors' group is ranks %s",
                           self.roles.name, list(departed), list(members))
        return Survivors(group, members, departed, replicas)

    def close(self) -> None:
        """Leave the job (collective over every rank); with servers, releases them once all trainers have."""
        self._leave(lambda transport: transport.stop(trainer_timeout_s=self.config.ps.trainer_timeout_s))

    @functools.cached_property
    def blame(self) -> Blame:
        """This trainer's judge of failures (`shadowgba.job.blame`): which rank failed first, on `notices`."""
        roles = self.roles
        peers = [rank for rank in roles.trainer_ranks if rank != roles.rank]
        return Blame(self.notices, roles.rank, peers, roles.describe,
                     cause_number=lambda: self.survival.epoch if self.survival is not None else 0)

    def announce_failure(self, error: BaseException) -> BaseException | None:
        """Tell the job that this trainer's part failed with `error`, waiting for no peer, and return
        the error the user should see instead, if any. `Blame.judge` decides who failed first: this
        rank (the user's exception, its own NaN: `error` stays what the user sees), or a peer (a
        `PeerLost` naming it, `error` as its cause). The verdict is posted on the notice board (for
        peers whose collectives fail once this rank is gone) and sent to every server
        (`Transport.notify_abort`: they refuse every later call with it)."""
        if self.closed or self.failure is not None:
            return None
        verdict = self.blame.judge(error)
        if verdict.earlier is not None:
            error.add_note(f"shadowgba: an earlier failure ended the job first: {verdict.earlier}")
        self.failure = verdict.why if verdict.own else \
            f"{verdict.why} ({self.roles.describe(self.roles.rank)} ended after it)"
        self.notices.post_abort(self.roles.rank, self.failure)
        if self.transport is not None:
            self.transport.notify_abort(self.failure, verdict.culprits)
        return verdict.replacement

    def abort(self) -> None:
        """Leave the job after `announce_failure`, waiting for no peer: with servers, the channels are
        closed without draining and the transport's groups destroyed (`Transport.abort`)."""
        self._leave(lambda transport: transport.abort(
            self.failure or failure_message(self.roles, "its part of the job ended without closing")))

    def _leave(self, end_transport: Callable[[Transport], None]) -> None:
        """Once: mark the job closed, remove the sharding guard and, with servers, `end_transport(transport)`."""
        if self.closed:
            return
        self.closed = True
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.sharding_guard is not None:
            self.sharding_guard.remove()
        if self.transport is not None:
            end_transport(self.transport)


def join(
    config: SyncConfig | str | Path,
    tables: Sequence[Any] | None = None,
    table_options: PSEmbeddingConfig | None = None,
    backend: str | None = None,
) -> Job:
    """Join the job on every rank (collective, after or instead of `init_process_group`).

    `config` is the `sync` section, or a YAML file whose `sync` section it is. Server ranks serve
    what the config needs and return a closed `Job` with `is_server` once the trainers are done.
    """
    if not isinstance(config, SyncConfig):
        config = load_config(SyncConfig, config, section="sync")
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    config.check_world_size(world_size)  # before this rank makes any process group
    if tables is not None and (table_options is None or not config.ps.num_servers):
        raise SetupError("PS-hosted tables need table_options (see ps_table_options) and sync.ps.num_servers >= 1")
    if config.replica_jobs.store is not None:
        return _join_replica_job(config, backend)
    if not config.ps.num_servers:
        if not dist.is_initialized():
            init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
        roles = Roles.assign(dist.get_rank(), dist.get_world_size(), num_servers=0)
        # not the default group: its timeout is the user's (torch's 30 min), and a peer stopped for
        # good would hold TorchRec's all-to-all that long; this one gives up after sync.timeout_s
        trainers = dist.new_group(timeout=datetime.timedelta(seconds=config.timeout_s))
        job = Job(config, dataclasses.replace(roles, trainer_group=trainers))
        if config.sharding_group_size:
            torchrec_integration = optional.torchrec_integration("sync.sharding_group_size (the 2D layout)")
            job.layout = ReplicaLayout.build(roles.trainer_ranks, roles.rank, config.sharding_group_size,
                                             config.timeout_s)
            job.sharding_guard = torchrec_integration.ShardingGuard(job.trainer_group, 0, job.layout)
            job.sharding_guard.install()
            warning = launch_warning(roles.rank, config.sharding_group_size)
            if config.on_group_lost == "continue" and warning is not None:
                logger.warning("shadowgba: %s", warning)
        job.own_store = job_store(roles.rank, roles.world_size, job.name, config.timeout_s)
        job.heartbeat = Heartbeat(job.notices, roles.rank).start()
        return job
    from shadowgba.ps.start import start_transport  # a job with servers (module docstring)
    transport = start_transport(config.ps.num_servers, backend or "gloo", timeout_s=config.timeout_s,
                                rpc_timeout_s=config.ps.rpc_timeout_s, on_trainer_lost=config.ps.on_trainer_lost,
                                num_trainers=config.ps.num_trainers, server_restart_s=config.ps.server_restart_s,
                                lane_bytes=config.ps.lane_bytes)
    roles = transport.roles
    job = Job(config, roles, transport, tables, table_options)
    if not roles.elastic:  # every rank: a server's posts after the job (a harness's) go there too
        job.own_store = job_store(roles.rank, roles.world_size, job.name, config.timeout_s)
    if roles.is_server:
        from shadowgba.serving import serve  # a server rank (module docstring)
        writer = serve(config, roles, transport, job.served, tables, table_options)
        try:
            job.close()
        finally:
            if writer is not None:
                writer.close()
        return job
    if optional.available("torchrec") and not roles.elastic:  # without TorchRec or a trainer group, no DMP to guard
        torchrec_integration = optional.torchrec_integration("the sharding guard")
        job.sharding_guard = torchrec_integration.ShardingGuard(roles.trainer_group, roles.num_servers)
        job.sharding_guard.install()
    job.heartbeat = Heartbeat(job.notices, roles.rank).start()
    return job


def _join_replica_job(config: SyncConfig, backend: str | None) -> Job:
    """`join` for one replica group of a 2D job launched as a torchrun job per group
    (`sync.replica_jobs`): this torchrun job's ranks are the group's sharding group (TorchRec's, on
    its default group), job-wide rank `group * k + local rank`. The groups across the jobs come
    later, once the model is built (`_meet_replica_groups`, from `dense_sync`)."""
    jobs = config.replica_jobs
    torchrec_integration = optional.torchrec_integration("sync.replica_jobs (the 2D layout)")
    if not dist.is_initialized():
        init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    local_rank, size = dist.get_rank(), dist.get_world_size()  # size: sharding_group_size (`check_world_size`)
    rank = jobs.group * size + local_rank
    roles = Roles.assign(rank, jobs.num_groups * size, num_servers=0)
    local = dist.new_group(timeout=datetime.timedelta(seconds=config.timeout_s))  # TorchRec's: this group's ranks
    job = Job(config, dataclasses.replace(roles, trainer_group=local), name=jobs.name,
              replica_store=_replica_store(jobs.address, config.timeout_s))
    job.layout = ReplicaLayout(size, jobs.num_groups, jobs.group, local_rank, local)
    job.sharding_guard = torchrec_integration.ShardingGuard(local, 0, job.layout)
    job.sharding_guard.install()
    # which process set of this group this is: counted before its notices are cleared, so that the
    # count proves its predecessor gone to the members that still look for evidence of the loss
    counted = [job.notices.count(INCARNATION, jobs.group, add=1) if local_rank == 0 else None]
    dist.broadcast_object_list(counted, src=0, group=local)
    if counted[0] is None:
        raise SetupError(f"sync.replica_jobs.store {jobs.store}: the replica store stopped answering")
    job.incarnation = int(counted[0])
    job.notices.clear(rank)  # a process of this rank that ran before left its notices there
    job.heartbeat = Heartbeat(job.notices, rank).start()
    return job


def _meet_replica_groups(job: Job) -> None:
    """Collective across the torchrun jobs of a job under `sync.replica_jobs`, with the model built:
    make the groups across them (dense rounds, this rank's replica group) in the replica store,
    with every group at the job's start, or, for a group that runs again after it was lost (its
    process set's number, counted in the store, is above 1), once the members let it in at a round
    of theirs (`SurvivingGroups.wait_to_join`); the runtime then takes a member's replica."""
    jobs, layout, incarnation = job.config.replica_jobs, job.layout, job.incarnation
    assert layout is not None and job.replica_store is not None
    job.survival = SurvivingGroups(job.roles.trainer_ranks, job.roles.rank, layout.group_size, job.notices,
                                   job.config.timeout_s, job.replica_store, _rounds_device(), rejoins=True)
    if incarnation > 1:  # this group ran before: the members let it in after a round of theirs
        logger.warning("shadowgba: replica group %d (process set %d) asks to rejoin the job", jobs.group, incarnation)
        if layout.position == 0:
            job.survival.request_join(incarnation)
        job.survival.wait_to_join(incarnation, jobs.join_timeout_s)
    job.rounds_group, replica = job.survival.groups()
    job.layout = dataclasses.replace(layout, replica_group=replica)


def _rounds_device() -> torch.device:
    """Where the rounds' groups made from a store run their collectives: this rank's GPU, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _replica_store(address: tuple[str, int], timeout_s: float) -> dist.Store:
    """A client of the replica store at `address`; `SetupError` naming how to start one when none answers."""
    host, port = address
    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as error:
        raise SetupError(f"sync.replica_jobs.store {host}:{port}: no replica store answered within {timeout_s:g} s "
                         f"(sync.timeout_s); start one first, on a host every group reaches: python -m "
                         f"shadowgba.replica_store --port {port}") from error


def ps_table_options(
    config: SyncConfig, num_trainers: int, local_batch_size: int, optimizer: str = "sgd", lr: float = 0.01,
    seed: int = 0,
) -> PSEmbeddingConfig:
    """How PS-hosted tables update under `config`: under GBA's global-batch aggregation their row
    gradients are aggregated over the same global batch as the dense ones, stale ones weighed by
    `sync.gba.row_decay`; without aggregation (plain async PS) and under S-EASGD they are applied
    on arrival (Hogwild)."""
    aggregate = config.algo == "gba" and config.gba.aggregation == "global_batch"
    PSEmbeddingConfig = optional.ps_embedding_shard("ps_table_options()").PSEmbeddingConfig
    return PSEmbeddingConfig(
        optimizer=optimizer, lr=lr, seed=seed, max_in_flight=config.ps.max_in_flight,
        mode="aggregate" if aggregate else "hogwild",
        global_batch=num_trainers * local_batch_size if aggregate else 0,
        decay=config.gba.row_decay if aggregate else PSEmbeddingConfig().decay, on_nonfinite=config.on_nonfinite,
    )


def dense_sync(
    model: nn.Module,
    optimizer: Any,
    job: Job | SyncConfig,
    local_batch_size: int | None = None,
    params: Iterable[tuple[str, nn.Parameter]] | None = None,
    end_job: bool = True,
    summary_writer: Any = None,
) -> DenseSync:
    """The runtime that keeps `model`'s dense parameters in sync under `job.config.algo` (not started).

    `optimizer` is the one whose `step()` marks a step boundary (a torch optimizer, or TorchRec's
    keyed / combined optimizer). `local_batch_size` (samples per trainer step) is needed by gba,
    whose global batch is trainers x local batch; when given, a first batch of another size is
    warned about (`shadowgba.batch_size`). `params` overrides which parameters are dense
    (default: all trainable ones minus TorchRec-sharded tables). With `end_job`, a `with` block
    over the sync that ends normally also ends this trainer's part of the job (`job.close()`,
    releasing the servers once every trainer has); pass False to use the servers after it (e.g.
    evaluating on PS-hosted tables) and call `job.close()` yourself. Whatever `end_job` says, a
    `with` block that ends by an exception (the user's, or the sync's own) announces it to the job
    and leaves it at once (`Job.announce_failure`, `Job.abort`): the peers and servers end naming
    this trainer instead of waiting for it. The runtime's metrics are logged every
    `sync.log_interval_s` and written to TensorBoard when `summary_writer` (a `SummaryWriter`) is
    given or `sync.tensorboard_dir` names a directory (`shadowgba.reporting`).

    The runtime's `NonFiniteGuard` is also given to the model's tables (TorchRec-sharded and
    PS-hosted): NaN / Inf in this trainer's embedding gradients or row pushes is stopped before any
    peer or server receives it, and its step is skipped or the job fails naming it (`sync.on_nonfinite`).
    """
    if isinstance(job, SyncConfig):
        if job.ps.num_servers:
            raise SetupError(f"sync.algo '{job.algo}' with sync.ps.num_servers > 0 needs job = shadowgba.join(config) "
                             "on every rank first")
        job = join(job)
    if job.is_server:
        raise SetupError("dense_sync() runs on trainer ranks; a server's part of the job ends in join()")
    config = job.config
    guard = NonFiniteGuard(job.roles.describe(job.roles.rank), config.on_nonfinite,
                           config.max_skipped_steps)
    torchrec_integration = _torchrec_integration()
    if torchrec_integration is not None:
        torchrec_integration.refuse_dense_ddp(model)  # DDP and the sync both: the user forgot dmp_kwargs()
        torchrec_integration.check_batches(model)  # malformed batches refused before TorchRec sees them
        torchrec_integration.guard_tables(model, guard)  # NaN / Inf caught before it reaches a peer's shards
    named = list(params) if params is not None else list(_dense_named_parameters(model, torchrec_integration))
    if sync_algos.get_algorithm(config.algo).kind == "gradient":
        if local_batch_size is None or local_batch_size < 1:
            raise SetupError("sync.algo gba needs dense_sync(..., local_batch_size=samples per trainer step)")
        dense_optimizer = optimizer
        lockstep_every = config.gba.lockstep_every
        if torchrec_integration is not None:
            dense_optimizer = torchrec_integration.dense_optimizer(optimizer, [param for _, param in named])
            if lockstep_every is None and torchrec_integration.has_sharded_tables(model):
                lockstep_every = LOCKSTEP_EVERY
        from shadowgba.gba.runtime import GBASync  # gba's runtime and its transport (module docstring)
        sync: DenseSync = GBASync(model, dense_optimizer, config.gba, job.roles, local_batch_size, named,
                                  lockstep_every=lockstep_every or 0, on_nonfinite=config.on_nonfinite,
                                  timeout_s=config.timeout_s, guard=guard, transport=job.transport)
    else:
        # S-EASGD's broadcast and final average run on the library's own group, never on TorchRec's
        group, resources, tables = job.trainer_group, None, None
        if config.algo == "easgd_ps":  # the elastic layout has no trainer group: each trainer on its own
            group = None if job.roles.elastic else job.require_transport().sync_group()
            resources = {"centre": job.centre(), "trainers": job.num_trainers}
        if job.layout is not None:
            if torchrec_integration is None or not torchrec_integration.has_sharded_tables(model):
                raise SetupError("sync.sharding_group_size > 0 needs a DistributedModelParallel built with "
                                 "**job.dmp_kwargs(): its tables are what the replica groups keep in sync")
            shards = torchrec_integration.fused_table_shards(model, config.tables.optimizer_state)
            if job.replica_store is not None and job.rounds_group is None:
                _meet_replica_groups(job)
            tables = TableFragments(shards, job.layout.replica_group, config.tables)
            if config.on_group_lost == "continue" and job.survival is None:
                job.survival = SurvivingGroups(job.roles.trainer_ranks, job.roles.rank, config.sharding_group_size,
                                               job.notices, config.timeout_s, job.own_store, _rounds_device())
        sync = ShadowSync(model, optimizer, config, process_group=job.rounds_group or group, params=named,
                          algorithm_kwargs=resources, guard=guard, tables=tables, survival=job.survival,
                          own_group=job.rounds_group is not None)
    if local_batch_size is not None:
        check_first_batch(model, local_batch_size)
    owns_writer = summary_writer is None and config.tensorboard_dir is not None
    if owns_writer:
        summary_writer = reporting.summary_writer(config.tensorboard_dir, job.trainer_index)
    sync.reporter = MetricsReporter(sync.metrics, config.log_interval_s, summary_writer, owns_writer)
    sync.call_on_failure(job.announce_failure, job.abort)
    if end_job:
        sync.call_after_exit(job.close)
    return sync


def _torchrec_integration() -> Any:
    """The TorchRec adapter when torchrec is loaded (a model cannot be a DMP otherwise), else None."""
    if "torchrec" not in sys.modules:
        return None
    return optional.torchrec_integration("a TorchRec model")


def _dense_named_parameters(model: nn.Module, torchrec_integration: Any) -> Iterable[tuple[str, nn.Parameter]]:
    if torchrec_integration is not None:
        return torchrec_integration.dense_named_parameters(model)
    return trainable_named_parameters(model)


__all__ = ["Job", "PS_ALGOS", "dense_sync", "join", "ps_table_options"]
