"""One parameter-server rank's slice of the dense parameters under GBA.

The flat dense vector is split into contiguous slices (`shard_bounds`), one per PS rank. Each
`DenseShard` owns its slice, the one authoritative optimizer over it (`FlatOptimizer`), its global
step k and the GBA buffer (`sync_algos.gba.GlobalBatchAggregator`). Trainers push a gradient slice
with the token they pulled; the reply carries fresh parameters and token, so a push is also a pull.

Invariants:
- One lock guards the shard's state; the transport's server threads call concurrently. What reads only the request
  (the finiteness check of its gradient, a pass over every value) runs before the lock is taken,
  so pushes from several trainers overlap in it. Memory is bounded: one parameter slice, its
  optimizer state, one buffer of the same size and one published copy of the parameters,
  whatever the number of trainers.
- **One copy of the parameters per global step, whatever the number of readers.** The optimizer
  steps its parameters in place, and the channel sends a reply's tensors after the service method has
  returned and the lock is released, so a reply cannot carry the live parameters. The first reply
  after a step clones them into the published copy, and every later reply until the next step
  carries that same tensor. A published copy is never written again (the next step publishes a
  new one), so replies still on their way keep the values of their k. With N trainers watching,
  a step costs one clone instead of N; made by the transport's `shared_copy`, on its board
  (`shadowgba.ps.board`), so that the channels to same-host trainers name it instead of copying it.
- A reply carries the shard's parameters only when the caller lacks them: a pull always; a watch
  once k has passed the caller's token; a push only if the trainer asked for them
  (`PushRequest.reply_params`: False when its watcher brings every new k) and k has passed its
  token. Otherwise the reply is the token alone, so a push costs the server one slice received,
  not one received and one sent.
- A malformed push (wrong shape or dtype, a slice this shard does not own, a token from the future,
  a `num_samples` that is not an integer >= 1) is refused with a `ValueError` *before* anything
  changes.
- **One global step for all shards.** A push is one decision, taken once, by shard 0 (the
  leader) with GBA's rule from the push's single token: kept or dropped, its decay weight, and
  whether it completes a global batch. Shard 0 numbers its kept decisions (`Decision.seq`); the
  trainer then sends each other shard its slice with that decision, and every shard applies the
  decisions in that order (`_follow`: one arriving early waits in `_pending`, a server thread never
  does). So every shard applies the same pushes with the same weights and advances k together:
  once every push has reached every shard (a switch or close, after the trainers' drains), all
  shards hold the same k, and a shard's k never runs ahead of shard 0's. A dropped push changes
  nothing anywhere and is not sent to the other shards.
- **A departed trainer's decision cannot stall the others.** The trainer carries a decision to the
  other shards, so one that departs between shard 0's reply and those sends (killed, or stopped
  past the timeout under `sync.ps.on_trainer_lost: continue`) leaves a gap in their `seq` order.
  Shard 0 remembers each trainer's newest decisions (`RECENT_DECISIONS`; a trainer has one push
  in flight, so only its newest can be missing) and, once its roster records the departure, turns
  them into `Void`s that its reply to every later push carries (for `VOID_WINDOW` decisions), kept
  or dropped, and the trainer hands on to the other shards with that push's parts or pulls;
  `DenseShardClient.settle` hands them over when no push follows (the end of a job). A shard
  applies a void it has not applied by its `seq` as a part refused here: no gradient, the
  decision's samples counted, so k stays shard 0's; one it holds already is ignored. So each shard
  applies each decision exactly once, by the trainer's part or by its void, and the gap closes
  with the next push of any trainer. Dropped pushes must carry voids too: while a shard lags,
  the trainers' tokens (the oldest of their slices') lag with it, and their pushes may all be
  too stale to keep.
- **NaN / Inf never lands.** Shard 0 keeps a push whose gradient (the trainer's whole-vector
  check, `PushRequest.finite`, or its own slice) is not finite out of every shard: under
  `on_nonfinite: skip` it is dropped and counted (`nonfinite_dropped`); under `fail` it is refused
  with a `SyncError` naming the trainer's rank, recorded as the job's failure in the server's roster
  (`shadowgba.job.roster`, its one record), and every later call (any trainer's) is refused with it,
  naming that rank, so every trainer's job ends naming the one that failed.
- The shard also relays mode switches: a request (API or policy) is stored here and carried in
  every reply until the trainers have switched.
- `watch(token)` is a long poll: it returns a Future that completes once k has passed `token` (or
  after its timeout, with the token alone), so a trainer's watcher thread holds the newest
  parameters without polling, and no server thread waits for it. The watches that a step answers
  are completed by the thread that stepped, after it released the shard's lock (the transport
  then replies at once when that thread is the watching trainer's own channel's, so with one
  trainer no reply takes a thread hop); the timeouts by one expiry thread per shard. At most
  `WATCHERS` watches wait at once; further ones are answered at once.

Trainers never name the service's methods as strings: `DenseShardClient`
(`shadowgba.gba.shards`, with the messages) has one typed method per `DenseShard` method, fans it
out over every shard in parallel and returns the shards' replies in shard order.
`serve_dense_shard()` is the server rank's side of the same service name.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from shadowgba.config import from_dict, to_dict
from shadowgba.errors import SyncError
from shadowgba.flat_optimizer import FlatOptimizer, OptimizerSpec, check_export
from shadowgba.gba.config import GBAConfig
from shadowgba.gba.shards import DENSE_SERVICE, Decision, PushRequest, ShardReply, Void
from shadowgba.gba.switch_policy import SwitchPolicy
from shadowgba.nonfinite import DEFAULT_ON_NONFINITE, check_on_nonfinite, nonfinite_failure
from shadowgba.job.roster import Roster
from shadowgba.ps.server_state import OfferSchedule
from shadowgba.ps.server_end import ServerTransport
from sync_algos.base import is_finite
from sync_algos.gba import Admission, GlobalBatchAggregator
from sync_algos.staleness import StalenessCounts

WATCHERS = 1024
"""At most this many `watch` calls wait on one shard at the same time; the rest are answered at once.
A waiting watch holds no thread, only its Future: the bound is against a client gone wrong, far
above one watcher per trainer."""
WATCH_MAX_S = 1.0
"""Longest one `watch` call may wait, whatever timeout it asks for."""
RECENT_DECISIONS = 4
"""Shard 0 remembers this many of each trainer's newest kept decisions, to void them if it departs."""
VOID_WINDOW = 1024
"""A void rides on the decisions that follow it until this many more were decided."""


