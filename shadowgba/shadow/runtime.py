"""The shadow runtime: one object that keeps a trainer's dense replica in sync without blocking it.

    sync = ShadowSync(model, optimizer, config.sync)
    with sync:
        for batch in data:              # the user's loop, or a TorchRec train pipeline
            loss = model(batch)
            loss.backward()
            optimizer.step()            # shadowgba runs its step-boundary work right after this

Threads and invariants:

- The *training thread(s)* call `optimizer.step()`; shadowgba wraps that method on the instance
  (`shadowgba.step_hook`) so the loop needs no change. After each step it serves the write-back (handoff), runs a
  foreground round every `foreground_every` steps from `first_round_after` on (foreground mode), and re-raises a failure of the
  shadow thread with its cause.
- The *shadow thread* (shadow mode) loops snapshot -> round -> write back, paced by what the rounds
  cost, with a floor on their rate that the training thread enforces (`shadowgba.shadow.schedule`).
- All shadow traffic runs on a process group of its own, created at `start()`. The training thread
  never issues a collective on it while the shadow thread is alive (the only training-thread
  collectives on it are the initial broadcast, before the thread starts, as is a 2D job's tables'
  on their replica group, and the final average, after it has joined), and the shadow thread never
  touches the group TorchRec's all-to-all uses: two threads on one gloo group deadlock.
- Rounds are in lockstep across ranks and each carries a stop flag (see `sync_algos.base`): a rank
  that closes raises it in every round from then on, serving its own snapshots from `close()`, and
  every rank leaves after the round in which all of them have raised it, so ranks that finish at
  different steps never wait in a collective their peers will not enter, and a rank still training
  keeps averaging with those that finished (in a 2D job: a fast replica group that finished keeps
  its tables in the slow group's rounds). `close()` on every rank ends with one blocking average
  (`final_sync`) so all replicas end identical.
- The same collective carries every rank's status (`sync_algos.base`): a NaN / Inf contribution is
  left out of the round on every rank alike, then skipped with a warning or raised as `SyncError`
  per `sync.on_nonfinite`; an aborting rank (`abort()`, the user's exception) sends its last round
  with an aborted marker, and its peers leave after that round instead of waiting `timeout_s` in a
  collective it will never enter, and raise `PeerLost` naming the rank that failed first
  (`shadowgba.job.blame`: the aborted rank itself may have left because of another).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

import sync_algos
from shadowgba import groups as made_groups
from shadowgba.config import SyncConfig
from shadowgba.errors import CheckpointError, SetupError, SyncError
from shadowgba.serialized import check_count, check_entries
from shadowgba.interface import DenseSync
from shadowgba.shadow.control import ControlFile, LiveSettings
from shadowgba.shadow.schedule import RoundSchedule
from shadowgba.shadow.table_rounds import TableRounds
from shadowgba.shadow.tables import TableFragments
from shadowgba.metrics import SyncMetrics
from shadowgba.nonfinite import NonFiniteGuard, gradients, restart_state
from shadowgba.step_hook import StepHook
from shadowgba.threads import thread_ids
from shadowgba.dense import DenseParams, trainable_named_parameters
from shadowgba.job.survivors import SurvivingGroups
from shadowgba.shadow.epoch_rounds import EpochRounds
from shadowgba.shadow.flags import RoundFlags
from shadowgba.shadow.writeback import DirectWriteBack, HandoffWriteBack, WriteBack, wait_for_device

logger = logging.getLogger("shadowgba")

ABORT_ROUND_S = 5.0
"""Longest `abort()` waits for its last round (the one that tells the peers), whatever `timeout_s`."""


class ShadowSync(DenseSync):
    """Synchronizes the dense parameters of `model` across trainers, in the background or every k steps.

    `optimizers` are the optimizers whose `step()` marks a step boundary: usually the one dense
    optimizer (or TorchRec's combined optimizer), one per thread with Hogwild training threads.
    `params` overrides which parameters are synchronized (default: the dense ones, i.e. all minus
    TorchRec-sharded tables). `algorithm_kwargs` are the algorithm's resources beyond its config
    (S-EASGD: the client of its centre). `process_group` is the group whose ranks synchronize (default: world);
    the shadow traffic gets a new group over those ranks. An algorithm that only talks to a
    parameter server (S-EASGD) has no traffic of its own: `process_group` carries its initial
    broadcast and final average, and without one (a job whose trainers come and go has no group)
    each trainer starts where the algorithm puts it (S-EASGD: at the centre) and ends on its own replica.
    `guard`: this trainer's `NonFiniteGuard` (`shadowgba.dense_sync` shares it with the model's
    tables); default one of its own. A step whose gradients, or whatever the guard caught in it
    (embedding gradients, row pushes), hold NaN / Inf does not run the user's optimizer: the
    weights stay as they were, and the guard skips and counts it or ends the job (`sync.on_nonfinite`).
    `tables` (2D jobs): this rank's table shards, averaged on their replica group one fragment after
    each dense round (`shadowgba.shadow.tables`), through the same step-boundary handoff.
    `survival` (2D jobs under `sync.on_group_lost: continue`): a round that fails because a peer
    was lost leaves that peer's replica group out and goes on over the survivors
    (`shadowgba.job.survivors`, `shadowgba.shadow.epoch_rounds`) instead of ending the rounds; with a torchrun job per replica
    group, a group that runs again is let in after a round, and healed from a member's replica.
    `own_group`: `process_group` was made for this runtime alone (a job per replica group: no user
    collective runs on it), so the rounds run on it as it is, and it is released at the end.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: Any | Sequence[Any],
        config: SyncConfig,
        process_group: dist.ProcessGroup | None = None,
        params: Iterable[tuple[str, nn.Parameter]] | None = None,
        algorithm_kwargs: dict[str, Any] | None = None,
        guard: NonFiniteGuard | None = None,
        tables: TableFragments | None = None,
        survival: SurvivingGroups | None = None,
        own_group: bool = False,
    ) -> None:
        self.config = config
        self.tables = tables
        self._survival = survival
        optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        self._step_hook = StepHook(optimizers, self._after_step, before_step=self._before_step)
        self.dense = DenseParams(list(params if params is not None else trainable_named_parameters(model)))
        self.guard = guard if guard is not None else NonFiniteGuard(
            f"rank {dist.get_rank()}" if dist.is_initialized() else "this rank", config.on_nonfinite,
            config.max_skipped_steps)
        self.metrics = SyncMetrics(self._held_tensors, self.guard,
                                   (lambda: self._table_rounds.fragment_ages()) if tables is not None else None)
        self._parent_group = process_group
        self._parent_is_own = own_group
        self._algorithm_kwargs = algorithm_kwargs or {}
        self._schedule = RoundSchedule(config, self.metrics, self.guard.name)
        self._foreground_every = config.foreground_every
        self._control = ControlFile(config.control_file) if config.control_file else None
        self._step_counter = itertools.count(1)
        self._step = 0
        self._stop_requested = threading.Event()
        self._aborting = threading.Event()  # abort(): the next round is this rank's aborted one
        self._heals = config.on_nonfinite == "skip"
        """Whether this rank's NaN / Inf weights take the healthy replicas' consensus when a round
        offers it (`RoundResult.healed`); under fail the job ends instead."""
        self._restarts: set[int] = set()
        """The optimizers (ids) whose state for the healed dense weights is dropped before their next step."""
        self._first_round_due = threading.Event()  # set after `first_round_after` steps or at close
        self._rounds_finished = False
        self._round_lock = threading.Lock()  # algorithm state: rounds vs load_state_dict()
        self._state_lock = threading.Lock()
        """The algorithm's `state_guard`: held only while its state changes, never across a collective,
        so `state_dict()` from the training or checkpoint thread copies a whole state at once."""
        self._foreground_lock = threading.Lock()
        self._error: BaseException | None = None
        self._error_reported = False
        self._thread: threading.Thread | None = None
        self._group: dist.ProcessGroup | None = None
        self._owns_group = False
        self._running = False
        """Between `start()` and `close()` / `abort()`."""
        self._algorithm: sync_algos.SyncAlgorithm | None = None
        self._writeback: WriteBack | None = None
        self._table_writeback: WriteBack | None = None
        self._snapshot = self.dense.empty()
        self._round_threads: set[int] = set()
        """The threads gloo started for this runtime's own group (their priority: `RoundSchedule`)."""
        self._check_s = 0.0
        """The last step's gradient check (`_before_step`), part of its time in sync code."""
        self._table_rounds = None if tables is None else TableRounds(
            tables, self.metrics, shadow_mode=config.mode == "shadow", heals=self._heals, aborting=self._aborting,
            check_flags=self._check_flags, global_ranks=self._global_ranks, step=lambda: self._step,
            record_heal=self._record_heal,
            dense_gap_steps=max(config.max_gap_steps, config.interval_steps) if config.max_gap_steps else 0)
        self._flags = RoundFlags(config.on_nonfinite, survival is not None, self.metrics)
        self._epochs: EpochRounds | None = None  # with `survival`, from `start()`: the rounds' side of its decisions

    # ----------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Collective over the ranks: new group, broadcast of the dense weights, hooks, shadow thread."""
        if self._running:
            raise SetupError("ShadowSync.start() called twice")
        collective = sync_algos.get_algorithm(self.config.algo).uses_collectives
        if (collective or self._parent_group is not None) and not (dist.is_available() and dist.is_initialized()):
            raise SetupError("ShadowSync needs torch.distributed initialised (init_process_group) first")
        if collective and self._parent_is_own:
            self._group, self._owns_group = self._parent_group, True
        elif collective:
            backend = "nccl" if self.dense.device.type == "cuda" else "gloo"
            before = thread_ids()
            self._group = made_groups.duplicate(self._parent_group, self.config.timeout_s, backend)
            self._round_threads = thread_ids() - before  # its gloo loop and workers (their priority)
            self._owns_group = True
        else:  # rounds talk to a parameter server: a group only carries the broadcast and final average
            self._group = self._parent_group
            self._owns_group = False
        self._running = True
        initial = self._snapshot  # free until the first round; what the algorithm keeps, it copies
        self.dense.copy_to(initial)
        rejoining = self.joined_running_job = self._survival is not None and self._survival.rejoining
        if rejoining:  # a group that rejoins takes a member's replica (the members' side: `_heal`)
            assert self.tables is not None
            source = self._survival.heal_source()
            dist.broadcast(initial, group_src=source, group=self.tables.group)
        elif self._group is not None:  # at the job's start, every replica takes rank 0's
            dist.broadcast(initial, group_src=0, group=self._group)
        compress = {"compress": self.config.compress} if self.config.compress != "none" else {}
        self._algorithm = sync_algos.build_algorithm(
            self.config.algo, self.config.algorithm_config(), self._group, initial, **self._algorithm_kwargs, **compress
        )
        self.dense.copy_from(initial)  # after the build: an algorithm may start this rank elsewhere (S-EASGD)
        if self.tables is not None:  # table replicas start together too
            self.tables.broadcast_(source if rejoining else 0)
        if rejoining:  # the members' next round is a consensus start: this one's first must meet it
            self._first_round_due.set()
        self._algorithm.state_guard = self._state_lock
        # the fused optimizer writes table rows inside backward: only a step boundary may touch them
        handoff = self.config.mode == "shadow" and self.config.writeback == "handoff"
        self._writeback = (HandoffWriteBack if handoff else DirectWriteBack)(self.dense, self._record_applied)
        if self.tables is not None:
            self._table_writeback = (HandoffWriteBack if self.config.mode == "shadow" else DirectWriteBack)(
                self.tables, self._table_rounds.record_applied)
        if self._survival is not None:
            self._epochs = EpochRounds(self._survival, self.metrics, self._aborting, self._writeback, self._snapshot,
                                       self.tables, self._table_writeback, self._regroup)
        self._step_hook.install()
        if self.config.mode == "shadow":
            self._thread = threading.Thread(target=self._shadow_loop, name="shadowgba-shadow", daemon=True)
            self._thread.start()
        logger.info(
            "shadowgba started: algo=%s mode=%s writeback=%s params=%d (%.2f MiB) ranks=%d",
            self.config.algo, self.config.mode, self.config.writeback, self.dense.numel,
            self.dense.numel * self._snapshot.element_size() / 2**20, self._algorithm.world_size,
        )
        if self.tables is not None:
            logger.info("shadowgba tables: %d shards, %d values in a cycle of %d fragments, averaged over %d replicas",
                        len(self.tables.shards), self.tables.numel, len(self.tables.fragments),
                        self.tables.allreduce.ranks)

    def close(self, final_sync: bool | None = None) -> None:
        """Stop rounds on every rank together, then (optionally) average the replicas once, blocking.

        Every rank must call `close()`; a rank that calls it early takes part in the rounds (with
        its last weights and its stop flag raised) until the others close too, then in the final
        average. Raises `SyncError` if the rounds failed (the shadow thread, a peer that aborted,
        NaN / Inf under `on_nonfinite: fail`) and that was not yet raised; the final average is then
        skipped, as every rank skips it alike. Without a group (see the class) there is no final
        average: this rank's last round was its own.
        """
        if not self._running:
            return
        final_sync = self.config.final_sync if final_sync is None else final_sync
        self._stop_requested.set()
        self._schedule.wake()
        self._first_round_due.set()
        try:
            if self._thread is not None:
                while self._thread.is_alive():
                    self._on_step_boundary()
                    self._thread.join(timeout=0.002)
                self._on_step_boundary()
            else:  # with its flag raised, pairing with the peers' scheduled rounds until every rank's is
                while not self._rounds_finished and self._error is None:
                    self._foreground_round()
        finally:
            group = self._unhook()
        if self._survival is not None and self._error is None:
            self._survival.mark_ended()
        try:
            if self._error is None and final_sync and group is not None:
                reduced = self.dense.average_(group, self._snapshot, self._algorithm.allreduce, heal=self._heals)
                if reduced.heals and self._heals:  # no step comes any more: restart now
                    self._heal_optimizer()
                    for optimizer in self._step_hook.optimizers:
                        self._restart(optimizer)
                self._check_flags(self._global_ranks(reduced.nonfinite_ranks, group), (), "the final average")
                if self.tables is not None and self._error is None:
                    self._table_rounds.run(len(self.tables.fragments), None)
        finally:
            self._release(group)
        self._raise_unreported_error()
        logger.info("shadowgba closed: %s", self.metrics.format())

    def abort(self) -> None:
        """End this rank's part with no final average, telling the peers: its last round (the shadow
        thread's next one, or in foreground mode one run now) contributes nothing and raises the stop
        flag with the aborted marker, so the peers leave after that round and raise `SyncError`
        naming this rank. The thread is joined and the group released.

        A peer can be unable to meet that round: its training thread may wait in a collective of its
        own with this rank (TorchRec's all-to-all), so its shadow thread gets no snapshot. Abort
        therefore waits at most `ABORT_ROUND_S` for the round; a round still blocked then is left to
        the process's exit (a daemon thread, its group not destroyed under it) and the peers learn of
        the failure from the job's notice or from this process's connections closing."""
        if not self._running:
            return
        self._aborting.set()  # before _stop_requested: see _run_round
        self._stop_requested.set()
        self._schedule.wake()
        self._first_round_due.set()
        last: threading.Thread | None = None
        failure: list[BaseException] = []
        try:
            if self._thread is not None:
                self._writeback.cancel()  # a snapshot request would wait for a step that never comes
                if self._table_writeback is not None:
                    self._table_writeback.cancel()
                last = self._thread
            elif not self._rounds_finished and self._error is None:
                last = threading.Thread(target=self._last_foreground_round, args=(failure,),
                                        name="shadowgba-abort", daemon=True)
                last.start()
            if last is not None:
                last.join(timeout=min(self.config.timeout_s, ABORT_ROUND_S))
        finally:
            group = self._unhook()
            self._error_reported = True  # the caller's exception is the one that matters
            if last is not None and last.is_alive():
                logger.warning("shadowgba: the aborted round still waits for a peer after %gs; it is left to "
                               "the process's exit", min(self.config.timeout_s, ABORT_ROUND_S))
                self._end_report()
            else:
                self._release(group)
        if failure:
            raise failure[0]

    def _last_foreground_round(self, failure: list[BaseException]) -> None:
        """Foreground mode's aborted round (`abort`), on a thread of its own; its error kept in `failure`."""
        with self._foreground_lock:
            try:
                self._run_round()
            except BaseException as error:
                failure.append(error)
            finally:
                self._rounds_finished = True

    def _unhook(self) -> dist.ProcessGroup | None:
        """Leave the model and optimizers be (step hook, guard, lookup hooks); hand back the rounds' group."""
        self._step_hook.remove()
        self.guard.enabled = False
        if self.tables is not None:
            self.tables.close()
        group, self._group, self._running = self._group, None, False
        return group

    def _release(self, group: dist.ProcessGroup | None) -> None:
        self._end_report()
        if self._owns_group:
            made_groups.release(group)

    # ------------------------------------------------------------------------------ live controls
    @property
    def interval_ms(self) -> float:
        """Current shadow-mode pacing (the least time between two round starts)."""
        return self._schedule.pacer.interval_s * 1e3

    @property
    def interval_steps(self) -> int:
        """Current shadow-mode pacing in the fastest rank's steps (0: the other limits alone)."""
        return self._schedule.pacer.interval_steps

    @property
    def max_round_share(self) -> float:
        """Current shadow-mode pacing by the link (the most of the wall time rounds may take)."""
        return self._schedule.pacer.max_round_share

    def set_interval_ms(self, interval_ms: float) -> None:
        """Change the pacing while the job runs (local to this rank; takes effect at the next round)."""
        self.apply_live(LiveSettings(interval_ms=interval_ms))

    def apply_live(self, settings: LiveSettings) -> None:
        """Apply live settings (what a control file carries); unset fields are left alone."""
        self._schedule.apply_live(settings)
        if settings.foreground_every is not None:
            self._foreground_every = settings.foreground_every

    # ---------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Algorithm state plus what identifies it (algorithm, parameter names) for a safe reload,
        and the step count (foreground rounds fall every `foreground_every` steps of it).

        The algorithm state is copied as the last round to change it left it. It is read without
        waiting for a round in flight, and must be: a checkpoint calls this on every trainer and then
        meets the others in a collective, while a shadow round here can be waiting for a peer whose
        shadow thread waits for its training thread's snapshot, and that training thread is already
        in the checkpoint's collective waiting for this one (a cycle seen in the soak). A round
        changes the state only after its collective, under the algorithm's `state_guard`
        (`_state_lock`), so the copy waits at most for those few vector operations, and no second
        copy of the state is kept for checkpoints."""
        self._require_started()
        return {
            "algo": self.config.algo,
            "param_names": list(self.dense.names),
            "algorithm": self._algorithm.state_dict(),
            "step": self._step,
            **({"tables": self.tables.state_dict()} if self.tables is not None else {}),
        }

    def _held_tensors(self) -> dict[str, torch.Tensor]:
        """The dense-sized tensors this runtime holds of its own (`metrics.memory()`)."""
        held = {"snapshot": self._snapshot}
        if self._algorithm is not None:
            held.update(self._algorithm.buffers())
        if self.tables is not None:
            held.update(self.tables.held())
        return held

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output; refuses (`CheckpointError`, changing nothing) a state that
        is not one, or one of another algorithm, other dense parameters or shapes, or holding NaN / Inf."""
        algorithm = self._require_started()
        check_entries(state, "ShadowSync state", ("algo", "param_names", "algorithm"))
        if state["algo"] != self.config.algo:
            raise CheckpointError(f"checkpoint is for sync algo '{state['algo']}', this job runs '{self.config.algo}'")
        names = state["param_names"]
        if not isinstance(names, (list, tuple)) or list(names) != self.dense.names:
            other = sorted(set(names) ^ set(self.dense.names)) if isinstance(names, (list, tuple)) else names
            raise CheckpointError(
                "checkpoint was made for different dense parameters: "
                f"{len(names) if isinstance(names, (list, tuple)) else type(names).__name__} names vs "
                f"{len(self.dense.names)} here; differing: {other!r:.200}"
            )
        step = check_count(state.get("step", 0), "ShadowSync state's step")
        if (self.tables is not None) != ("tables" in state):
            raise CheckpointError("checkpoint and job differ in table replicas: one is a 2D job "
                                  "(sync.sharding_group_size), the other is not")
        with self._round_lock:
            try:
                if self.tables is not None:
                    self.tables.check_state(state["tables"])
                algorithm.load_state_dict(state["algorithm"])
                if self.tables is not None:
                    self.tables.load_state_dict(state["tables"])
            except ValueError as error:  # refused before changing anything
                raise CheckpointError(f"checkpoint refused: {error}") from None
            self._step = step
            self._step_counter = itertools.count(step + 1)

    # ---------------------------------------------------------------------------------- internals
    def _require_started(self) -> sync_algos.SyncAlgorithm:
        if self._algorithm is None:
            raise SetupError("ShadowSync has not been started")
        return self._algorithm

    def _before_step(self, optimizer: Any) -> bool:
        """Whether the user's optimizer may step: its gradients, and whatever else the guard saw in
        this step (embedding gradients, row pushes), are finite. A sum per gradient, counted in the
        step's `training_sync_s`."""
        started = time.perf_counter()
        self._restart(optimizer)
        self.guard.check_all(gradients(optimizer), "dense gradients")
        self._check_s = time.perf_counter() - started
        return self.guard.step_finite

    def _after_step(self) -> None:
        """Step-boundary work of a training thread; kept to a few attribute checks when idle."""
        started = time.perf_counter()
        self._step = next(self._step_counter)
        self.guard.end_step()  # a skipped step is counted here; under fail it raises, naming this rank
        self._raise_unreported_error()
        if self._thread is not None:
            if self._step >= self.config.first_round_after:
                self._first_round_due.set()
            self._on_step_boundary()
            self._schedule.step_ended(self._step)
        elif not self._rounds_finished and self._step >= self.config.first_round_after \
                and self._step % self._foreground_every == 0:
            self._foreground_round()
            self._raise_unreported_error()
        self.metrics.record_step(time.perf_counter() - started + self._check_s, self._step)
        self._report_step()

    def _raise_unreported_error(self) -> None:
        """Raise the rounds' failure once, in the calling training thread: a `SyncError` of ours
        as it is (it names the rank), anything else as the cause of one."""
        if self._error is not None and not self._error_reported:
            self._error_reported = True
            if isinstance(self._error, SyncError):
                raise self._error
            where = "shadow thread" if self._thread is not None else "foreground sync round"
            raise SyncError(f"{where} failed: {self._error!r}") from self._error

    def _on_step_boundary(self) -> None:
        self._writeback.on_step_boundary()
        if self._table_writeback is not None:
            self._table_writeback.on_step_boundary()

    def _record_applied(self, replaced: bool) -> None:
        """A round's result reached the dense weights (at a step boundary, or in the round with
        direct write-back); `replaced`: they were healed, so is the optimizer state."""
        self.metrics.record_applied(self._step)
        self._schedule.applied(self._step)
        if replaced:
            self._heal_optimizer()

    def _heal_optimizer(self) -> None:
        """The dense weights were healed: their optimizer state starts afresh (`restart_state`), each
        optimizer's just before its next step, in the thread that steps it: one may be stepping now
        (a direct write-back heals from the shadow thread; Hogwild threads step apart)."""
        self._restarts = {id(optimizer) for optimizer in self._step_hook.optimizers}
        self._record_heal("dense weights", "; its optimizer state for them starts afresh at its next step")

    def _restart(self, optimizer: Any) -> None:
        if id(optimizer) in self._restarts:
            self._restarts.discard(id(optimizer))
            restart_state(optimizer, self.dense.params)

    def _record_heal(self, what: str, extra: str) -> None:
        self.metrics.record_heal()
        logger.warning("shadowgba: %s: its %s held NaN / Inf and took the healthy replicas' consensus at step %d%s "
                       "(sync.on_nonfinite: skip)", self.guard.name, what, self._step, extra)

    def _run_round(self) -> bool:
        """One round: snapshot, communicate, write back. Returns True when every rank must stop
        (every rank's stop flag, or the round's flags call for an error: stored in `_error`, alike on
        every rank).
        An aborting rank's round is the aborted one (no snapshot, no write-back)."""
        started = time.perf_counter()
        if self._control is not None and (settings := self._control.poll()) is not None:
            self.apply_live(settings)
        snapshot_taken = not self._aborting.is_set() and self._writeback.snapshot(self._snapshot)
        stop = self._stop_requested.is_set()
        # abort() sets _aborting before _stop_requested: a stop read above that came from an abort
        # is seen here, and goes out as the aborted round, not as a plain stop the peers would obey
        # without knowing why
        if not snapshot_taken or self._aborting.is_set():
            with self._round_lock:
                self._algorithm.abort_round()
            return True
        self._algorithm.allreduce.previous_ms = 1e3 * self._schedule.pacer.own_last_s
        self._algorithm.allreduce.steps = self._schedule.snapshot_taken(self._step)
        self._algorithm.allreduce.joining = self._survival is not None and self._survival.joins_waiting()
        with self._round_lock:
            result = self._algorithm.sync(self._snapshot, stop)  # leaves the delta t - s in the snapshot's buffer
        self._schedule.pacer.round_ended(result.fastest_steps, result.previous_cost_ms / 1e3)
        self.metrics.record_round(time.perf_counter() - started, result.bytes_moved)
        if not result.kept_local or (result.healed and self._heals):  # else a rank left out keeps its own weights
            self._writeback.apply(self._snapshot, replace=result.healed)
        failed = self._check_flags(
            self._global_ranks(result.nonfinite_ranks), self._global_ranks(result.aborted_ranks), "a round"
        )
        if self.tables is not None and not failed:  # every rank alike: the flags are the same everywhere
            if self._table_rounds.run(None, self._table_writeback, result.fastest_steps):
                return False  # aborting: the next round is this rank's aborted dense round
            failed = self._error is not None
        if result.joins_seen and not (result.last or failed) and self._epochs is not None:  # alike on every rank
            self._epochs.admit()
        return result.last or failed

    def _check_flags(self, nonfinite: Sequence[int], aborted: Sequence[int], where: str) -> bool:
        """Act on a collective's flags as every rank does alike (`RoundFlags.verdict`): a failure becomes
        `_error` (returns True: leave the rounds)."""
        error = self._flags.verdict(nonfinite, aborted, where)
        if error is not None:
            self._error = error
        return error is not None

    def _round_surviving(self) -> bool:
        """`_run_round`, with `survival` through the epochs (`EpochRounds.run`): they survive a lost group."""
        return self._epochs.run(self._run_round) if self._epochs is not None else self._run_round()

    def _regroup(self, dense: dist.ProcessGroup) -> dist.ProcessGroup:
        """The rounds move to a new epoch's group `dense` (`EpochRounds`); returns the one they ran on."""
        with self._round_lock:
            old, self._group = self._group, dense
            self._algorithm.regroup(dense)
        return old

    def _global_ranks(self, ranks: Sequence[int], group: dist.ProcessGroup | None = None) -> tuple[int, ...]:
        """Group ranks of the sync group as the job's (global) ranks, which the logs name."""
        group = self._group if group is None else group
        if self._parent_group is None or not ranks:
            return tuple(ranks)
        members = made_groups.members(group)
        return tuple(members[rank] for rank in ranks)

    def _foreground_round(self) -> None:
        """A synchronous round in the calling training thread; one at a time across Hogwild threads.
        A failure is stored in `_error`; the caller raises it (`_raise_unreported_error`)."""
        with self._foreground_lock:
            if self._rounds_finished:
                return
            try:
                self._rounds_finished = self._round_surviving()
            except Exception as error:
                self._error = error
                self._rounds_finished = True

    def _shadow_loop(self) -> None:
        stream = torch.cuda.Stream(self.dense.device) if self.dense.device.type == "cuda" else None
        self._schedule.start(self._round_threads)
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if self.config.first_round_after:
                    self._first_round_due.wait()
                self._schedule.round_begins()
                while not self._round_surviving():
                    self._schedule.round_finished()
                    self._schedule.wait(self._stop_requested)  # then the next round begins
                wait_for_device(self.dense.device)
        except BaseException as error:  # surfaced in the training thread at its next step
            logger.exception("shadowgba shadow thread failed")
            self._error = error
        finally:
            self._rounds_finished = True

