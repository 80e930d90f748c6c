"""GBASync: the dense parameters of a trainer under sync all-reduce or GBA, switchable while running.

    roles = transport.start(num_servers=1)            # servers: serve_dense_shard(); transport.stop()
    with GBASync(model, optimizer, config.sync, roles, local_batch_size=512) as gba:
        for batch in data:                             # the user's loop, unchanged
            loss = model(batch); loss.backward()
            optimizer.step()                           # replaced: the dense update is GBASync's
    gba.switch_mode("sync")                            # or automatically, by the switch policy

The user's optimizer names the one optimizer (type and hyperparameters, `OptimizerSpec`) but never
steps itself: the authoritative copy is a `FlatOptimizer`, on every trainer in sync mode and sliced
over the dense PS shards in GBA mode. Its learning rate follows `GBAConfig.schedule` by global step.

Sync mode (as DDP): every step all-reduces [gradient | switch flag | compute times] over the
trainer group, steps the flat optimizer with the mean gradient and writes the result back. The
policy sees every trainer's compute time in the same all-reduce, so all trainers decide a switch at
the same step with no extra agreement round.

GBA mode: the training thread never waits. It copies its gradient into a bounded queue (dropping the
oldest when full) together with the tokens of the parameters it was computed on, and installs the
newest parameters the background threads have received. The shadow thread pushes each gradient
slice to its shard (the reply is the shard's fresh slice and token); under global-batch
aggregation a watcher thread keeps one long poll (`DenseShard.watch`) per shard open, which
answers as soon as the shard's global step advances. Without the watcher the newest parameters
at the end of step n would be the reply to the push of step n-1, fetched a whole step earlier, and
every gradient would be computed on parameters about one step staler than necessary (4 equal
trainers, bench_gba simulated compute: mean staleness 1.73 without the watcher, 1.17 with it; the
floor is about 1, the span of a step).

Switching (carries parameters, optimizer state, global step and global batch; nothing is retuned):
- sync -> GBA, at the same step on every trainer: trainer 0 loads its flat optimizer, sliced, into
  the shards; a barrier; everyone pulls.
- GBA -> sync: a request (API or the policy on shard 0) is carried back in every push reply. Each
  trainer stops feeding the queue, waits for its in-flight pushes, and enters a barrier; trainer 0
  takes the shards' state, the trainers broadcast it and continue in lockstep. A partly filled
  global batch is dropped (counted on the shard). Trainers whose steps are paired anyway
  (TorchRec-sharded tables) first agree on the step (`lockstep_every`), else one trainer's barrier
  would meet another's embedding all-to-all.
Collectives run only in the training thread (the shadow thread speaks RPC only), so the trainer
group never has two threads in it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from shadowgba.errors import CheckpointError, ConfigError, SyncError
from shadowgba.interface import DenseSync
from shadowgba.dense import DenseParams, trainable_named_parameters
from shadowgba.flat_optimizer import FlatOptimizer, OptimizerSpec, concat_exports, shard_bounds, slice_export
from shadowgba.metrics import GBAMetrics
from shadowgba.ps import transport
from shadowgba.ps.dense_server import DenseShard, ShardReply
from shadowgba.step_hook import StepHook
from shadowgba.gba.switch_policy import SwitchPolicy
from shadowgba.gba.config import GBAConfig

logger = logging.getLogger("shadowgba")

DENSE_SERVICE = "dense"
WATCH_TIMEOUT_S = 0.25
"""Longest a watcher's long poll waits on a shard whose global step does not advance."""
WATCH_IDLE_S = 0.01
"""Pause before the next long poll when the last one brought nothing newer, so that a shard that
answers at once (all its waiters taken) is not polled in a tight loop."""


def serve_dense_shard() -> None:
    """On a server rank: host an (unconfigured) dense shard; trainers configure it."""
    transport.serve(DENSE_SERVICE, DenseShard())


