"""GBA mode's asynchronous client: the training thread hands gradients off and never waits.

    training thread --submit(gradient)--> bounded queue --> pusher thread --push--> shards
          ^                                                     |  replies
          +--install_fresh()-- newest reply per shard <---------+
                                          ^-------- watcher thread <--watch (long poll)-- shards

- The queue holds at most `queue_size` gradients; when it is full the oldest is dropped (counted
  in `metrics.queue_dropped`), so the training thread never blocks on the network.
- The pusher thread pushes each queued gradient (`DenseShardClient.push`: shard 0 decides it for
  every shard) with the one token of the parameters it was computed on, the oldest installed
  slice's; a reply is each shard's token (and, without the watcher, its fresh slice), and shard
  0's may carry a request to switch to sync (`sync_requested`). A gradient the training thread found non-finite is pushed
  marked so (`finite`): shard 0 drops and counts it, and no other shard sees it.
- Under global-batch aggregation the watcher thread keeps one long poll (`DenseShard.watch`) per
  shard open, which answers as soon as the shard's global step advances. Without it the newest
  parameters at the end of step n would be the reply to the push of step n-1, fetched a whole
  step earlier, and every gradient would be computed on parameters about one step staler than
  necessary (4 equal trainers, bench_gba simulated compute: mean staleness 1.73 without the
  watcher, 1.17 with it; the floor is about 1, the span of a step). Without aggregation (plain
  async) k advances at every push, so each watch would answer every push of every trainer (N^2
  replies; measured -27% samples/s in real compute): plain async keeps the fetch with each push.
- Both background threads only `_offer` replies: per shard the newest one is kept. The training
  thread installs them (`install_fresh`) at the end of its step, shard by shard: a shard's
  parameters are a function of its global step, so a newer token means newer values.

Threads and locks: the background threads only call the servers (`Transport`), never a collective, so the trainer
group never has two threads of one rank in it. `_queue_ready` guards the queue, the pushed gradient and
the spare buffers; `_replies_lock` guards the kept replies and the watcher's copy of the tokens. A thread's
failure is kept and raised in the training thread, as a `SyncError` chaining it, at its next call
of `raise_error` (every step), `drain` or `wait_for_global_step`. `stop()` always stops and joins
both threads.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Callable

import torch

from shadowgba.dense import DenseParams
from shadowgba.errors import ServerRestarted, SyncError
from shadowgba.metrics import GBAMetrics
from shadowgba.gba.lookahead import Lookahead
from shadowgba.gba.shards import DenseShardClient, ShardReply

logger = logging.getLogger("shadowgba")

WATCH_TIMEOUT_S = 0.25
"""Longest a watcher's long poll waits on a shard whose global step does not advance."""
WATCH_IDLE_S = 0.01
"""Pause before the next long poll when the last one brought nothing newer, so that a shard that
answers at once (all its waiters taken) is not polled in a tight loop."""


def entered_step(reply: ShardReply) -> int | None:
    """The global step a push's gradient entered, from shard 0's reply: the k its global batch
    advances the shards to once applied (the reply's own k if this push completed the batch, else
    the next one); None for a dropped push, which entered none."""
    if reply.decision is None:
        return None
    return reply.token + (0 if reply.decision.admission.completed_samples else 1)


@dataclasses.dataclass(frozen=True)
class _Queued:
    """A gradient waiting for the pusher thread."""

    gradient: torch.Tensor
    token: int
    """The global step of the parameters the gradient was computed on (the oldest slice's)."""
    compute_s: float
    finite: bool
    seq: int
    """How many gradients the training thread submitted before this one."""


