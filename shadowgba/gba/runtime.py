"""GBASync: the dense parameters of a trainer under sync all-reduce or GBA, switchable while running.

    job = shadowgba.join(config)                       # servers serve the dense shards until the end
    with GBASync(model, optimizer, config.gba, job.roles, 512, transport=job.transport) as gba:
        for batch in data:                             # the user's loop, unchanged
            loss = model(batch); loss.backward()
            optimizer.step()                           # replaced: the dense update is GBASync's
        gba.switch_mode("sync")                        # or automatically, by the switch policy

The user's optimizer names the one optimizer (type and hyperparameters, `OptimizerSpec`) but never
steps itself: the authoritative copy is a `FlatOptimizer`, on every trainer in sync mode and sliced
over the dense PS shards in GBA mode. Its learning rate follows `GBAConfig.schedule` by global step.

GBASync is the mode state machine (`Mode`) and the switch and close protocols; it composes
- `allreduce.SyncAllReduce`: sync mode's one collective per step, [gradient | contributors | stop |
  switch | compute time per trainer] (as DDP, plus the flags and the policy's inputs), and
- `client.GBAClient`: GBA mode's bounded queue, pusher and watcher threads and installs of the
  parameters they bring; the training thread never waits,
and talks to the shards only through `shards.DenseShardClient`.

Switching: `shadowgba.gba.mode` (the modes, their transitions and the two switch protocols).

Groups, barriers and why nothing deadlocks or mis-pairs:
- Every collective of GBASync runs on the library's own sync group over the trainers (`_group`),
  never on `roles.trainer_group`, which TorchRec (its per-step all-to-all, `job.dmp_kwargs()`) and
  the user use: a library collective can never be paired with one of theirs. Collectives run only in
  the training thread; the client's threads only call the servers (`Transport`).
- Barriers are not collectives: the GBA -> sync switch, a checkpoint load in GBA mode and the close
  in GBA mode meet the other trainers through shard 0's server (`TrainerTransport.barrier`), so a
  trainer waiting in one never blocks a peer's collective, learns at once that a peer aborted
  (`PeerLost` with its reason), and gives up on a peer that does not come within `timeout_s`.
- Sync mode issues one all-reduce per step and every decision (stop, switch, policy) is taken from
  its result, identical on every trainer, after the same step (`allreduce`).
- The remaining collectives cannot meet a peer's TorchRec all-to-all because every trainer issues
  them at the same point of the same step: the agreement on leaving GBA (`_leave_gba_due`) every
  `lockstep_every` GBA steps, a count equal on lockstep trainers; the broadcast of trainer 0's
  outcome (`_on_trainer0`), right after a barrier or inside an agreed switch; the sync close's stop
  all-reduce, which pairs with the peers' all-reduce of the same step; the closing average of
  LOCAL mode, which every trainer reaches from `close()` after the stop flag.
- GBA -> sync and the close in GBA mode: shard 0 decides between them under one lock
  (`DenseShard.begin_close`): once a switch is pending a closing trainer takes part in it first,
  and once a trainer is closing no switch can start, so a close barrier never meets a switch.
- What trainer 0 alone does inside a switch (configure or export the shards, load a checkpoint into
  them) ends in a broadcast of its outcome (`_on_trainer0`): if it failed, every trainer raises the
  same `SyncError`, none is left waiting in the next collective.
- A trainer that fails (`abort()`) issues nothing peer-dependent: it stops its threads, and the sync
  group is destroyed (here without servers, by `Transport.abort` with them), so a peer's pending
  collective on it fails at once, as `SyncError` (`_collective`); the job (`dense_sync`) tells the
  servers and the notice board which trainer failed and why.

One global step: the dense shards apply every push as shard 0 decided it (`server`), so at
every switch and at close every shard holds the same k, and a push's single token is the oldest
of the installed slices' (`GBAClient.global_step`).

NaN / Inf never spreads (`on_nonfinite`, `sync.on_nonfinite`): a trainer checks its gradient every
step. Sync mode: a non-finite one contributes nothing to the all-reduce (not counted among the
contributors) and sets this trainer's flag in it, so every trainer learns who, at the same step;
`skip`: every trainer applies the mean of the others' and counts it (`metrics.nonfinite_skipped`),
replicas stay identical; `fail`: every trainer raises `SyncError` naming the trainer and its rank,
before applying anything. GBA mode: `skip`: the push is marked non-finite, shard 0 drops and counts
it (`nonfinite_dropped`), training goes on; `fail`: this trainer raises `SyncError` at once and
shard 0 refuses every later push, naming it. Local mode: the gradient is skipped or raised on.

Checkpoints (`state_dict`): mode, dense parameter names, the optimizer export (parameters,
optimizer state, global step: this trainer's in sync mode, reassembled from the shards in GBA
mode, at a cut where every shard is at the same k) and the switch policy's state. Any mode loads
any of them; a state that does not fit is refused with `CheckpointError` before anything changes.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from typing import Any, Callable, ClassVar, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from shadowgba.dense import DenseParams, trainable_named_parameters
from shadowgba.errors import CheckpointError, ConfigError, SetupError, SyncError
from shadowgba.serialized import check_entries
from shadowgba.flat_optimizer import FlatOptimizer, OptimizerSpec, check_export
from shadowgba.gba.allreduce import SyncAllReduce, SyncRound
from shadowgba.gba.client import GBAClient
from shadowgba.gba.config import GBAConfig
from shadowgba.gba.fresh import FreshWaitPolicy
from shadowgba.gba.mode import Mode, ModeSwitches
from shadowgba.gba.switch_policy import SwitchPolicy
from shadowgba.interface import DenseSync
from shadowgba.metrics import GBAMetrics
from shadowgba.nonfinite import DEFAULT_ON_NONFINITE, NonFiniteGuard, check_on_nonfinite, nonfinite_failure
from shadowgba.gba.server import serve_dense_shard
from shadowgba.gba.shards import DenseShardClient
from shadowgba.job.roles import NO_TRAINER_GROUP, Roles
from shadowgba.ps.trainer_end import TrainerTransport
from shadowgba.step_hook import StepHook

__all__ = ["GBASync", "Mode", "serve_dense_shard"]  # serve_dense_shard: GBA's server-rank entry point

logger = logging.getLogger("shadowgba")


class GBASync(ModeSwitches, DenseSync):
    """Sync all-reduce / GBA for one trainer's dense parameters (see the module docstring)."""

    modes: ClassVar[tuple[str, ...]] = (Mode.SYNC, Mode.GBA)

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: GBAConfig,
        roles: Roles,
        local_batch_size: int,
        params: Iterable[tuple[str, nn.Parameter]] | None = None,
        lockstep_every: int = 0,
        on_nonfinite: str = DEFAULT_ON_NONFINITE,
        timeout_s: float | None = None,
        guard: NonFiniteGuard | None = None,
        transport: TrainerTransport | None = None,
    ) -> None:
        """`lockstep_every` > 0 says the trainers take every step together anyway (TorchRec-sharded
        tables: each step's all-to-all pairs them); GBA -> sync is then agreed every that many steps
        in a one-element all-reduce (see `_leave_gba_due`). 0: trainers step independently (PS tables).
        `on_nonfinite` (`sync.on_nonfinite`): skip or fail on a NaN / Inf gradient (module docstring).
        `timeout_s` (`sync.timeout_s`, which `dense_sync` passes): the timeout of the sync group's
        collectives and the deadline of the barriers (None: torch's default, and the transport's).
        `guard`: this trainer's `NonFiniteGuard` (`shadowgba.dense_sync` shares it with the model's
        tables; default one of its own): a step in which it caught NaN / Inf (embedding gradients,
        row pushes) is non-finite as a NaN gradient is, and it counts this trainer's skipped steps.
        `transport`: the job's transport to its servers (`job.transport`); without it (a runtime that is
        never started, in tests) the servers' shards and barriers refuse every use."""
        if roles.is_server:
            raise SetupError("GBASync runs on trainer ranks; server ranks call serve_dense_shard()")
        if config.initial_mode == Mode.GBA and roles.num_servers < 1:
            raise ConfigError("sync.gba.initial_mode is 'gba' but the job has no parameter-server ranks")
        if lockstep_every < 0:
            raise ConfigError(f"lockstep_every must be >= 0, got {lockstep_every}")
        check_on_nonfinite(on_nonfinite)
        if config.initial_mode != Mode.GBA:
            self._refuse_in_elastic(roles, "sync.gba.initial_mode 'sync'")
        if config.switch_policy.enabled:
            self._refuse_in_elastic(roles, "sync.gba.switch_policy.enabled")
        if lockstep_every:
            self._refuse_in_elastic(roles, "lockstep trainers (TorchRec-sharded tables, sync.gba.lockstep_every)")
        if isinstance(local_batch_size, bool) or not isinstance(local_batch_size, int) or local_batch_size < 1:
            raise SetupError(f"local_batch_size must be an integer >= 1 (samples per trainer step), "
                             f"got {local_batch_size!r}")
        self.on_nonfinite = on_nonfinite
        self.timeout_s = timeout_s
        self.config = config
        self.roles = roles
        self.transport = transport
        self.dense = DenseParams(list(params if params is not None else trainable_named_parameters(model)))
        self.spec = OptimizerSpec.of(optimizer, config.schedule)
        self.local_batch_size = local_batch_size
        self.num_trainers = len(roles.trainer_ranks)
        self.global_batch = self.num_trainers * local_batch_size
        self.lockstep_every = lockstep_every
        self.mode: Mode = Mode.SYNC
        self.guard = guard if guard is not None else NonFiniteGuard(self._trainer_name(roles.trainer_index),
                                                                     on_nonfinite)
        self.metrics = GBAMetrics(self._held_tensors, self.guard)
        self._gba_steps = 0
        """Steps since entering GBA: equal on every trainer when they are in lockstep."""
        self._gba_requested = False
        """`switch_mode("gba")` was called in sync mode: the switch flag of the next all-reduce."""
        self._policy = SwitchPolicy(config.switch_policy)
        self._step_hook = StepHook([optimizer], self._on_step, replace_step=True)
        self._flat: FlatOptimizer | None = None
        """The trainer's optimizer: set by start(), None before and after (closed)."""
        self._loaded: tuple[dict[str, Any], dict[str, Any] | None] | None = None
        """A checkpoint loaded before start() (optimizer export, policy state): start() takes it."""
        self._own_group: dist.ProcessGroup | None = None
        """Without servers: the sync group, created by start() and destroyed at close / abort
        (`_group()`)."""
        self._allreduce = SyncAllReduce(self.dense.numel, self.num_trainers, roles.trainer_index,
                                        self.dense.dtype, self.dense.device)
        self._shards = DenseShardClient(self.dense.numel, self.transport)
        global_batch_aggregation = config.aggregation == "global_batch"  # plain async waits for and predicts nothing
        self._client = GBAClient(self._shards, self.dense, roles.trainer_index, local_batch_size, self.global_batch,
                                 config.queue_size, watch=global_batch_aggregation, metrics=self.metrics,
                                 push_dtype=config.push_torch_dtype(self.dense.dtype),
                                 lookahead=config.lookahead if global_batch_aggregation else 0.0)
        self._last_step_end = time.perf_counter()
        self._fresh = FreshWaitPolicy(config.fresh_wait if global_batch_aggregation else 0.0, config.fresh_wait_budget)
        """Whether and how long a GBA step waits for fresh parameters."""

    # ----------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Collective over the trainers: the sync group, equal initial weights, the flat optimizer,
        the initial mode. If it fails, what it started is stopped again (`abort`) before the error
        propagates."""
        if not self.roles.num_servers:  # every rank is a trainer, so every rank creates it
            timeout = None if self.timeout_s is None else datetime.timedelta(seconds=self.timeout_s)
            self._own_group = dist.new_group(list(self.roles.trainer_ranks), timeout=timeout,
                                             backend="nccl" if self.dense.device.type == "cuda" else "gloo")
        initial = self._allreduce.gradient  # free until the first step; the flat optimizer copies it
        self.dense.copy_to(initial)
        if not self.roles.elastic:  # there, every trainer installs the shards' parameters (`_join_shards`)
            with self._collective("the initial broadcast"):
                dist.broadcast(initial, src=self.roles.trainer_ranks[0], group=self._group())
            self.dense.copy_from(initial)
        self._flat = FlatOptimizer(self.spec, initial)
        if self._loaded is not None:
            (exported, policy), self._loaded = self._loaded, None
            self._load(exported, policy)
        try:
            self._step_hook.install()
            if self.roles.num_servers:
                self._client.start()
            if self.config.initial_mode == Mode.GBA:
                self._enter_gba(initial=True)
        except BaseException:
            self.abort()
            raise
        logger.info("shadowgba GBA started: mode=%s global_batch=%d trainers=%d servers=%d",
                    self.mode, self.global_batch, self.num_trainers, self.roles.num_servers)

    def close(self) -> None:
        """Finish so that every trainer ends with the same parameters; every trainer must call it.

        GBA: once shard 0 agrees that no switch is pending, push what is queued, meet the other
        trainers, pull the final parameters. Sync: raise the stop flag in one last all-reduce (peers
        still training continue locally, as in ShadowSync), then average the parameters once.
        Whatever raises, the client's threads are stopped and joined before the error propagates;
        a background thread's failure is raised after that.
        """
        if self._flat is None:
            return
        try:
            self._finish()
        finally:
            self._release(discard_queued=False)
        self._client.raise_error()
        logger.info("shadowgba GBA closed: %s", self.metrics.format())

    def abort(self) -> None:
        """Stop this trainer's hook and background threads with no collective and no final pull;
        queued gradients are dropped. Destroying the sync group (`_group`) makes a peer's pending
        collective on it fail at once, instead of after `timeout_s`."""
        if self._flat is not None:
            self._release(discard_queued=True)

    def _finish(self) -> None:
        """close()'s protocol, by mode (see `Mode`)."""
        if self.mode == Mode.GBA:
            if self._shards.begin_close():
                self._client.drain()
                self._barrier("gba-close")  # every trainer's last gradient has landed
                self._client.refresh()
            else:
                self._leave_gba()  # a switch is pending: take part, then close in sync mode
        if self.mode == Mode.SYNC:
            self._after_sync_round(self._sync_round(None, stop=True, compute_s=0.0))
        if self.mode == Mode.LOCAL:
            with self._collective("the closing average"):
                self.dense.average_(self._group(), self._allreduce.gradient)

    def _release(self, discard_queued: bool) -> None:
        """Mark the runtime closed, remove the step hook, stop and join the client's threads, destroy
        this runtime's own sync group (always), and send the metrics' last values to their sinks."""
        self._flat = None
        self.guard.enabled = False
        try:
            self._step_hook.remove()
        finally:
            try:
                self._client.stop(discard_queued)
            finally:
                group, self._own_group = self._own_group, None
                if group is not None:
                    dist.destroy_process_group(group)
                self._end_report()

    # ------------------------------------------------------------------------------- public API
    def switch_mode(self, mode: str) -> None:
        """Ask for a switch to 'sync' or 'gba'; every trainer switches at an agreed point."""
        if mode not in self.modes:
            raise ConfigError(f"unknown mode '{mode}'; allowed: ['gba', 'sync']")
        if mode == self.mode or self.mode == Mode.LOCAL:
            return
        if mode == Mode.GBA and self.roles.num_servers < 1:
            raise ConfigError("cannot switch to GBA: the job has no parameter-server ranks")
        self._refuse_in_elastic(self.roles, f"switch_mode('{mode}')")
        if self.mode == Mode.SYNC:
            self._gba_requested = True  # rides in the next all-reduce
        elif not self._shards.request_mode(mode):
            logger.warning("shadowgba: switch to %s refused: a trainer is already closing", mode)

    @property
    def global_step(self) -> int:
        """The global step k of the parameters this trainer holds (in GBA: the oldest installed
        slice's; the shards share one k, but a slice may be installed before another catches up)."""
        return self._client.global_step if self.mode == Mode.GBA else self._flat.global_step

    def evaluating(self) -> contextlib.AbstractContextManager[None]:
        """In GBA with `lookahead`, the received parameters (the shards' model), not the prediction."""
        return self._client.received_parameters() if self.mode == Mode.GBA else contextlib.nullcontext()

    def wait_for_global_step(self, global_step: int, timeout_s: float = 60.0) -> None:
        """Block until this trainer holds parameters of global step >= `global_step` (GBA mode).

        Not needed in training (GBA trainers never wait); it makes GBA lockstep, i.e. zero
        staleness, which is how GBA is shown to equal synchronous training. It first waits until
        this trainer's own pushes are answered: a reply may carry a switch request, and lockstep
        trainers must all see it before their next step, or one leaves GBA a step early and the
        other waits here for a global step its departed peer will never push (seen under load).
        """
        if self.mode == Mode.GBA:
            self._client.wait_for_global_step(global_step, timeout_s)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, in any mode:

        - `mode`: the mode it was taken in ('sync', 'gba' or 'local'; informative, any mode loads it);
        - `param_names`: the dense parameters' names, in flat-vector order;
        - `optimizer`: `{"param", "state", "global_step"}`, the flat optimizer's export: this
          trainer's in sync / local mode; in GBA mode the shards', reassembled at a cut where every
          shard is at the same k (they keep serving; a partly filled global batch is not included);
        - `switch_policy`: the trainer-side policy's state (its streak of observations).

        Before start(): the checkpoint loaded so far, else the live weights at global step 0."""
        if self._flat is None:
            exported, policy = self._loaded or (FlatOptimizer(self.spec, self._live()).export(), None)
            policy = policy or self._policy.state_dict()
        else:
            exported = self._shards.snapshot() if self.mode == Mode.GBA else self._flat.export()
            policy = self._policy.state_dict()
        return {"mode": str(self.mode), "param_names": list(self.dense.names), "optimizer": exported,
                "switch_policy": policy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (taken in any mode) in any mode; every trainer loads the same
        state. Sync / local mode: into this trainer's optimizer and weights. GBA mode (collective over
        the trainers): each drains its pushes, trainer 0 configures the shards with it, so every shard
        gets its slice and the same global step, and everyone installs it; a pending switch request
        is forgotten. Before start(): kept, and start() begins from it.

        Refused with `CheckpointError`, before anything changes: not a dict, missing keys, other
        parameter names, another number of values or dtype, optimizer state of another optimizer,
        a negative or non-integer global step, NaN / Inf anywhere."""
        exported, policy = self._checked_state(state)
        if self._flat is None:
            self._loaded = (exported, policy)
        elif self.mode == Mode.GBA:
            self._refuse_in_elastic(self.roles, "loading a checkpoint in GBA mode")
            self._client.leave()
            self._barrier("gba-load")  # every trainer's pushes have landed
            self._on_trainer0(lambda: self._configure_shards(exported), "loading the checkpoint into the dense shards")
            self._policy.load_state_dict(policy)
            self._gba_steps = 0
            self._client.enter()
        else:
            self._load(exported, policy)

    def server_stats(self) -> list[dict[str, Any]]:
        """Each dense shard's metrics: staleness histogram, decayed/dropped, global steps/s, queue depth."""
        return self._shards.stats()

    # ------------------------------------------------------------------------- training thread
    def _on_step(self) -> None:
        started = time.perf_counter()
        compute_s = started - self._last_step_end
        self._client.raise_error()
        # The gradient goes straight into the buffer that carries it on (a queue buffer in GBA mode,
        # else the all-reduce's gradient field): no gradient buffer of the runtime's own.
        gradient = self._client.take_buffer() if self.mode == Mode.GBA else self._allreduce.gradient
        self.dense.copy_grads_to(gradient)
        self.guard.check(gradient, "dense gradients")  # a sum: no mask as large as the gradient
        finite = self.guard.step_finite  # also False when the tables' gradients or row pushes were not
        try:
            if self.mode == Mode.SYNC:
                self._after_sync_round(self._sync_round(gradient, stop=False, compute_s=compute_s, finite=finite))
            elif self.mode == Mode.GBA:
                self._gba_step(gradient, compute_s, finite)
            else:
                self._local_step(gradient, finite)
        except BaseException:
            self.guard.discard_step()  # the error raised is this step's verdict
            raise
        self.guard.end_step()  # this trainer's skipped step counted; a run of them ends the job
        self._last_step_end = time.perf_counter()
        self.metrics.record_step(self._last_step_end - started)
        self._report_step()

    def _after_sync_round(self, result: SyncRound) -> None:
        """Act on a sync all-reduce's result: the non-finite rule, apply the mean gradient, then stop,
        switch or stay."""
        if result.nonfinite:
            self._nonfinite(list(result.nonfinite))
        if result.mean_gradient is not None:
            self._apply(result.mean_gradient)
            self.metrics.record_applied(self._flat.global_step)
        if result.stopped:
            self._switch_to(Mode.LOCAL, counted=False)  # a trainer is closing: no more collectives until close()
            return
        target = self._policy.observe(Mode.SYNC, result.compute_times)
        if result.switch_to_gba or target == Mode.GBA:
            self._enter_gba()

    def _local_step(self, gradient: torch.Tensor, finite: bool) -> None:
        """After a peer closed in sync mode: keep training with the same optimizer, alone (a
        non-finite gradient is skipped or raised on: the closing average would spread it)."""
        if not finite:
            self._nonfinite([self.roles.trainer_index])
            return
        self._apply(gradient)

    def _gba_step(self, gradient: torch.Tensor, compute_s: float, finite: bool) -> None:
        # A switch request seen before this step, not one its own push or fresh wait brings: how
        # long a trainer waits must not change at which step it leaves, or lockstep trainers (which
        # see every request before their next step) would leave at different steps.
        requested = self._client.sync_requested
        if not finite:
            self._nonfinite([self.roles.trainer_index], self._shards.fail)
        self._client.submit(gradient, compute_s, finite)
        for missing_share, seconds in self._client.take_batch_waits():
            self._fresh.calibrate(missing_share, seconds)
        bound_s = self._fresh.bound_s(compute_s)
        if bound_s is not None:
            started = time.perf_counter()
            missing = self._client.wait_answer(bound_s)
            fresh: bool | None = False  # no answer within the bound
            if missing is not None:
                fresh = (self._client.wait_fresh(bound_s - (time.perf_counter() - started))
                         if self._fresh.worth_waiting(missing) else None)
            waited_s = time.perf_counter() - started
            self._fresh.record(fresh, waited_s)
            self.metrics.record_fresh_wait(waited_s, fresh)
        self._client.install_fresh()
        self._fresh.observe_global_step(self._client.global_step, time.perf_counter())
        self._gba_steps += 1
        if self._leave_gba_due(requested):
            self._leave_gba()

    def _leave_gba_due(self, requested: bool) -> bool:
        """Whether this step ends GBA mode; `requested`: the switch request was seen before it.

        The request reaches each trainer in a push reply, so trainers see it after different local
        steps. Independent trainers act on it at once: each waits for the others in `_leave_gba`'s
        barrier, and nothing else is collective meanwhile. Lockstep trainers cannot: a trainer in
        the barrier would meet a peer's next embedding all-to-all on the same group and both would
        hang. They agree instead, at the same step (every `lockstep_every` GBA steps, a count equal
        on all of them), in a MAX all-reduce of "I have seen the request"."""
        if not self.lockstep_every:
            return requested
        if self._gba_steps % self.lockstep_every:
            return False
        seen = torch.tensor([1.0 if requested else 0.0], dtype=self.dense.dtype, device=self.dense.device)
        with self._collective("the agreement on leaving GBA"):
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self._group())
        return seen.item() > 0

    def _nonfinite(self, trainers: list[int], report: Callable[[str], None] | None = None) -> None:
        """The non-finite rule for the gradients of this step of `trainers` (indices): count and warn
        (skip), or raise `SyncError` naming them (fail), after `report`ing the reason (GBA: to shard 0,
        for the peers)."""
        names = ", ".join(self._trainer_name(index) for index in trainers)
        where = f"non-finite (NaN / Inf) gradient from {names} at global step {self.global_step}"
        failure = nonfinite_failure(self.on_nonfinite, where)
        if failure is not None:
            if report is not None:
                try:
                    report(where)
                except Exception:  # the local error below is the one that matters
                    logger.exception("shadowgba: could not report the non-finite gradient to the dense shards")
            raise SyncError(failure, ranks=[self.roles.trainer_ranks[index] for index in trainers])
        self.metrics.record_nonfinite_skipped(len(trainers))
        logger.warning("shadowgba: %s left out (sync.on_nonfinite: skip)", where)

    def _trainer_name(self, index: int) -> str:
        return self.roles.describe(self.roles.trainer_ranks[index])

    # ------------------------------------------------------------------------- meeting the peers
    def _sync_round(self, gradient: torch.Tensor | None, stop: bool, compute_s: float,
                    finite: bool = True) -> SyncRound:
        """Sync mode's all-reduce on the sync group (`allreduce`), carrying this trainer's switch request."""
        with self._collective("the sync all-reduce"):
            return self._allreduce.round(self._group(), gradient, stop=stop, switch_to_gba=self._gba_requested,
                                         compute_s=compute_s, finite=finite)

    def _group(self) -> dist.ProcessGroup:
        """The sync group, the library's own over the trainers, never the trainer group TorchRec and
        the user use: with servers the transport's (`TrainerTransport.sync_group`, destroyed when the job
        ends or aborts), else this runtime's. Fetched for each collective and never kept, so that
        destroying it frees it, and a peer's pending collective on it fails at once."""
        return self._require_transport().sync_group() if self.roles.num_servers else self._own_group

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """A collective on the sync group: its failure (a peer aborted and destroyed the group, died,
        or did not come within `timeout_s`) is raised as `SyncError` chaining it; the job's notice
        board then names the peer (`Job.announce_failure`)."""
        try:
            yield
        except RuntimeError as error:
            raise SyncError(f"{what} failed on {self._trainer_name(self.roles.trainer_index)}: a peer trainer left "
                            f"the sync group (aborted, died, or did not come within sync.timeout_s)") from error

    def _barrier(self, name: str) -> None:
        """Meet every trainer with no collective (`TrainerTransport.barrier`: through shard 0's server);
        a peer that aborted, or that does not come within `timeout_s`, raises `PeerLost` naming it."""
        self._require_transport().barrier(name, self.timeout_s)

    @staticmethod
    def _refuse_in_elastic(roles: Roles, what: str) -> None:
        """`SetupError` naming `what` in the elastic layout, which has no trainer collectives: before
        anything changes."""
        if roles.elastic:
            raise SetupError(f"{what}: {NO_TRAINER_GROUP}")

    def _require_transport(self) -> TrainerTransport:
        if self.transport is None:
            raise SetupError("GBASync in a job with servers needs its transport (GBASync(..., transport=job.transport))")
        return self.transport

    def _switch_to(self, mode: Mode, counted: bool = True) -> None:
        """Enter `mode`. A switch between sync and GBA (counted) changes how the job trains and is
        logged as a warning; start's entry into `initial_mode` gba and closing's sync -> local are
        the runtime's own course (`Mode`), not counted, and logged at info."""
        previous, self.mode = self.mode, mode
        if counted:
            self.metrics.record_switch()
        (logger.warning if counted else logger.info)("shadowgba: trainer %d switched %s -> %s at global step %d",
                                                     self.roles.trainer_index, previous, mode, self.global_step)

    # -------------------------------------------------------------------------- the flat optimizer
    def _apply(self, gradient: torch.Tensor) -> None:
        """Step this trainer's flat optimizer with `gradient` and make the result the live weights."""
        self._flat.step(gradient)
        self.dense.copy_from(self._flat.param.detach())

    def _load(self, exported: dict[str, Any], policy: dict[str, Any] | None = None) -> None:
        """Load a whole-vector optimizer export (and a policy state) into this trainer's optimizer
        and the live weights."""
        self._flat.load(exported)
        self.dense.copy_from(self._flat.param.detach())
        if policy is not None:
            self._policy.load_state_dict(policy)

    def _held_tensors(self) -> dict[str, torch.Tensor]:
        """The dense-sized tensors this runtime holds of its own (`metrics.memory()`): the sync
        all-reduce's buffer (the gradient's, outside GBA mode), the flat optimizer's parameters and
        state, the GBA queue; and the shared memory of its transport's same-host lanes."""
        held = {"allreduce": self._allreduce.buffer, **self._client.held_tensors(),
                **(self.transport.lane_buffers() if self.transport is not None else {})}
        flat = self._flat
        if flat is not None:
            held["optimizer_param"] = flat.param
            state = flat.optimizer.state.get(flat.param, {})
            held.update({f"optimizer_{key}": value for key, value in state.items() if torch.is_tensor(value)})
        return held

    def _live(self) -> torch.Tensor:
        live = self.dense.empty()
        self.dense.copy_to(live)
        return live

    # ---------------------------------------------------------------------------------- checkpoints
    def _checked_state(self, state: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """`state` as (optimizer export on this trainer's device, policy state or None), or
        `CheckpointError` saying what does not fit. Reads only: nothing is changed here."""
        check_entries(state, "GBA checkpoint", ("mode", "param_names", "optimizer"))
        if state["mode"] not in (*Mode,):
            raise CheckpointError(f"GBA checkpoint has unknown mode {state['mode']!r}; allowed: {[str(m) for m in Mode]}")
        names = list(state["param_names"]) if isinstance(state["param_names"], (list, tuple)) else None
        if names != list(self.dense.names):
            raise CheckpointError(f"GBA checkpoint was made for other dense parameters: {state['param_names']!r}, "
                                  f"this model has {list(self.dense.names)}")
        optimizer = check_export(state["optimizer"], self.spec, self.dense.numel, self.dense.dtype,
                                 "GBA checkpoint's 'optimizer'")
        policy = state.get("switch_policy")
        if policy is not None:
            try:
                SwitchPolicy(self.config.switch_policy).load_state_dict(policy)
            except (TypeError, ValueError) as error:
                raise CheckpointError(f"GBA checkpoint's switch_policy does not load: {error}") from None
        device = self.dense.device
        exported = {
            "param": optimizer["param"].detach().to(device).clone(),
            "state": {key: value.detach().to(device).clone() if torch.is_tensor(value) and value.dim() > 0
                      else value for key, value in optimizer["state"].items()},
            "global_step": optimizer["global_step"],
        }
        return exported, policy