class GBASync(DenseSync):
    """Sync all-reduce / GBA for one trainer's dense parameters (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: GBAConfig,
        roles: transport.Roles,
        local_batch_size: int,
        params: Iterable[tuple[str, nn.Parameter]] | None = None,
        lockstep_every: int = 0,
    ) -> None:
        """`lockstep_every` > 0 says the trainers take every step together anyway (TorchRec-sharded
        tables: each step's all-to-all pairs them); GBA -> sync is then agreed every that many steps
        in a one-element all-reduce (see `_leave_gba_due`). 0: trainers step independently (PS tables)."""
        if roles.is_server:
            raise ValueError("GBASync runs on trainer ranks; server ranks call serve_dense_shard()")
        self.config = config
        if self.config.initial_mode == "gba" and roles.num_servers < 1:
            raise ConfigError("sync.gba.initial_mode is 'gba' but the job has no parameter-server ranks")
        self.roles = roles
        self.dense = DenseParams(list(params if params is not None else trainable_named_parameters(model)))
        self.spec = OptimizerSpec.of(optimizer, self.config.schedule)
        self.local_batch_size = local_batch_size
        self.num_trainers = len(roles.trainer_ranks)
        self.global_batch = self.num_trainers * local_batch_size
        if lockstep_every < 0:
            raise ValueError(f"lockstep_every must be >= 0, got {lockstep_every}")
        self.lockstep_every = lockstep_every
        self._gba_steps = 0
        """Steps since entering GBA: equal on every trainer when they are in lockstep."""
        self.bounds = shard_bounds(self.dense.numel, max(roles.num_servers, 1))
        self.mode = "sync"
        self.metrics = GBAMetrics()
        self._policy = SwitchPolicy(self.config.switch_policy)
        self._step_hook = StepHook([optimizer], self._on_step, replace_step=True)
        self._flat: FlatOptimizer | None = None
        self._grad = self.dense.empty()
        self._sync_buffer = torch.zeros(self.dense.numel + 3 + self.num_trainers, dtype=self.dense.dtype,
                                        device=self.dense.device)
        self._tokens: list[int] = []
        self._switch_requested: str | None = None
        self._queue: collections.deque[tuple[torch.Tensor, list[int], float]] = collections.deque()
        self._queue_ready = threading.Condition()
        self._pushing = False
        self._fresh: list[ShardReply | None] = [None] * len(self.bounds)
        """Per shard, the newest reply (push or watch) not yet installed; guarded by _pulled_lock."""
        self._live_tokens: list[int] = []
        """A copy of _tokens for the watcher thread; guarded by _pulled_lock."""
        self._pulled_lock = threading.Lock()
        self._watching = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._last_step_end = time.perf_counter()

    # ----------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Collective over the trainers: equal initial weights, the flat optimizer, the initial mode."""
        initial = self.dense.empty()
        self.dense.copy_to(initial)
        dist.broadcast(initial, src=self.roles.trainer_ranks[0], group=self.roles.trainer_group)
        self.dense.copy_from(initial)
        self._flat = FlatOptimizer(self.spec, initial)
        self._step_hook.install()
        if self.roles.num_servers:
            self._threads = [
                threading.Thread(target=self._shadow_loop, name="shadowgba-gba", daemon=True),
                threading.Thread(target=self._watch_loop, name="shadowgba-gba-watch", daemon=True),
            ]
            for thread in self._threads:
                thread.start()
        if self.config.initial_mode == "gba":
            self._enter_gba(initial=True)
        logger.info("shadowgba GBA started: mode=%s global_batch=%d trainers=%d servers=%d",
                    self.mode, self.global_batch, self.num_trainers, self.roles.num_servers)

    def close(self) -> None:
        """Finish so that every trainer ends with the same parameters; every trainer must call it.

        GBA: once shard 0 agrees that no switch is pending, push what is queued, meet the other
        trainers, pull the final parameters. Sync: raise the stop flag in one last all-reduce (peers
        still training continue locally, as in ShadowSync), then average the parameters once.
        """
        if self._flat is None:
            return
        self._step_hook.remove()
        if self.mode == "gba":
            if transport.call(0, DENSE_SERVICE, "begin_close"):
                self._drain()
                dist.barrier(group=self.roles.trainer_group)  # every trainer's last gradient has landed
                self._install(*self._pull_all())
            else:
                self._leave_gba()  # a switch is pending: take part, then close in sync mode
        if self.mode == "sync":
            self._sync_round(contribute=False, stop=True)
        if self.mode == "local":
            self.dense.average_(self.roles.trainer_group)
        self._stop_threads()
        self._raise_shadow_error()
        self._flat = None
        logger.info("shadowgba GBA closed: %s", self.metrics.format())

    def abort(self) -> None:
        """Stop this trainer's background threads and hooks with no collective and no final pull."""
        if self._flat is None:
            return
        self._step_hook.remove()
        self._stop_threads()
        self._flat = None

    def _stop_threads(self) -> None:
        self._watching.clear()
        with self._queue_ready:
            self._stop = True
            self._queue_ready.notify_all()
        for thread in self._threads:
            thread.join()

    # ------------------------------------------------------------------------------- public API
    def switch_mode(self, mode: str) -> None:
        """Ask for a switch to 'sync' or 'gba'; every trainer switches at an agreed point."""
        if mode not in ("sync", "gba"):
            raise ValueError(f"unknown mode '{mode}'; allowed: ['gba', 'sync']")
        if mode == self.mode or self.mode == "local":
            return
        if mode == "gba" and self.roles.num_servers < 1:
            raise ValueError("cannot switch to GBA: the job has no parameter-server ranks")
        if self.mode == "sync":
            self._switch_requested = "gba"  # rides in the next all-reduce
        elif self.mode == "gba" and not transport.call(0, DENSE_SERVICE, "request_mode", mode):
            logger.warning("shadowgba: switch to %s refused: a trainer is already closing", mode)

    @property
    def global_step(self) -> int:
        """The global step k of the parameters this trainer holds (in GBA: the oldest shard's token;
        shards advance independently)."""
        return min(self._tokens) if self.mode == "gba" else self._flat.global_step

    def wait_for_global_step(self, global_step: int, timeout_s: float = 60.0) -> None:
        """Block until this trainer holds parameters of global step >= `global_step` (GBA mode).

        Not needed in training (GBA trainers never wait); it makes GBA lockstep, i.e. zero
        staleness, which is how GBA is shown to equal synchronous training. It first waits until
        this trainer's own pushes are answered: a reply may carry a switch request, and lockstep
        trainers must all see it before their next step, or one leaves GBA a step early and the
        other waits here for a global step its departed peer will never push (seen under load).
        """
        deadline = time.monotonic() + timeout_s
        if self.mode == "gba":
            self._drain()
        while self.mode == "gba" and self.global_step < global_step:
            self._raise_shadow_error()
            if time.monotonic() > deadline:
                raise TimeoutError(f"global step {global_step} not reached within {timeout_s}s (at {self.global_step})")
            slices, tokens = self._pull_all()
            if min(tokens) >= global_step:
                self._install(slices, tokens)
            else:
                time.sleep(0.001)

    modes = ("sync", "gba")

    def state_dict(self) -> dict[str, Any]:
        """Mode, parameters, optimizer state and global step: this trainer's in sync mode, the dense
        shards' (reassembled) in GBA mode, where the state lives on the servers."""
        if self.mode == "gba":
            futures = [transport.call_async(index, DENSE_SERVICE, "export") for index in range(self.roles.num_servers)]
            exported = concat_exports(torch.futures.wait_all(futures))
        else:
            exported = self._flat.export()
        return {"mode": self.mode, "param_names": list(self.dense.names), "optimizer": exported}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output into this trainer's optimizer (sync mode: every trainer loads
        the same state; a later switch to GBA carries it to the servers)."""
        if not isinstance(state, dict) or state.get("param_names") != self.dense.names:
            raise CheckpointError("GBA checkpoint was made for other dense parameters (or is not a GBA state_dict)")
        if self.mode != "sync":
            raise CheckpointError("GBA state loads in sync mode (initial_mode: sync), before switching to GBA")
        self._flat.load(state["optimizer"])
        self.dense.copy_from(self._flat.param.detach())

    def server_stats(self) -> list[dict[str, Any]]:
        """Each dense shard's metrics: staleness histogram, decayed/dropped, global steps/s, queue depth."""
        return [transport.call(index, DENSE_SERVICE, "stats") for index in range(self.roles.num_servers)]

    # ------------------------------------------------------------------------- training thread
    def _on_step(self) -> None:
        started = time.perf_counter()
        compute_s = started - self._last_step_end
        self._raise_shadow_error()
        self.dense.copy_grads_to(self._grad)
        if self.mode == "sync":
            self._sync_step(compute_s)
        elif self.mode == "gba":
            self._gba_step(compute_s)
        else:
            self._local_step()
        self._last_step_end = time.perf_counter()
        self.metrics.record_step(self._last_step_end - started)

    def _sync_step(self, compute_s: float) -> None:
        self._sync_round(contribute=True, stop=False, compute_s=compute_s)

    def _sync_round(self, contribute: bool, stop: bool, compute_s: float = 0.0) -> None:
        """One all-reduce of [gradient | contributors | stop | switch | compute time per trainer]."""
        numel, n = self.dense.numel, self.num_trainers
        buffer = self._sync_buffer
        buffer.zero_()
        if contribute:
            buffer[:numel] = self._grad
            buffer[numel] = 1.0
        buffer[numel + 1] = 1.0 if stop else 0.0
        buffer[numel + 2] = 1.0 if self._switch_requested == "gba" else 0.0
        buffer[numel + 3 + self.roles.trainer_index] = compute_s
        dist.all_reduce(buffer, group=self.roles.trainer_group)
        contributors, stopped, switch = buffer[numel : numel + 3].tolist()
        if contribute and contributors > 0:
            self._flat.step(buffer[:numel] / contributors)
            self.dense.copy_from(self._flat.param.detach())
            self.metrics.record_applied(self._flat.global_step)
        if stopped > 0:
            self._switch_to("local", counted=False)  # a trainer is closing: no more collectives until close()
            return
        target = self._policy.observe("sync", buffer[numel + 3 :].tolist())
        if switch > 0 or target == "gba":
            self._enter_gba()

    def _local_step(self) -> None:
        """After a peer closed in sync mode: keep training with the same optimizer, alone."""
        self._flat.step(self._grad.clone())
        self.dense.copy_from(self._flat.param.detach())

    def _gba_step(self, compute_s: float) -> None:
        with self._queue_ready:
            if len(self._queue) >= self.config.queue_size:
                self._queue.popleft()
                self.metrics.record_queue_drop()
            self._queue.append((self._grad.clone(), list(self._tokens), compute_s))
            self._queue_ready.notify()
        self._install_fresh()
        self._gba_steps += 1
        if self._leave_gba_due():
            self._leave_gba()

    def _leave_gba_due(self) -> bool:
        """Whether this step ends GBA mode.

        The request reaches each trainer in a push reply, so trainers see it after different local
        steps. Independent trainers act on it at once: each waits for the others in `_leave_gba`'s
        barrier, and nothing else is collective meanwhile. Lockstep trainers cannot: a trainer in
        the barrier would meet a peer's next embedding all-to-all on the same group and both would
        hang. They agree instead, at the same step (every `lockstep_every` GBA steps, a count equal
        on all of them), in a MAX all-reduce of "I have seen the request"."""
        requested = self._switch_requested == "sync"
        if not self.lockstep_every:
            return requested
        if self._gba_steps % self.lockstep_every:
            return False
        seen = torch.tensor([1.0 if requested else 0.0], dtype=self.dense.dtype, device=self.dense.device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.roles.trainer_group)
        return seen.item() > 0

    def _enter_gba(self, initial: bool = False) -> None:
        """sync -> GBA at the same step on every trainer (at start when `initial`: not a switch)."""
        if self.roles.trainer_index == 0:
            exported = self._flat.export()
            futures = [
                transport.call_async(index, DENSE_SERVICE, "configure", start, end, self.num_trainers, self.spec,
                                     slice_export(exported, start, end), self.config, self.global_batch)
                for index, (start, end) in enumerate(self.bounds)
            ]
            torch.futures.wait_all(futures)
        dist.barrier(group=self.roles.trainer_group)
        self._switch_requested = None
        self._gba_steps = 0
        self._install(*self._pull_all())
        if self.config.aggregation == "global_batch":
            # without aggregation k advances at every push, so each watch would answer every push
            # of every trainer (N^2 replies; measured -27% samples/s in real compute): plain async
            # keeps the classic fetch with each push
            self._watching.set()
        self._switch_to("gba", counted=not initial)

    def _leave_gba(self) -> None:
        """GBA -> sync: quiesce this trainer's pushes, agree, take the servers' state."""
        self._watching.clear()
        self._drain()
        dist.barrier(group=self.roles.trainer_group)
        exported: list[Any] = [None]
        if self.roles.trainer_index == 0:
            futures = [transport.call_async(index, DENSE_SERVICE, "export") for index in range(self.roles.num_servers)]
            exported[0] = concat_exports(torch.futures.wait_all(futures))
        dist.broadcast_object_list(exported, src=self.roles.trainer_ranks[0], group=self.roles.trainer_group)
        self._flat.load(exported[0])
        self.dense.copy_from(self._flat.param.detach())
        with self._pulled_lock:
            self._fresh = [None] * len(self.bounds)
        self._switch_requested = None
        self._switch_to("sync")

    def _switch_to(self, mode: str, counted: bool = True) -> None:
        previous, self.mode = self.mode, mode
        if counted:
            self.metrics.record_switch()
        logger.warning("shadowgba: trainer %d switched %s -> %s at global step %d",
                       self.roles.trainer_index, previous, mode, self.global_step)

    def _install(self, slices: list[torch.Tensor], tokens: list[int]) -> None:
        """Make pulled parameters the live ones (GBA trainers make no local dense updates)."""
        flat = torch.cat(slices)
        self.dense.copy_from(flat)
        self._tokens = tokens
        with self._pulled_lock:
            self._live_tokens = list(tokens)
        self.metrics.record_applied(min(tokens))

    def _install_fresh(self) -> None:
        """Install, shard by shard, the newest parameters received since the last install (a
        shard's parameters are a function of its global step, so a newer token means newer values)."""
        with self._pulled_lock:
            fresh, self._fresh = self._fresh, [None] * len(self.bounds)
        newer = [reply is not None and reply.token > token for reply, token in zip(fresh, self._tokens)]
        if not any(newer):
            return
        live = self.dense.empty()
        if not all(newer):
            self.dense.copy_to(live)
        slices = [reply.params if new else live[start:end] for reply, new, (start, end) in zip(fresh, newer, self.bounds)]
        tokens = [reply.token if new else token for reply, new, token in zip(fresh, newer, self._tokens)]
        self._install(slices, tokens)

    def _offer(self, replies: list[ShardReply]) -> None:
        """Keep, per shard, the newest of the replies received so far (called by both background threads)."""
        with self._pulled_lock:
            for index, reply in enumerate(replies):
                kept = self._fresh[index]
                if kept is None or reply.token > kept.token:
                    self._fresh[index] = reply

    def _pull_all(self) -> tuple[list[torch.Tensor], list[int]]:
        futures = [transport.call_async(index, DENSE_SERVICE, "pull") for index in range(self.roles.num_servers)]
        replies: list[ShardReply] = torch.futures.wait_all(futures)
        return [reply.params for reply in replies], [reply.token for reply in replies]

    def _drain(self) -> None:
        """Wait until the shadow thread has pushed everything queued (errors surface here)."""
        with self._queue_ready:
            while (self._queue or self._pushing) and self._error is None:
                self._queue_ready.wait(timeout=0.05)
        self._raise_shadow_error()

    def _raise_shadow_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise SyncError(f"GBA shadow thread failed: {error!r}") from error

    # ---------------------------------------------------------------------------- shadow thread
    def _shadow_loop(self) -> None:
        try:
            while True:
                with self._queue_ready:
                    while not self._queue and not self._stop:
                        self._queue_ready.wait()
                    if self._stop and not self._queue:
                        return
                    gradient, tokens, compute_s = self._queue.popleft()
                    self._pushing = True
                try:
                    self._push(gradient, tokens, compute_s)
                finally:
                    with self._queue_ready:
                        self._pushing = False
                        self._queue_ready.notify_all()
        except BaseException as error:  # surfaced in the training thread at its next step
            logger.exception("shadowgba GBA shadow thread failed")
            self._error = error

    def _watch_loop(self) -> None:
        """While in GBA mode: one long poll per shard, renewed when all have answered, each asking
        for a global step past the newest this trainer knows of."""
        try:
            while not self._stop:
                if not self._watching.wait(timeout=WATCH_TIMEOUT_S):
                    continue
                with self._pulled_lock:
                    known = [
                        max(token, reply.token if reply is not None else token)
                        for token, reply in zip(self._live_tokens, self._fresh)
                    ]
                futures = [
                    transport.call_async(index, DENSE_SERVICE, "watch", token, WATCH_TIMEOUT_S)
                    for index, token in enumerate(known)
                ]
                replies: list[ShardReply | None] = torch.futures.wait_all(futures)
                if any(reply is None for reply in replies):  # the shards are leaving GBA (switch to sync)
                    time.sleep(WATCH_TIMEOUT_S)
                    continue
                self._offer(replies)
                if all(reply.token <= token for reply, token in zip(replies, known)):
                    time.sleep(WATCH_IDLE_S)  # timed out, or answered at once by a shard with all waiters taken
        except BaseException as error:  # surfaced in the training thread at its next step
            logger.exception("shadowgba GBA watcher thread failed")
            self._error = error

    def _push(self, gradient: torch.Tensor, tokens: list[int], compute_s: float) -> None:
        started = time.perf_counter()
        futures = [
            transport.call_async(index, DENSE_SERVICE, "push", self.roles.trainer_index, start, end,
                                 gradient[start:end], tokens[index], self.local_batch_size, compute_s)
            for index, (start, end) in enumerate(self.bounds)
        ]
        replies: list[ShardReply] = torch.futures.wait_all(futures)
        for reply in replies:
            self.metrics.record_push(reply.weight)
        self.metrics.record_round(time.perf_counter() - started, 2 * gradient.numel() * gradient.element_size())
        self._offer(replies)
        if replies[0].requested_mode == "sync":
            self._switch_requested = "sync"
