"""A parameter server's end of the transport (`shadowgba.ps.transport` states the invariants): it
takes the trainers' sessions (`shadowgba.ps.sessions`), runs each numbered call once on the service it
names and answers on the same channel, relays a long poll's answer when it comes, judges a silent or
closed trainer lost (`shadowgba.job.roster.Roster`), and in `stop()` waits for every trainer.

A session whose peer sends what this side refuses (a frame that is not the wire's, a request that
is no `Call`, a transport request of other arguments: `codec.Malformed`) is closed and logged,
naming the trainer and the session, and is no verdict on that trainer: any process that reaches
the job's store can open a session under a trainer's name, and the trainer itself keeps its own
channel or opens a new one; the other sessions and the acceptor carry on."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from shadowgba.errors import PeerLost
from shadowgba.ps.board import Board
from shadowgba.ps.channel import PING_INTERVAL_S, Channel, ChannelLost
from shadowgba.job.roster import Roster, lost_trainer
from shadowgba.job.roles import Roles
from shadowgba.ps.sessions import STOP_WAIT_S, Acceptor, SessionInfo, latest_ticket, session_group
from shadowgba.ps.codec import Malformed
from shadowgba.ps.transport import CONTROL, Call, Caller, ServiceFailure, Transport

logger = logging.getLogger("shadowgba")

SERVE_WAIT_S = 30.0
"""How long a call for a service name that is not served (yet) waits for `serve()` on its server."""
ABORT_GRACE_S = 2.0
"""How long a server whose trainer aborted (or whom it gave up on) keeps answering with the failure
before its `stop()` raises, so that the surviving trainers read the reason rather than a dead server."""
RECONNECT_GRACE_S = 3.0
"""How long a server waits, after a trainer's channel closed, for that trainer to open a new session
before it declares the trainer lost (a killed trainer opens none)."""
CONTROL_ARGS: dict[str, tuple[type, ...]] = {"arrive": (str, int), "missing": (str,), "met": (str,),
                                             "abort": (int, int, str, list)}
"""The transport's own requests (`_control`) and the types of their arguments (a trainer index is an int)."""
SERVER_THREADS = 16
"""Threads a server sends the replies of answers that came later on (a watch that another trainer's
push or its timeout answered), and runs the calls for services not served yet on."""


@dataclasses.dataclass
class _Reply:
    """One numbered call's reply on a server, set once its first run has returned."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    value: Any = None


class _Replies:
    """A server's replies to the trainers' numbered calls, each kept until its trainer has settled
    it: a retried call waits for, and returns, the reply of the run its number started, so a push
    sent twice is applied once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_trainer: dict[int, dict[int, _Reply]] = collections.defaultdict(dict)

    def run_once(self, caller: Caller, work: Callable[[], Any]) -> Any:
        """`work()` for call `caller` (trainer index, call number, numbers that trainer has settled
        since its last call here), or the reply of the run of that number that came first."""
        trainer, number, settled = caller.trainer, caller.number, caller.settled
        with self._lock:
            replies = self._by_trainer[trainer]
            for old in settled:
                replies.pop(old, None)
            reply = replies.get(number)
            first = reply is None
            if reply is None:
                reply = replies[number] = _Reply()
        if first:
            try:
                reply.value = work()
            finally:  # a retry waiting for this run never waits for ever
                reply.done.set()
        else:
            reply.done.wait()
        return reply.value

    def forget(self, trainer: int) -> None:
        """Drop trainer `trainer`'s replies (its process left the job: no retry of them can follow)."""
        with self._lock:
            self._by_trainer.pop(trainer, None)

    def clear(self) -> None:
        with self._lock:
            self._by_trainer.clear()