@dataclasses.dataclass
class _Watch:
    """A `watch` waiting for k to pass `token`, answered by its deadline at the latest."""

    token: int
    deadline: float
    future: concurrent.futures.Future


class DenseShard:
    """A thread-safe GBA server for the flat slice [start, end) of the dense parameters."""

    def __init__(self, roster: Roster | None = None,
                 copy: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None) -> None:
        """Empty until a trainer `configure`s it: a server rank does not know the model. `roster`:
        the server's membership, whose departures shard 0 turns into voids (None: one of its own,
        where nobody departs).
        `copy(param, dtype)` makes the published copy of each step's parameters (the transport's
        `shared_copy`: written once for every same-host trainer; None: a plain copy). The roster is
        also the shard's failure record (a shard served alone keeps one of its own)."""
        self._roster = roster if roster is not None else Roster(0)
        self._copy = copy or (lambda tensor, dtype: tensor.to(dtype, copy=True))
        self.start = self.end = self.num_trainers = self.index = 0
        self._lock = threading.Lock()
        self._watches: list[_Watch] = []
        """The long polls waiting for k to pass their token (guarded by `_lock`)."""
        self._answered: list[tuple[concurrent.futures.Future, ShardReply | None]] = []
        """Watches answered under the lock, completed once it is released (`_locked`)."""
        self._expiry: threading.Thread | None = None
        """Answers watches at their deadlines; runs while any wait (started by `watch`)."""
        self._expiry_at = float("inf")
        """The deadline the expiry thread sleeps until (guarded by `_lock`)."""
        self._earlier_watch = threading.Event()
        """Set by a `watch` due before `_expiry_at`: the expiry thread wakes to sleep less."""
        self._optimizer: FlatOptimizer | None = None
        self._aggregator: GlobalBatchAggregator | None = None
        self._push_dtype: torch.dtype | None = None
        """The dtype every push's gradient must have (`GBAConfig.push_torch_dtype`)."""
        self._params_dtype: torch.dtype | None = None
        """The dtype of the parameters in watch and push replies (`GBAConfig.params_torch_dtype`)."""
        self._policy: SwitchPolicy | None = None
        self._requested_mode: str | None = None
        self._closing = False
        self._compute_s: list[float] = []
        self._dropped_samples_at_switch = 0
        self._in_flight = 0
        self._max_in_flight = 0
        self._staleness = StalenessCounts()
        self._pushes_by_trainer = collections.Counter()
        self._pushes = 0
        self._steps_at_configure = 0
        self._configured_at = time.monotonic()
        self._on_nonfinite = DEFAULT_ON_NONFINITE
        self._nonfinite_dropped = 0
        self._decided = 0
        """Shard 0: kept decisions handed out since configure (the next `Decision.seq`)."""
        self._next_seq = 0
        """The other shards: the `Decision.seq` to apply next."""
        self._pending: dict[int, tuple[PushRequest | Void, bool]] = {}
        """The other shards: pushes (with finiteness) or voids that arrived before their predecessors, by seq."""
        self._recent: dict[int, collections.deque[Void]] = {}
        """Shard 0: each trainer's newest kept decisions, voided if it departs."""
        self._voided: list[Void] = []
        """Shard 0: the voids of departed trainers' decisions still carried (the last `VOID_WINDOW`)."""
        self._departures_seen = 0
        """Shard 0: how many of the roster's departures were turned into voids."""
        self._voids = 0
        """Shard 0: decisions voided; the other shards: voids applied (their trainer's part never came)."""
        self._published: tuple[int, torch.Tensor] | None = None
        """(k, a copy of the parameters at k) that replies carry; never written once published."""
        self._configured_with: dict[str, Any] = {}
        """What `configure` was given besides the export: a checkpoint needs it to configure again."""
        self._checkpoint: OfferSchedule | None = None
        """When the shard's state is offered: at each k that is a multiple of its interval (`on_checkpoint`)."""
        self._restored_at: int | None = None
        """The k this shard's process was restored at (`restore`); None: it was configured by a trainer."""
        self._dropped_after_restore = 0
        """Pushes computed on parameters newer than the restored k (before a server restart), dropped."""

    # -------------------------------------------------------------------------------- mode changes
    def configure(self, start: int, end: int, num_trainers: int, spec: OptimizerSpec, exported: dict[str, Any],
                  config: GBAConfig, global_batch: int, index: int = 0, on_nonfinite: str = DEFAULT_ON_NONFINITE,
                  if_idle: bool = False) -> bool:
        """Own slice [start, end) as shard `index` (0 decides every push): take over its parameters,
        optimizer state and global step (at start, at a switch to GBA, or loading a checkpoint).
        `if_idle`: only if the shard is not serving GBA yet (the elastic layout: a restarted trainer
        0 must not reset the shards the others train on). Whether it took them."""
        if if_idle and self.serving():
            return False
        check_on_nonfinite(on_nonfinite)
        numel = end - start
        check_export(exported, spec, numel, exported["param"].dtype, f"the slice [{start}, {end}) given to shard {index}")
        optimizer = FlatOptimizer(spec, exported["param"])
        optimizer.load(exported)
        aggregator = GlobalBatchAggregator(config, numel, exported["param"].dtype, global_batch)
        aggregator.global_step = optimizer.global_step
        with self._locked():
            if if_idle and self._optimizer is not None:
                return False
            self.start, self.end, self.num_trainers = start, end, num_trainers
            self._compute_s = [0.0] * num_trainers
            self._optimizer, self._aggregator = optimizer, aggregator
            self._push_dtype = config.push_torch_dtype(optimizer.param.dtype)
            self._params_dtype = config.params_torch_dtype(optimizer.param.dtype)
            self._policy = SwitchPolicy(config.switch_policy)
            self._requested_mode = None
            self._closing = False
            self._steps_at_configure = optimizer.global_step
            self._configured_at = time.monotonic()
            self.index, self._on_nonfinite = index, on_nonfinite
            self._decided = self._next_seq = 0
            self._pending, self._recent, self._voided = {}, {}, []
            self._published = None
            self._configured_with = dict(start=start, end=end, num_trainers=num_trainers, spec=spec, config=config,
                                         global_batch=global_batch, index=index, on_nonfinite=on_nonfinite)
            self._offer_checkpoint(force=True)
            self._answer_passed()
            return True

    def on_checkpoint(self, every: int, offer: Callable[[int, dict[str, Any]], None]) -> None:
        """Offer the shard's state (what `restore` takes: the `configure` arguments and the
        optimizer's export at k) to `offer(k, state)` now (if configured) and after every step
        that brings k to a multiple of `every` (`shadowgba.ps.server_state`); called under the
        shard's lock, so `offer` must only hand the state over."""
        with self._lock:
            self._checkpoint = OfferSchedule(every, offer)
            self._offer_checkpoint(force=True)

    def restore(self, state: dict[str, Any]) -> None:
        """Serve again from a state `on_checkpoint` offered (a new server process, before it serves):
        pushes computed on parameters newer than its k (made before the restart) are dropped and
        counted, not refused."""
        configured = state["configure"]
        self.configure(**{**configured, "spec": from_dict(OptimizerSpec, configured["spec"]),
                          "config": from_dict(GBAConfig, configured["config"])}, exported=state["exported"])
        with self._lock:
            self._restored_at = self._aggregator.global_step

    def serving(self) -> bool:
        """Whether the shard serves GBA (configured, and not exported since)."""
        with self._lock:
            return self._optimizer is not None

    def export(self) -> dict[str, Any]:
        """Hand parameters, optimizer state and k back (switch to sync); the shard goes idle.

        A partly filled global batch is discarded (counted in `dropped_samples_at_switch`): its
        gradients belong to no step the synchronous side will take.
        """
        with self._locked():
            optimizer, aggregator = self._require_configured()
            if self._pending:
                raise RuntimeError(f"dense shard {self.index} cannot export: pushes {sorted(self._pending)} still "
                                   f"wait for their predecessors (a trainer left GBA without draining)")
            self._dropped_samples_at_switch = aggregator.discard()
            exported = optimizer.export()
            self._optimizer = self._aggregator = self._published = None
            self._answer_passed()
            return exported

    def snapshot(self) -> dict[str, Any]:
        """Parameters, optimizer state and k, as `export` gives them, but the shard keeps serving
        (a checkpoint in GBA mode); the partly filled global batch is not part of it."""
        with self._lock:
            optimizer, _ = self._require_configured()
            return optimizer.export()

    def request_mode(self, mode: str) -> bool:
        """Ask every trainer to switch to `mode`, carried in replies until they do. Refused (False)
        once a trainer has begun closing: a switch then could not be completed by every trainer."""
        if mode not in ("sync", "gba"):
            raise ValueError(f"unknown mode '{mode}'; allowed: ['gba', 'sync']")
        with self._lock:
            if self._closing:
                return False
            self._requested_mode = mode
            return True

    def fail(self, reason: str, ranks: Sequence[int]) -> None:
        """A trainer's job failed (`reason` names it and `ranks`, e.g. a non-finite gradient under
        on_nonfinite fail): the server's roster refuses every later call, any trainer's, with it."""
        self._roster.fail(reason, ranks)

    def begin_close(self) -> bool:
        """A trainer wants to finish in GBA mode. True: no switch can start from now on. False: a
        switch is pending, and the trainer must take part in it before it closes.

        Deciding both under one lock is what keeps trainers from pairing a close barrier with a
        switch barrier."""
        with self._lock:
            if self._requested_mode is not None:
                return False
            self._closing = True
            return True

    # ----------------------------------------------------------------------------- push and pull
    def pull(self, with_params: bool = True, voided: Sequence[Void] = ()) -> ShardReply:
        """The shard's token and mode request, and its parameters unless `with_params` is False;
        `voided` (the other shards): shard 0's voids, applied first (`DenseShardClient.settle`)."""
        with self._locked():
            self._require_configured()
            self._apply_in_order(voided)
            return self._reply(known=None if with_params else self._aggregator.global_step, exact=True)

    def watch(self, token: int, timeout_s: float) -> concurrent.futures.Future:
        """Long poll: a Future of the parameters once the global step has passed `token`, or, after
        `timeout_s` (at most `WATCH_MAX_S`), of the token alone (nothing newer); of None when the
        shard is not serving GBA (the trainers are switching to sync mode). Answered at once when
        k has passed already, or `WATCHERS` watches already wait. Never blocks: the transport
        replies when the Future completes."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            timeout_s = min(max(timeout_s, 0.0), WATCH_MAX_S)
            if self._aggregator is None or self._aggregator.global_step > token or timeout_s == 0.0 \
                    or len(self._watches) >= WATCHERS:
                future.set_result(None if self._aggregator is None else self._reply(known=token))
                return future
            deadline = time.monotonic() + timeout_s
            self._watches.append(_Watch(token, deadline, future))
            earlier = deadline < self._expiry_at
            if self._expiry is None:
                self._expiry = threading.Thread(target=self._expire_watches, name="shadowgba-watch-expiry", daemon=True)
                self._expiry.start()
        if earlier:
            self._earlier_watch.set()
        return future

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The shard's lock, for a method that may answer watches (a step, a configure, an export):
        the watches it answered are completed once the lock is released, so that the transport's
        replies to them (run by their completion) never hold the shard."""
        answered: list[tuple[concurrent.futures.Future, ShardReply | None]] = []
        try:
            with self._lock:
                try:
                    yield
                finally:  # a method that raised after a step still answers its watches
                    answered, self._answered = self._answered, []
        finally:
            for future, reply in answered:
                future.set_result(reply)

    def _answer_passed(self) -> None:
        """Answer every watch whose token k has passed, or all when the shard stopped serving (the
        lock held, under `_locked`)."""
        k = None if self._aggregator is None else self._aggregator.global_step
        self._answer_watches(lambda watch: k is None or k > watch.token)

    def _answer_watches(self, due: Callable[["_Watch"], bool]) -> None:
        """Answer the watches `due` selects, with the parameters they lack (the lock held)."""
        waiting = []
        for watch in self._watches:
            if due(watch):
                self._answered.append((watch.future, None if self._aggregator is None else self._reply(known=watch.token)))
            else:
                waiting.append(watch)
        self._watches = waiting

    def _expire_watches(self) -> None:
        """The expiry thread: answer each watch at its deadline with what the shard has then; end
        once none waits. It wakes at the earliest deadline only (watches arriving with later ones,
        the common case, cost it nothing)."""
        while True:
            with self._locked():
                now = time.monotonic()
                self._answer_watches(lambda watch: watch.deadline <= now)
                if not self._watches:
                    self._expiry, self._expiry_at = None, float("inf")
                    return
                self._expiry_at = min(watch.deadline for watch in self._watches)
                wait_s = self._expiry_at - now
            self._earlier_watch.wait(wait_s)
            self._earlier_watch.clear()

    def push(self, request: PushRequest) -> ShardReply:
        """Add one trainer's gradient slice; step the optimizer when a global batch is complete.
        Shard 0 decides (`_decide`), the others follow its decision (`_follow`)."""
        with self._lock:
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)
        try:
            # the one pass over the values, outside the lock; a gradient that is no tensor is refused below
            finite = isinstance(request.gradient, torch.Tensor) and is_finite(request.gradient)
            with self._locked():
                self._require_configured()
                if (refusal := self._roster.refusal(f"push refused by dense shard {self.index}")) is not None:
                    raise refusal
                request.check_for(self.start, self.end, self.num_trainers, self._push_dtype,
                                  self._optimizer.param.shape)
                return self._decide(request, finite) if request.decision is None else self._follow(request, finite)
        finally:
            with self._lock:
                self._in_flight -= 1

    def _decide(self, request: PushRequest, finite: bool) -> ShardReply:
        """Shard 0: GBA's rule decides the push for every shard (the lock held, validated; `finite`:
        this slice's check)."""
        if self.index != 0:
            raise ValueError(f"push refused by dense shard {self.index}: only shard 0 decides a push; "
                             "the others need its decision")
        if not request.finite or not finite:
            return self._nonfinite(request)
        if self._restored_at is not None and request.token > self._aggregator.global_step:
            self._dropped_after_restore += 1  # computed before this process was restored to an older k
            return self._dropped(request)
        admission, mean = self._aggregator.decide(request.gradient, request.token, request.num_samples)
        decision = None
        if not admission.dropped:
            decision = Decision(self._decided, admission)
            recent = self._recent.setdefault(request.trainer, collections.deque(maxlen=RECENT_DECISIONS))
            recent.append(Void(self._decided, admission, request.num_samples))
            self._decided += 1
        self._count(request, admission)
        if mean is not None:
            self._step(mean)
        return self._push_reply(request, admission.weight, decision)

    def _follow(self, request: PushRequest, finite: bool) -> ShardReply:
        """Every other shard: apply shard 0's decisions in its order (the lock held, validated).

        A part whose gradient is not finite here although the trainer said it was (a broken
        client) contributes nothing, but its decision still counts its samples, so that k stays
        shard 0's; then it is refused."""
        decision = request.decision
        if self.index == 0:
            raise ValueError("push refused by dense shard 0: it decides pushes, it does not follow decisions")
        if decision.seq < self._next_seq or decision.seq in self._pending:
            raise ValueError(f"push refused by dense shard {self.index}: decision {decision.seq} was already applied")
        self._pending[decision.seq] = (request, finite)
        self._apply_in_order(request.voided)
        if not finite:
            raise ValueError(f"push refused by dense shard {self.index}: trainer {request.trainer}'s gradient has "
                             "NaN or inf values here (its decision was kept without it, so k stays shard 0's)")
        return self._push_reply(request, decision.admission.weight)

    def voided(self) -> list[Void]:
        """Shard 0: the voids the other shards may still lack (`DenseShardClient.settle`)."""
        with self._lock:
            self._require_configured()
            return list(self._current_voids())

    def _apply_in_order(self, voided: Sequence[Void]) -> None:
        """Take `voided` decisions not held yet, then apply every pending decision whose turn has come
        (a follower, the lock held)."""
        if voided and self.index == 0:
            raise ValueError("voids refused by dense shard 0: it decides pushes, it does not follow decisions")
        for void in voided:
            if void.seq >= self._next_seq and void.seq not in self._pending:
                self._pending[void.seq] = (void, False)
        while self._next_seq in self._pending:
            ready, ready_finite = self._pending.pop(self._next_seq)
            self._next_seq += 1
            if isinstance(ready, Void):
                mean = self._aggregator.follow(None, ready.admission, ready.num_samples)
                self._voids += 1
            else:
                admission = ready.decision.admission
                mean = self._aggregator.follow(ready.gradient if ready_finite else None, admission, ready.num_samples)
                self._count(ready, admission)
            if mean is not None:
                self._step(mean)

    def _current_voids(self) -> tuple[Void, ...]:
        """Shard 0: void the recent decisions of trainers that departed since the last call, and
        return the voids still carried (the lock held)."""
        departures = self._roster.departures
        for departure in departures[self._departures_seen:]:
            voids = self._recent.pop(departure.trainer, ())
            self._voided.extend(voids)
            self._voids += len(voids)
        self._departures_seen = len(departures)
        self._voided = [void for void in self._voided if void.seq >= self._decided - VOID_WINDOW]
        return tuple(self._voided)

    def _nonfinite(self, request: PushRequest) -> ShardReply:
        """Shard 0 and a non-finite gradient: dropped and counted (skip) or the job fails (fail)."""
        failure = nonfinite_failure(self._on_nonfinite, f"trainer {request.trainer}'s gradient has NaN or inf values")
        if failure is not None:
            self._roster.fail(failure, (request.trainer,))  # a trainer's index is its rank (`shadowgba.job.roles`)
            raise SyncError(f"push refused by dense shard {self.index}: {failure}", ranks=(request.trainer,))
        self._nonfinite_dropped += 1
        return self._dropped(request)

    def _dropped(self, request: PushRequest) -> ShardReply:
        """Shard 0's reply to a push it counts but applies nowhere (the lock held)."""
        self._pushes += 1
        self._pushes_by_trainer[request.trainer] += 1
        return self._push_reply(request, 0.0)

    def _count(self, request: PushRequest, admission: Admission) -> None:
        self._pushes += 1
        self._pushes_by_trainer[request.trainer] += 1
        self._staleness.add(admission.staleness, admission.weight)
        self._compute_s[request.trainer] = request.compute_s

    def _step(self, mean: torch.Tensor) -> None:
        """Apply one global batch's mean gradient: k advances; shard 0's policy may ask for sync."""
        self._optimizer.step(mean)
        self._offer_checkpoint()
        self._answer_passed()
        if self.index == 0:
            target = self._policy.observe("gba", self._compute_s)
            if target is not None and not self._closing:
                self._requested_mode = target

    def _offer_checkpoint(self, force: bool = False) -> None:
        """Offer the state to the checkpoint writer at a multiple of its step, or now if `force`
        (the lock held)."""
        if self._checkpoint is None or self._optimizer is None:
            return
        self._checkpoint.offer_at(self._aggregator.global_step, lambda: {
            "configure": {**self._configured_with, "spec": to_dict(self._configured_with["spec"]),
                          "config": to_dict(self._configured_with["config"])},
            "exported": self._optimizer.export()}, force)

    # ---------------------------------------------------------------------------------- metrics
    def stats(self) -> dict[str, Any]:
        """Staleness histogram, decayed / dropped counts, global steps per second, queue depth."""
        with self._lock:
            global_step = self._aggregator.global_step if self._aggregator else None
            elapsed = max(time.monotonic() - self._configured_at, 1e-9)
            steps = (global_step or self._steps_at_configure) - self._steps_at_configure
            return {
                "global_step": global_step,
                "global_steps_per_s": steps / elapsed,
                "pushes": self._pushes,
                "pushes_by_trainer": dict(sorted(self._pushes_by_trainer.items())),
                **self._staleness.summary(),
                "queue_depth": self._in_flight,
                "queue_depth_max": self._max_in_flight,
                "buffered_samples": self._aggregator.buffered_samples if self._aggregator else 0,
                "dropped_samples_at_switch": self._dropped_samples_at_switch,
                "nonfinite_dropped": self._nonfinite_dropped,
                "pending_pushes": len(self._pending),
                "voided_decisions" if self.index == 0 else "voids_applied": self._voids,
                "restored_at": self._restored_at,
                "dropped_after_restore": self._dropped_after_restore,
                "failure": self._roster.failure,
            }

    # --------------------------------------------------------------------------------- internals
    def _reply(self, weight: float = 1.0, decision: Decision | None = None, known: int | None = None,
               exact: bool = False) -> ShardReply:
        """Token and pending mode request, with the published parameters unless the caller holds
        those of step `known` and k has not passed it (the lock held, configured); `exact`: in the
        parameters' own dtype whatever `params_dtype` says (a pull)."""
        k = self._aggregator.global_step
        params = self._published_params(k, exact) if known is None or k > known else None
        return ShardReply(params, k, self._requested_mode, weight, decision)

    def _published_params(self, k: int, exact: bool = False) -> torch.Tensor:
        """The parameters at global step `k` (the current one) in the replies' dtype, copied once
        per step for every reply (module docstring); the lock held. `exact` with another replies'
        dtype: a copy of their own dtype, made for this reply alone (pulls are rare)."""
        param = self._optimizer.param.detach()
        if exact and self._params_dtype != param.dtype:
            return param.clone()
        if self._published is None or self._published[0] != k:
            self._published = (k, self._copy(param, self._params_dtype))
        return self._published[1]

    def _push_reply(self, request: PushRequest, weight: float, decision: Decision | None = None) -> ShardReply:
        """`_reply` to a push: parameters only if the trainer asked for them and k passed its token;
        from shard 0, with the voids the other shards may lack."""
        known = request.token if request.reply_params else self._aggregator.global_step
        reply = self._reply(weight, decision, known)
        return dataclasses.replace(reply, voided=self._current_voids()) if self.index == 0 else reply

    def _require_configured(self) -> tuple[FlatOptimizer, GlobalBatchAggregator]:
        if self._optimizer is None or self._aggregator is None:
            raise RuntimeError(f"dense shard [{self.start}, {self.end}) is not serving GBA (sync mode or not configured)")
        return self._optimizer, self._aggregator


def serve_dense_shard(transport: ServerTransport) -> None:
    """On a server rank: host an (unconfigured) dense shard; trainers configure it."""
    transport.serve(DENSE_SERVICE, DenseShard(transport.roster, transport.shared_copy))