class GBAClient:
    """One trainer's asynchronous traffic with the dense shards in GBA mode (see the module docstring)."""

    def __init__(self, shards: DenseShardClient, dense: DenseParams, trainer_index: int, local_batch_size: int,
                 global_batch: int, queue_size: int, watch: bool, metrics: GBAMetrics,
                 push_dtype: torch.dtype | None = None, lookahead: float = 0.0) -> None:
        """`global_batch`: the samples of one global step (`wait_answer` reports the share missing);
        `watch`: run the watcher's long polls while in GBA mode (global-batch aggregation only);
        `push_dtype`: the dtype gradients are queued and pushed in (default: the parameters');
        `lookahead`: compute on predicted parameters (`shadowgba.gba.lookahead`; 0: off)."""
        self._shards = shards
        self._dense = dense
        self._push_dtype = push_dtype or dense.dtype
        self._trainer_index = trainer_index
        self._local_batch_size = local_batch_size
        self._global_batch = global_batch
        self._queue_size = queue_size
        self._watch = watch
        self._metrics = metrics
        self._lookahead = Lookahead(dense, lookahead)
        self.tokens: list[int] = []
        """Per shard, the token of the installed parameters (training thread only)."""
        self._sync_requested = threading.Event()
        """Set by the pusher when a reply carries a request to switch to sync; cleared by `leave`."""
        self._epoch = 0
        """Bumped by `leave` and `_rebase`: a watch answered before it (parameters of before a switch,
        a checkpoint load or a server's restart, whose k may be higher than the new one) is not
        offered after it."""
        self._rebased = False
        """Set by `_rebase`: the next `install_fresh` installs what it holds whatever the tokens
        (a restored server's k went back); guarded by _replies_lock."""
        self._restarts_seen = 0
        """The transport's `server_restarts` at the last `_rebase` (both threads may rebase after one)."""
        self._queue: collections.deque[_Queued] = collections.deque()
        self._spare: list[torch.Tensor] = []
        """Gradient buffers neither queued nor being pushed, for `submit` to reuse: at most
        `queue_size` + 1 are ever allocated (the queue and the push in flight)."""
        self._queue_ready = threading.Condition()
        self._in_flight: tuple[torch.Tensor, ...] = ()
        """The gradient the pusher is pushing (empty: none)."""
        self._stopping = False
        self._fresh: list[ShardReply | None] = [None] * len(shards.bounds)
        """Per shard, the newest reply (push or watch) not yet installed; guarded by _replies_lock."""
        self._live_tokens: list[int] = []
        """A copy of `tokens` for the watcher thread; guarded by _replies_lock."""
        self._replies_lock = threading.Lock()
        self._replies_arrived = threading.Condition(self._replies_lock)
        """Notified by `_offer`, `_answer`, `_rebase` and a thread's failure: wakes `wait_fresh`."""
        self._submitted = 0
        """Gradients submitted so far (training thread only)."""
        self._answered: tuple[int, int | None, float] = (0, None, 0.0)
        """The newest answered push: its `_Queued.seq` + 1, the global step its gradient entered
        (reached once the batch it joined is applied; None: dropped, or lost to a server's
        restart) and the share of that global batch still missing after it; guarded by _replies_lock."""
        self._batch_clock: tuple[float, int, float] | None = None
        """For the newest answered push whose global batch was still missing gradients: that share,
        the global step it entered and when the answer came; None once that step arrived. Guarded
        by _replies_lock."""
        self._batch_waits: list[tuple[float, float]] = []
        """(missing share, seconds from the push's answer to its global step's arrival) of the
        pushes since the last `take_batch_waits`, whether or not the training thread waited for
        them (a push answered before its predecessor's step arrived closes that one's clock at
        its answer: a lower bound). Guarded by _replies_lock."""
        self._watching = threading.Event()
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []

    # ----------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the pusher and the watcher (both idle until GBA mode gives them work)."""
        self._threads = [
            threading.Thread(target=self._run, args=(self._push_loop, "pusher"), name="shadowgba-gba", daemon=True),
            threading.Thread(target=self._run, args=(self._watch_loop, "watcher"), name="shadowgba-gba-watch",
                             daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self, discard_queued: bool = False) -> None:
        """Stop and join both threads; never raises. The pusher first pushes what is queued, unless
        `discard_queued` (an abort: the run is over, nothing more should reach the shards)."""
        self._watching.clear()
        with self._queue_ready:
            if discard_queued:
                self._queue.clear()
            self._stopping = True
            self._queue_ready.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads = []

    # ---------------------------------------------------------------------- entering / leaving GBA
    def enter(self) -> None:
        """Entering GBA mode: install every shard's parameters, then keep them fresh."""
        self.refresh()
        if self._watch:
            self._watching.set()

    def leave(self) -> None:
        """Leaving GBA mode: stop watching, wait for this trainer's pushes, forget what they brought."""
        self._watching.clear()
        self.drain()
        with self._replies_lock:
            self._fresh = [None] * len(self._shards.bounds)
            self._epoch += 1
            self._batch_clock, self._batch_waits = None, []  # a batch of before the switch is never timed
        self._sync_requested.clear()
        self._lookahead.forget()

    @property
    def sync_requested(self) -> bool:
        """Whether a push reply has carried a request to switch to sync since GBA mode was entered."""
        return self._sync_requested.is_set()

    @property
    def global_step(self) -> int:
        """The global step of the installed parameters: the oldest slice's token (the shards share one
        k, but one slice can be installed before the next shard has applied the same push)."""
        return min(self.tokens)

    # ------------------------------------------------------------------------- training thread
    def take_buffer(self) -> torch.Tensor:
        """A gradient buffer for the training thread to write this step's gradient into, then
        `submit`: a spare one, or, when the queue is full, the oldest queued gradient's (that
        gradient is dropped); a new one only while fewer than `queue_size` + 1 exist."""
        with self._queue_ready:
            if len(self._queue) >= self._queue_size:
                self._metrics.record_queue_drop()
                return self._queue.popleft().gradient
            if self._spare:
                return self._spare.pop()
        return self._dense.empty(self._push_dtype)

    def submit(self, gradient: torch.Tensor, compute_s: float, finite: bool = True) -> None:
        """Queue `gradient`, a buffer from `take_buffer` holding a gradient computed on the
        installed parameters. `finite` False: the training thread found NaN / Inf in it; shard 0
        only counts it."""
        with self._queue_ready:
            self._queue.append(_Queued(gradient, self.global_step, compute_s, finite, self._submitted))
            self._submitted += 1
            self._queue_ready.notify()

    def held_tensors(self) -> dict[str, torch.Tensor]:
        """For `metrics.memory()`: the gradient buffers allocated so far (queued, in flight or
        spare), the received parameters not yet installed (at most one per shard) and the
        lookahead's vectors."""
        with self._queue_ready:
            buffers = [queued.gradient for queued in self._queue] + self._spare + list(self._in_flight)
        with self._replies_lock:
            fresh = {f"fresh_{index}": reply.params for index, reply in enumerate(self._fresh) if reply is not None}
        return {**{f"queue_{index}": buffer for index, buffer in enumerate(buffers)}, **fresh,
                **self._lookahead.held_tensors()}

    def received_parameters(self) -> contextlib.AbstractContextManager[None]:
        """Inside, the live parameters are the shards' values as received (`Lookahead.received`)."""
        return self._lookahead.received()

    def install_fresh(self) -> None:
        """Install, shard by shard, the newest parameters received since the last install."""
        with self._replies_lock:
            fresh, self._fresh = self._fresh, [None] * len(self._shards.bounds)
            rebased, self._rebased = self._rebased, False
        newer = [reply is not None and (rebased or reply.token > token) for reply, token in zip(fresh, self.tokens)]
        if not any(newer):
            return
        slices = [reply.params if new else None for reply, new in zip(fresh, newer)]
        tokens = [reply.token if new else token for reply, new, token in zip(fresh, newer, self.tokens)]
        self._install(slices, tokens, exact=rebased)

    def wait_answer(self, timeout_s: float) -> float | None:
        """Wait at most `timeout_s` until the last submitted gradient's push is answered; then the
        share of the global batch it entered still missing (0 when it completed the batch or entered
        none: nothing more to wait for), or None if no answer came in time."""
        if not self._wait_until(lambda: self._answered[0] >= self._submitted, timeout_s):
            return None
        with self._replies_lock:
            return self._answered[2]

    def wait_fresh(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` until the last submitted gradient's push is answered and, if it
        was kept, until every shard has sent the parameters of the global step it entered (its
        global batch applied), so that the next gradient is computed on them; True if they came.

        Not "parameters newer than the gradient's token": those can be the previous global step's,
        applied while the gradient was computed, and a trainer installing them would compute every
        gradient one step stale again (a stable state: measured, 2 equal trainers, 97% stale).
        Returns at once on a background thread's failure (raised by the next `raise_error`) or when
        GBA mode is not being watched (leaving it, or plain async)."""
        return self._wait_until(self._fresh_arrived, timeout_s)

    def _wait_until(self, arrived: Callable[[], bool], timeout_s: float) -> bool:
        """Wait at most `timeout_s` until `arrived()` (called with _replies_lock held) is true; False
        at the timeout, on a background thread's failure or when GBA mode is not being watched."""
        deadline = time.monotonic() + timeout_s
        with self._replies_arrived:
            while not arrived():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._error is not None or not self._watching.is_set():
                    return False
                self._replies_arrived.wait(remaining)
        return True

    def _fresh_arrived(self) -> bool:
        """`wait_fresh`'s condition; the caller holds _replies_lock."""
        answered, target, _ = self._answered
        if answered < self._submitted:
            return False
        return target is None or self._arrived(target)

    def _arrived(self, step: int) -> bool:
        """Whether every shard's parameters of global step `step` (or newer) are installed or at
        hand; the caller holds _replies_lock."""
        return all(live >= step or (reply is not None and reply.token >= step)
                   for live, reply in zip(self._live_tokens, self._fresh))

    def take_batch_waits(self) -> list[tuple[float, float]]:
        """The (missing share, seconds) measured since the last call (`_batch_waits`)."""
        with self._replies_lock:
            waits, self._batch_waits = self._batch_waits, []
        return waits

    def _time_batch(self, now: float) -> None:
        """Stop the clock of the newest answered push if its global step has arrived; the caller
        holds _replies_lock."""
        if self._batch_clock is not None and self._arrived(self._batch_clock[1]):
            missing, _, answered_at = self._batch_clock
            self._batch_waits.append((missing, now - answered_at))
            self._batch_clock = None

    def refresh(self) -> None:
        """Pull every shard's parameters now and install them."""
        self._install_replies(self._shards.pull())

    def wait_for_global_step(self, global_step: int, timeout_s: float) -> None:
        """Wait for this trainer's pushes to be answered, then pull until every shard has passed
        `global_step` and install that (`GBASync.wait_for_global_step` says why in this order)."""
        deadline = time.monotonic() + timeout_s
        self.drain()
        while self.global_step < global_step:
            self.raise_error()
            if time.monotonic() > deadline:
                raise TimeoutError(f"global step {global_step} not reached within {timeout_s}s (at {self.global_step})")
            replies = self._shards.pull()
            if min(reply.token for reply in replies) >= global_step:
                self._install_replies(replies)
            else:
                if len({reply.token for reply in replies}) > 1:  # a shard behind: maybe a departed trainer's gap
                    self._shards.settle()
                time.sleep(0.001)

    def drain(self) -> None:
        """Wait until the pusher has pushed everything queued (its errors surface here)."""
        with self._queue_ready:
            while (self._queue or self._in_flight) and self._error is None:
                self._queue_ready.wait(timeout=0.05)
        self.raise_error()

    def raise_error(self) -> None:
        """Raise a background thread's failure, once, as a SyncError chaining it."""
        if self._error is not None:
            error, self._error = self._error, None
            raise SyncError(f"GBA shadow thread failed: {error!r}") from error

    def _install_replies(self, replies: list[ShardReply]) -> None:
        self._install([reply.params for reply in replies], [reply.token for reply in replies], exact=True)

    def _install(self, slices: list[torch.Tensor | None], tokens: list[int], exact: bool) -> None:
        """Make these parameters the live ones (GBA trainers make no local dense updates), each
        shard's slice; None: that shard's slice is installed already. `exact`: the values
        themselves (pulls); else, with lookahead, the prediction from them."""
        self._lookahead.install(slices, tokens, self._shards.bounds, exact)
        self.tokens = tokens
        with self._replies_lock:
            self._live_tokens = list(tokens)
        self._metrics.record_applied(min(tokens))

    # ----------------------------------------------------------------------- background threads
    def _run(self, loop: Callable[[], None], role: str) -> None:
        """A background thread's body: its failure is kept for the training thread to raise."""
        try:
            loop()
        except BaseException as error:
            logger.exception("shadowgba GBA %s thread failed", role)
            self._error = error  # drain() polls for it
            with self._replies_arrived:
                self._replies_arrived.notify_all()  # wait_fresh returns, the training thread raises it

    def _push_loop(self) -> None:
        """Push queued gradients until stopped and the queue is empty."""
        while True:
            with self._queue_ready:
                while not self._queue and not self._stopping:
                    self._queue_ready.wait()
                if not self._queue:
                    return
                queued = self._queue.popleft()
                self._in_flight = (queued.gradient,)
            try:
                self._push(queued)
            finally:
                with self._queue_ready:
                    self._in_flight = ()
                    self._spare.append(queued.gradient)
                    self._queue_ready.notify_all()

    def _push(self, queued: _Queued) -> None:
        started = time.perf_counter()
        gradient = queued.gradient
        try:
            replies = self._shards.push(self._trainer_index, gradient, queued.token, self._local_batch_size,
                                        queued.compute_s, queued.finite, reply_params=not self._watch)
        except ServerRestarted:
            self._rebase(pushes_lost=1)
            self._answer(queued.seq, None, 0.0)
            return
        if queued.finite:
            self._metrics.record_push(replies[0].weight)  # one decision for the whole push (shard 0's)
        received = sum(reply.params.numel() * reply.params.element_size() for reply in replies if reply.params is not None)
        self._metrics.record_round(time.perf_counter() - started, gradient.numel() * gradient.element_size() + received)
        self._offer(replies)
        if replies[0].requested_mode == "sync":  # before the answer: whoever waited for it sees the request
            self._sync_requested.set()
        entered = entered_step(replies[0])
        missing = 0.0
        if entered is not None and replies[0].decision is not None:  # a kept push (entered_step says so)
            self._lookahead.observe(entered - 1 - queued.token)
            buffered = replies[0].decision.admission.buffered_samples
            missing = max(0.0, 1.0 - buffered / self._global_batch) if buffered else 0.0
        self._answer(queued.seq, entered, missing)

    def _answer(self, seq: int, entered: int | None, missing: float) -> None:
        """The push of gradient `seq` was answered; `entered`: the global step it entered (None:
        none); `missing`: the share of that global batch still to come."""
        with self._replies_arrived:
            self._answered = (seq + 1, entered, missing)
            now = time.monotonic()
            if self._batch_clock is not None:  # its step did not arrive before this answer
                self._batch_waits.append((self._batch_clock[0], now - self._batch_clock[2]))
            self._batch_clock = (missing, entered, now) if entered is not None and missing > 0 else None
            self._time_batch(now)
            self._replies_arrived.notify_all()

    def _watch_loop(self) -> None:
        """While watching: one long poll per shard, renewed when all have answered, each asking
        for a global step past the newest this trainer knows of."""
        while not self._stopping:
            if not self._watching.wait(timeout=WATCH_TIMEOUT_S):
                continue
            with self._replies_lock:
                epoch = self._epoch
                known = [
                    max(token, reply.token if reply is not None else token)
                    for token, reply in zip(self._live_tokens, self._fresh)
                ]
            try:
                replies = [reply for reply in self._shards.watch(known, WATCH_TIMEOUT_S) if reply is not None]
            except ServerRestarted:
                self._rebase(pushes_lost=0)
                continue
            if len(replies) < len(known):  # a shard answered None: the shards are leaving GBA (switch to sync)
                time.sleep(WATCH_TIMEOUT_S)
                continue
            self._offer(replies, epoch)
            if all(reply.token <= token for reply, token in zip(replies, known)):
                time.sleep(WATCH_IDLE_S)  # timed out, or answered at once by a shard with all waiters taken

    def _rebase(self, pushes_lost: int) -> None:
        """A server came back restored from its checkpoint, at an older k (either background thread):
        pull every shard's parameters for the training thread to install whatever their tokens, and
        drop the queued gradients, computed on newer parameters than the restored ones (the shards
        would drop them too). A push in flight at the restart is lost (`pushes_lost`)."""
        replies = self._shards.pull()
        restarts = self._shards.transport.server_restarts
        with self._queue_ready:
            lost = [queued.gradient for queued in self._queue]
            self._queue.clear()
            self._spare.extend(lost)
            self._queue_ready.notify_all()
        with self._replies_lock:
            self._fresh, self._rebased = list(replies), True
            self._live_tokens = [reply.token for reply in replies]
            self._epoch += 1
            self._replies_arrived.notify_all()
            restarted, self._restarts_seen = restarts > self._restarts_seen, restarts
        self._metrics.record_server_restart(pushes_lost + len(lost), restarted)
        logger.log(logging.WARNING if restarted else logging.DEBUG, "shadowgba: trainer %d: a server restarted "
                   "from its checkpoint (global step %d); %d gradients computed on newer parameters were dropped",
                   self._trainer_index, min(reply.token for reply in replies), pushes_lost + len(lost))

    def _offer(self, replies: list[ShardReply], epoch: int | None = None) -> None:
        """Keep, per shard, the newest of the replies with parameters received so far (both
        background threads); a watch's replies only if no `leave` came between its call and now
        (`epoch`)."""
        with self._replies_lock:
            if epoch is not None and epoch != self._epoch:
                return
            for index, reply in enumerate(replies):
                kept = self._fresh[index]
                if reply.params is not None and (kept is None or reply.token > kept.token):
                    self._fresh[index] = reply
            self._time_batch(time.monotonic())
            self._replies_arrived.notify_all()