class ServerTransport(Transport):
    """A server rank's transport: serves its services to the trainers."""

    def __init__(self, roles: Roles, store: dist.Store, namespace: str, generation: int, timeout_s: float,
                 rpc_timeout_s: float, owns_default_group: bool, incarnation: int, lane_bytes: int | None,
                 on_trainer_lost: str) -> None:
        """A server's end, taking sessions once made (`start_transport`); a trainer lost is acted on
        per `on_trainer_lost` (`sync.ps.on_trainer_lost`)."""
        super().__init__(roles, store, namespace, generation, timeout_s, rpc_timeout_s, owns_default_group, None,
                         incarnation, lane_bytes)
        self._sessions: dict[int, SessionInfo] = {}
        """Server: per trainer index, its current session."""
        self._services: dict[str, object] = {}
        self._services_changed = threading.Condition()
        self._replies = _Replies()
        self._later = threading.local()
        """Server: per receiver thread, the answers that came later which a call it is running
        completed (`_answer_later`), sent in one message with that call's own reply."""
        self.roster = Roster(len(roles.trainer_ranks), on_trainer_lost)
        """Server: the trainers' arrivals and the first failure it knows of (`shadowgba.job.roster`)."""
        self._started_at = time.monotonic()
        self._admitted_at: dict[int, float] = {}
        """Server: per trainer index, when its newest session was admitted (a rejoining process has
        no channel until the session's group is built)."""
        self._pool = concurrent.futures.ThreadPoolExecutor(SERVER_THREADS, f"shadowgba-{roles.name}")
        self._board: Board | None = Board.create(lane_bytes) if lane_bytes != 0 else None
        """Server: where `shared_copy` writes the tensors its services send to every trainer
        (`shadowgba.ps.board`, as large as a lane); None where shared memory is unavailable, or
        without the same-host path (`lane_bytes` 0)."""
        self._acceptor = Acceptor(store, generation, roles.server_index, incarnation, self._accept, self._refusal)
        self._begin()

    def sync_group(self) -> dist.ProcessGroup:
        """The trainers' own group: a server holds none."""
        raise RuntimeError("sync_group() is the trainers' group; this rank is a server")

    def serve(self, name: str, service: object) -> None:
        """Make `service`'s public methods callable by the trainers as `name` (server ranks only)."""
        with self._services_changed:
            if name in self._services or name == CONTROL:
                raise ValueError(f"service '{name}' is already served on {self.roles.name}")
            self._services[name] = service
            self._services_changed.notify_all()

    def shared_copy(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A copy of `tensor` in `dtype` for a service to send to many trainers (server ranks): on
        the board where it has room, so that each same-host trainer's channel names it instead of
        copying it (one copy per server, not per trainer), else a plain one."""
        copy = None if self._board is None else self._board.copy(tensor, dtype)
        return tensor.to(dtype, copy=True) if copy is None else copy

    def _accept(self, info: SessionInfo) -> None:
        """Server, on the acceptor's thread for this session: build the server end of its channel."""
        trainer = f"trainer {info.trainer} (rank {info.rank})"
        try:
            group, loop_threads = session_group(self._namespace, self._generation, self.roles.server_index,
                                                self.incarnation, info.ticket, 0, self.timeout_s)
        except RuntimeError:  # the trainer vanished during the setup: its next session, or its loss, decides
            return
        channel = Channel(group, 0, trainer, on_request=self._on_request, on_lost=functools.partial(
            self._trainer_lost, info), timeout_s=self.timeout_s, peer_timeout_s=info.timeout_s,
            loop_threads=loop_threads, lanes=self._lane_bytes != 0, lane_bytes=self._lane_bytes, lend=True,
            board=self._board)
        with self._lock:
            current = self._sessions.get(info.trainer)
            if self._ended.is_set() or (current is not None and current.ticket > info.ticket) \
                    or self._refusal(info) is not None:  # a newer session, or its process departed meanwhile
                stale = channel
            else:
                stale = self._channels.get(info.trainer)
                self._channels[info.trainer], self._sessions[info.trainer] = channel, info
        if stale is not None:
            stale.close()

    def _on_request(self, channel: Channel, request_id: int, body: Any) -> None:
        """Server, on the channel's receiver: answer on the same channel. A call is run right here,
        in its trainer's order (the hop to a pool thread costs more than most calls), unless its
        service is not served yet: that one waits for it on the pool, holding up no other. A body
        that is no well-formed `Call` is refused (`Malformed`: the channel closes, naming the peer)."""
        if not isinstance(body, Call) or (body.caller is None) != (body.service == CONTROL):
            raise Malformed(f"refused a request from {channel.peer}: a {type(body).__name__} that is no call of a "
                            "trainer (a Call naming its caller, or a transport request naming none)")
        name = body.service
        if name == CONTROL:
            channel.reply(request_id, self._control(channel, body.method, body.args))
            return
        if name in self._services:
            self._answer(channel, request_id, body)
            return
        pool = self._pool
        if pool is None:
            return
        try:
            pool.submit(self._answer, channel, request_id, body)
        except RuntimeError:  # the pool is shut down: this server has ended
            pass

    def _answer(self, channel: Channel, request_id: int, call: Call) -> None:
        self._later.replies = later = []
        try:
            value = self._replies.run_once(call.caller, lambda: self._serve_call(call.service, call.method, call.args))
        finally:
            self._later.replies = None
        if isinstance(value, concurrent.futures.Future):  # answered later (a long poll)
            value.add_done_callback(functools.partial(self._answer_later, channel, request_id))
            for request, answer in later:
                channel.reply(request, answer)
        else:
            channel.reply(request_id, value, *later)

    def _answer_later(self, channel: Channel, request_id: int, done: concurrent.futures.Future) -> None:
        """Reply with the value of a service's Future: on the thread that completed it when that is
        the channel's own receiver (no hop: a push of this trainer answered its own watch; sent in
        one message with the push's own reply), else on the pool
        (the stepping thread serves another trainer, or the shard's expiry thread)."""
        try:
            value = done.result()
        except Exception as error:  # noqa: BLE001 (the service's failure goes back to the caller)
            value = ServiceFailure(error, traceback.format_exc())
        if channel.is_receiver_thread():
            later = getattr(self._later, "replies", None)
            if later is not None:  # with the reply of the call this thread runs
                later.append((request_id, value))
            else:
                channel.reply(request_id, value)
            return
        pool = self._pool
        try:
            if pool is not None:
                pool.submit(channel.reply, request_id, value)
        except RuntimeError:  # the pool is shut down: this server has ended
            pass

    def _serve_call(self, name: str, method: str, args: tuple[Any, ...]) -> Any:
        """A service call's return value, or its exception as a `ServiceFailure`."""
        try:
            refusal = self.roster.refusal(f"{self.roles.name} refuses {name}.{method}")
            if refusal is not None:
                raise refusal
            with self._services_changed:
                if not self._services_changed.wait_for(lambda: name in self._services, timeout=SERVE_WAIT_S):
                    raise LookupError(f"no service '{name}' after {SERVE_WAIT_S:g}s; served: {sorted(self._services)}")
                service = self._services[name]
            if method.startswith("_") or not callable(getattr(service, method, None)):
                raise AttributeError(f"service '{name}' ({type(service).__name__}) has no public method '{method}'")
            return getattr(service, method)(*args)
        except Exception as error:
            return ServiceFailure(error, traceback.format_exc())

    def _control(self, channel: Channel, method: str, args: tuple[Any, ...]) -> Any:
        """The transport's own requests: barrier arrivals and polls, abort notices; arguments of
        other types than `CONTROL_ARGS` are refused (`Malformed`, naming the peer)."""
        types = CONTROL_ARGS.get(method)
        if types is None or len(args) != len(types) or not all(
                isinstance(arg, kind) and not isinstance(arg, bool) for arg, kind in zip(args, types)) \
                or (method in ("arrive", "abort") and self._unknown_trainer(args[1 if method == "arrive" else 0])) \
                or (method == "abort" and not all(type(rank) is int for rank in args[3])):
            raise Malformed(f"refused a transport request from {channel.peer}: {method}{args!r:.120}")
        if method == "arrive":
            self.roster.arrive(*args)
            return None
        if method == "missing":
            return self.roster.missing(*args)
        if method == "met":
            return self.roster.met(*args)
        self.roster.abort(*args)
        return None

    def _unknown_trainer(self, trainer: int) -> bool:
        return not 0 <= trainer < len(self.roles.trainer_ranks)

    def _refusal(self, info: SessionInfo) -> str | None:
        """Server: why `info`'s session is refused (no such trainer, or its process departed), or
        None: the process is (again) a member (`Roster.join`), heard from now."""
        if self._unknown_trainer(info.trainer) or info.rank != self.roles.trainer_ranks[info.trainer]:
            return (f"{self.roles.name} has no trainer {info.trainer} of rank {info.rank} (trainer ranks "
                    f"{list(self.roles.trainer_ranks)})")
        refusal = self.roster.join(info.trainer, info.incarnation)
        if refusal is None:  # one dict store: called with and without `_lock` held
            self._admitted_at[info.trainer] = time.monotonic()
        return refusal

    def _lose(self, trainer: int, incarnation: int, message: str) -> None:
        """Server: trainer `trainer`'s process `incarnation` was lost or aborted (`message`). Under
        `on_trainer_lost` fail, the job's failure; under continue, a departure: its channel is
        closed (a stopped process that resumes must rejoin) and its replies forgotten. Calls it had
        in flight were applied when they arrived or never arrive; nothing waits for them."""
        if not self.roster.lose(trainer, incarnation, message):
            return
        logger.warning("shadowgba: %s: trainer %d (incarnation %d) left the job: %s", self.roles.name, trainer,
                       incarnation, message)
        with self._lock:
            session = self._sessions.get(trainer)
            channel = self._channels.pop(trainer, None) if session and session.incarnation == incarnation else None
        if channel is not None:
            channel.close()
        self._replies.forget(trainer)

    def _trainer_lost(self, info: SessionInfo, channel: Channel, error: ChannelLost) -> None:
        """Server: the channel of `info`'s session failed. Unless the trainer has left, or replaced the
        session (within `RECONNECT_GRACE_S` when its connection closed), it is lost: the verdict. A
        session closed for a refused message is only logged (module docstring)."""
        if error.refused:  # the peer's bytes were refused: maybe not even that trainer's (module docstring)
            logger.warning("shadowgba: %s closed session %d of trainer %d (rank %d): %s", self.roles.name, info.ticket,
                           info.trainer, info.rank, error)
            return
        if self._ended.is_set() or self.roster.has_arrived("stop", info.trainer) or self.roster.failure is not None:
            return
        deadline = time.monotonic() + (0.0 if error.timed_out else RECONNECT_GRACE_S)
        while True:
            latest = latest_ticket(self._store, self._generation, self.roles.server_index, self.incarnation,
                                   info.trainer, STOP_WAIT_S)
            if latest is not None and latest > info.ticket:
                return
            if time.monotonic() >= deadline or self._ended.wait(PING_INTERVAL_S / 4):
                break
        if self._ended.is_set():
            return
        why = "sync.timeout_s" if error.timed_out else "its connection closed and no new session came"
        self._lose(info.trainer, info.incarnation, lost_trainer(info.trainer, info.rank,
                                                                time.monotonic() - channel.last_heard, why,
                                                                self.roles.name, str(error)))

    def _await_trainers(self, lost_after_s: float) -> None:
        """Server: return once every trainer has arrived in `stop()` and closed its channel; raise
        `PeerLost` for one that aborted or was lost, or that nothing was heard from for `lost_after_s`."""
        while True:
            with self.roster.changed:
                self.roster.changed.wait_for(lambda: self.roster.missing("stop")[:2] == ([], None),
                                             timeout=PING_INTERVAL_S / 4)
            missing, failure, failed = self.roster.missing("stop")
            if failure is not None:
                time.sleep(ABORT_GRACE_S)  # let the surviving trainers' calls and polls read the failure
                raise PeerLost(failure, ranks=failed)
            if not missing:
                break
            now = time.monotonic()
            with self._lock:
                # a trainer whose session is still being set up was heard when it was admitted
                heard = {index: self._channels[index].last_heard if index in self._channels else
                         self._admitted_at.get(index, self._started_at) for index in missing}
            silent = [index for index in missing if now - heard[index] > lost_after_s]
            if silent:
                index = silent[0]
                why = "sync.timeout_s" if lost_after_s == self.timeout_s else "trainer_timeout_s"
                self._lose(index, self.roster.incarnations.get(index, 0),
                           lost_trainer(index, self.roles.trainer_ranks[index], now - heard[index], why,
                                        self.roles.name, "heard nothing while waiting in stop()"))
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:  # each trainer closes its channel once released (or it fails)
            channel.wait_closed(self.timeout_s)

    def _leave(self, lost_after_s: float) -> None:
        self._await_trainers(lost_after_s)

    def _stop_accepting(self) -> None:
        self._acceptor.stop()

    def _end_services(self, graceful: bool) -> None:
        self._pool.shutdown(wait=graceful, cancel_futures=not graceful)
        if self._board is not None:  # its memory lives on while copies of it are held
            self._board.close()
        with self._services_changed:
            self._services.clear()
        self._replies.clear()
