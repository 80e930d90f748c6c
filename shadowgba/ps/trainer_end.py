"""A trainer's end of the transport (`shadowgba.ps.transport` states the invariants): a channel to
every server, numbered calls sent again on a new session when a channel fails (and run once however
often sent), a server that restarted told apart, barriers through server 0, and the notice that this
trainer failed."""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import threading
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from shadowgba.errors import PeerLost, ServerRestarted, SetupError, SyncError
from shadowgba.ps.channel import PING_INTERVAL_S, Channel, ChannelLost, first_line
from shadowgba.job.roles import NO_TRAINER_GROUP, Roles, server_name
from shadowgba.ps.sessions import SessionRefused, current_incarnation, request_session, session_group
from shadowgba.ps.transport import CONTROL, Call, Caller, ServiceFailure, Transport

logger = logging.getLogger("shadowgba")

ABORT_NOTICE_S = 5.0
"""Longest `abort()` waits for each server to take its notice: a server that does not answer that fast
is gone or stuck, and the failed trainer must not wait for it."""
ALIVE_WITHIN_S = 5.0
"""How fast a server's acceptor must take a trainer's new session (after its channel fell silent or
failed) for the trainer's calls to be sent again; one that does not is named as the lost server."""
CALLS_PER_INCARNATION = 1 << 40
"""A trainer process numbers its calls from its incarnation times this: no number of a departed
process of a trainer index can be mistaken, in a server's `_Replies`, for one of its successor's."""


class _Calls:
    """A trainer's calls to the servers, numbered: a server runs each number once (`_Replies`), and
    forgets its reply once told that this trainer has settled the call (no retry can follow)."""

    def __init__(self, first: int = 0) -> None:
        self._numbers = itertools.count(first)
        self._unreported: dict[int, list[int]] = collections.defaultdict(list)
        self._lock = threading.Lock()
        self.retried = 0
        """How many attempts were sent again after a timeout (`retried_calls`)."""

    def count_retry(self) -> None:
        with self._lock:
            self.retried += 1

    def begin(self, server: int) -> tuple[int, tuple[int, ...]]:
        """A new call's number, and the calls to `server` settled since the last call to it told it."""
        with self._lock:
            settled = tuple(self._unreported.pop(server, ()))
            return next(self._numbers), settled

    def settled(self, server: int, number: int) -> None:
        """Call `number` to `server` has its outcome: the next call to that server tells it so."""
        with self._lock:
            self._unreported[server].append(number)


class TrainerTransport(Transport):
    """A trainer rank's transport: calls the servers' services."""

    def __init__(self, roles: Roles, store: dist.Store, namespace: str, generation: int, timeout_s: float,
                 rpc_timeout_s: float, owns_default_group: bool, sync_group: dist.ProcessGroup | None,
                 incarnation: int, lane_bytes: int | None, server_restart_s: float) -> None:
        """A trainer's end, with a session opened to every server (each taking it within `timeout_s`)."""
        super().__init__(roles, store, namespace, generation, timeout_s, rpc_timeout_s, owns_default_group,
                         sync_group, incarnation, lane_bytes)
        self.server_restart_s = server_restart_s
        """Trainer: how long a lost server may take to come back as a new process before the calls to
        it fail (`sync.ps.server_restart_s`; 0: it is lost once it takes no session in `ALIVE_WITHIN_S`)."""
        self._calls = _Calls(incarnation * CALLS_PER_INCARNATION)
        self._barriers: dict[str, int] = {}
        self._notified = False
        self._in_flight = 0
        self._in_flight_changed = threading.Condition()
        self._replacing: dict[int, threading.Lock] = collections.defaultdict(threading.Lock)
        self._refused: dict[int, tuple[Channel, PeerLost, float]] = {}
        """Trainer: per server, the last failed replacement of a channel (reused for `ALIVE_WITHIN_S`)."""
        self._server_incarnations: dict[int, int] = {}
        """Trainer: per server, the incarnation its current channel talks to."""
        self.server_restarts = 0
        """Trainer: how often a server came back as a new process (restored from its checkpoint)."""
        for server in range(roles.num_servers):
            self._channels[server], self._server_incarnations[server] = self._open(server, timeout_s)
        self._begin()

    def sync_group(self) -> dist.ProcessGroup:
        """The library's own process group over the trainers, apart from `Roles.trainer_group` (TorchRec's
        and the user's), so that the library's collectives never pair with theirs. Held here only, and
        destroyed by `stop()` and `abort()`: a caller that does not keep it lets `abort()` free it, which
        makes a peer's pending collective on it fail at once."""
        if self.roles.elastic:
            raise SetupError(NO_TRAINER_GROUP)
        if self._sync_group is None:
            raise SyncError("the PS transport has ended (job.close() or an abort ended it)")
        return self._sync_group

    def call_async(self, server_index: int, name: str, method: str, *args: Any) -> torch.futures.Future:
        """Run `service.method(*args)` of service `name` on server `server_index`; a Future of the result.

        `wait()` returns the result or raises the service's exception: same type, same message, the
        server's traceback attached as a note. A transport failure (the server is dead, stopped or
        unreachable, and takes no new session within `ALIVE_WITHIN_S`) raises `PeerLost` naming the
        server and its rank; a call whose channel failed while its server still takes sessions is
        sent again, and run once however often it is sent.
        """
        num_servers = self.roles.num_servers
        if not 0 <= server_index < num_servers:
            raise ValueError(f"server_index must be in [0, {num_servers}), got {server_index}")
        calls = self._calls
        number, settled = calls.begin(server_index)
        reply = self._request(server_index, Call(Caller(self.roles.trainer_index, number, settled), name, method, args),
                              f"failed {name}.{method}")
        result: torch.futures.Future = torch.futures.Future()

        def settle(done: torch.futures.Future) -> None:
            calls.settled(server_index, number)
            try:
                value = done.wait()
            except Exception as error:  # the transport failed: `_request` named the server
                result.set_exception(error)
                return
            if isinstance(value, ServiceFailure):
                value.error.add_note(f"raised by service '{name}' on {server_name(server_index)}:\n{value.traceback}")
                result.set_exception(value.error)
            else:
                result.set_result(value)

        reply.add_done_callback(settle)
        return result

    def call(self, server_index: int, name: str, method: str, *args: Any) -> Any:
        """Blocking `call_async`: the result, or the service's exception raised here."""
        return self.call_async(server_index, name, method, *args).wait()

    def call_each(self, name: str, method: str, args_by_server: Sequence[tuple[Any, ...]],
                  first_server: int = 0) -> list[Any]:
        """`method(*args_by_server[i])` of service `name` on server `first_server + i`, all in flight at
        once; the results in server order (or the first failure raised here)."""
        return torch.futures.wait_all([
            self.call_async(first_server + index, name, method, *args) for index, args in enumerate(args_by_server)
        ])

    def retried_calls(self) -> int:
        """How many times this trainer sent a call again on a new channel after its channel failed."""
        return self._calls.retried

    def _request(self, server: int, body: Call, what: str) -> torch.futures.Future:
        """`body` to server `server`, a Future of the reply, sent again on a new channel when its
        channel fails (`_Request`); a failure names the server."""
        with self._in_flight_changed:
            self._in_flight += 1
        request = _Request(self, server, body, what)
        request.result.add_done_callback(self._settled)
        request.send()
        return request.result

    def _settled(self, _: torch.futures.Future) -> None:
        with self._in_flight_changed:
            self._in_flight -= 1
            self._in_flight_changed.notify_all()

    def _open(self, server: int, accept_within_s: float, newer_than: int = 0) -> tuple[Channel, int]:
        """Trainer: a new session with the current incarnation of server `server` (one newer than
        `newer_than`), and that incarnation (`TimeoutError` if none takes a session in time)."""
        incarnation = current_incarnation(self._store, self._generation, server, accept_within_s, newer_than)
        if incarnation is None:
            raise TimeoutError(f"no process of {server_name(server)} newer than incarnation {newer_than} "
                               f"accepted sessions within {accept_within_s:g} s")
        info = request_session(self._store, self._generation, server, incarnation, self.roles.trainer_index,
                               self.roles.rank, self.rpc_timeout_s, accept_within_s, self.incarnation)
        group, loop_threads = session_group(self._namespace, self._generation, server, incarnation, info.ticket, 1,
                                            self.rpc_timeout_s)
        channel = Channel(group, 1, server_name(server), on_lost=functools.partial(self._server_channel_lost, server),
                          timeout_s=self.rpc_timeout_s, peer_timeout_s=self.timeout_s, loop_threads=loop_threads,
                          lanes=self._lane_bytes != 0, lane_bytes=self._lane_bytes)
        return channel, incarnation

    def _server_channel_lost(self, server: int, channel: Channel, error: ChannelLost) -> None:
        """Trainer: replace a failed channel at once, so a server waiting for this trainer's new
        session (`RECONNECT_GRACE_S`) sees it even when no call is in flight (logged when it failed
        on a message this side refused)."""
        if error.refused:
            logger.warning("shadowgba: %s: %s", self.roles.name, error)
        try:
            self._channel(server, failed=channel)
        except PeerLost:  # the next call on it raises this (or opens a session itself)
            pass

    def _channel(self, server: int, failed: Channel | None = None) -> Channel:
        """Trainer: the live channel to `server`, replacing `failed` (when it is still the current one) by
        a new session. `PeerLost` naming the server when the server takes no session within `ALIVE_WITHIN_S`."""
        with self._replacing[server]:
            current = self._channels.get(server)
            if current is None or self._ended.is_set():
                raise PeerLost(f"{self.roles.name}'s PS transport has ended")
            if failed is None or current is not failed:
                return current
            refused = self._refused.get(server)
            if refused is not None and refused[0] is failed and time.monotonic() - refused[2] < ALIVE_WITHIN_S:
                raise refused[1]
            known = self._server_incarnations[server]
            try:
                try:
                    replacement, incarnation = self._open(server, ALIVE_WITHIN_S)
                except (TimeoutError, RuntimeError) as error:
                    if not self.server_restart_s:
                        raise
                    logger.warning("shadowgba: %s: %s takes no session (%s); waiting up to %g s (sync.ps."
                                   "server_restart_s) for a new process of it", self.roles.name, server_name(server),
                                   first_line(error), self.server_restart_s)
                    replacement, incarnation = self._open(server, self.server_restart_s, newer_than=known)
            except SessionRefused as refused:  # this process left the job: every call of it fails with why
                lost = PeerLost(f"shadowgba: {server_name(server)} refused {self.roles.name}: {refused}")
                self._refused[server] = (failed, lost, time.monotonic())
                raise lost from refused
            except (TimeoutError, RuntimeError) as error:
                waited = f" nor came back within {self.server_restart_s:g} s (sync.ps.server_restart_s)" \
                    if self.server_restart_s else " either"
                lost = PeerLost(f"shadowgba: {server_name(server)} accepted no new session within {ALIVE_WITHIN_S:g} s"
                                f"{waited} ({first_line(error)})", ranks=[self.roles.server_ranks[server]])
                self._refused[server] = (failed, lost, time.monotonic())
                raise lost from error
            with self._lock:
                self._channels[server] = replacement
                if incarnation != known:  # calls begun before this fail (`_Request.send`): its state is older
                    self._server_incarnations[server] = incarnation
                    self.server_restarts += 1
                    logger.warning("shadowgba: %s: %s came back as a new process (incarnation %d)", self.roles.name,
                                   server_name(server), incarnation)
        failed.close()
        return replacement

    def barrier(self, name: str, timeout_s: float | None = None) -> None:
        """Wait until every trainer has called `barrier(name)` (as often as this one), with no collective.

        Raises `PeerLost` with its reason as soon as a trainer has aborted, naming the trainers still
        missing once `timeout_s` has passed (None: the transport's `timeout_s`; a peer that late is
        stuck, or too slow to be told from stuck), and naming server 0 if it is gone. Trainers only;
        server 0 keeps the count."""
        self._barrier(name, timeout_s)

    def meet(self, name: str, timeout_s: float | None = None) -> tuple[int, ...]:
        """`barrier(name)`, then the trainers (indices) that met there: every member, departed ones
        not waited for, the same on every trainer it released (server 0's `Roster.met`)."""
        key = self._barrier(name, timeout_s)
        met = self._control_call(0, "met", key)
        if met is None:  # a new process of server 0 forgot the count between the release and this question
            raise PeerLost(f"{self.roles.name}: server 0 restarted after barrier '{key}' released it, "
                           "and no longer knows who met there")
        return met

    def _barrier(self, name: str, timeout_s: float | None) -> str:
        """`barrier(name)`; returns the key of this use of it at server 0."""
        use = self._barriers[name] = self._barriers.get(name, 0) + 1
        key = f"{name}#{use}"
        self._await_release(key, self.timeout_s if timeout_s is None else timeout_s, servers=1)
        return key

    def _await_release(self, key: str, timeout_s: float | None, servers: int | None = None) -> None:
        """Trainer: announce this trainer under `key` to the first `servers` servers (default: all), then
        poll them until every trainer has arrived there; `PeerLost` on a failure, or after `timeout_s`
        (None: no deadline, the servers' own verdicts decide). A server that restarted meanwhile
        forgot the arrivals: this trainer announces itself to it again."""
        roles = self.roles
        servers = roles.num_servers if servers is None else servers
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for server in range(servers):
            self._arrive(server, key)
        waiting = list(range(servers))
        pause = 0.005
        while waiting:
            for server in list(waiting):
                try:
                    missing, failure, failed = self._control_call(server, "missing", key)
                except ServerRestarted:
                    self._arrive(server, key)
                    continue
                if failure is not None:
                    raise PeerLost(failure, ranks=failed)
                if not missing:
                    waiting.remove(server)
                elif deadline is not None and time.monotonic() > deadline:
                    raise PeerLost(
                        f"{roles.name} gave up in barrier '{key}' after {timeout_s:g}s (sync.timeout_s): "
                        + ", ".join(roles.describe(roles.trainer_ranks[i]) for i in missing)
                        + " neither arrived nor aborted (stuck, e.g. in a collective no peer will enter, or dead)",
                        ranks=[roles.trainer_ranks[i] for i in missing])
            time.sleep(pause)
            pause = min(2 * pause, PING_INTERVAL_S / 4)

    def _arrive(self, server: int, key: str) -> None:
        """Trainer: announce this trainer under `key` to `server` (again, to a process that restarted)."""
        try:
            self._control_call(server, "arrive", key, self.roles.trainer_index)
        except ServerRestarted:
            self._control_call(server, "arrive", key, self.roles.trainer_index)

    def _control_call(self, server: int, method: str, *args: Any) -> Any:
        """A transport request (idempotent) to `server`, from a trainer in `stop()` or `barrier()`."""
        return self._request(server, Call(None, CONTROL, method, args), "went away in transport.stop() or barrier()").wait()

    def notify_abort(self, message: str, ranks: Sequence[int] | None = None) -> None:
        """Tell every server that this trainer failed (`message`: the job's verdict, `Job.announce_failure`,
        or `failure_message`), naming `ranks` as its cause (None: this trainer's own failure; empty: a cause
        not known), waiting for no peer: each notice waits at most `ABORT_NOTICE_S`, and a server that
        is gone is skipped. The servers refuse every later call with it and end their `stop()` with it,
        naming those ranks, so the other trainers end naming them (`Roster.refusal`). Sent once; never
        raises; a no-op once the transport has ended. `abort()` follows."""
        if self._notified or self._ended.is_set():
            return
        self._notified = True
        with self._lock:
            channels = list(self._channels.values())
        culprits = [self.roles.rank] if ranks is None else list(ranks)
        notice = Call(None, CONTROL, "abort", (self.roles.trainer_index, self.incarnation, message, culprits))
        notices = [channel.request(notice) for channel in channels]
        deadline = time.monotonic() + ABORT_NOTICE_S
        for notice in notices:
            answered = threading.Event()
            notice.add_done_callback(lambda _, answered=answered: answered.set())
            answered.wait(max(0.0, deadline - time.monotonic()))

    def _leave(self, lost_after_s: float) -> None:
        self._await_release("stop", timeout_s=None)
        with self._in_flight_changed:  # drain: the replies of calls still in flight
            self._in_flight_changed.wait_for(lambda: self._in_flight == 0, timeout=self.timeout_s)


class _Request:
    """One `_request` in flight: its attempts and outcome. Its callbacks are bound methods, not
    closures that refer to one another, so a finished request is freed at once."""

    def __init__(self, transport: Transport, server: int, body: Call, what: str) -> None:
        self.transport, self.server, self.body, self.what = transport, server, body, what
        self.incarnation = transport._server_incarnations.get(server)
        """The server process the call is meant for: a new one holds older state (restored), so the
        call is not sent to it again but fails with `ServerRestarted`."""
        self.began = time.monotonic()
        self.late_attempts = 0
        self.result: torch.futures.Future = torch.futures.Future()

    def send(self, failed: Channel | None = None, failure: ChannelLost | None = None) -> None:
        try:
            channel = self.transport._channel(self.server, failed)
        except PeerLost as refused:  # the server takes no new session: the channel's failure names it,
            if failure is None or isinstance(refused.__cause__, SessionRefused):  # unless it refused this process
                self._fail(refused)
            else:
                self._fail(failure, str(refused))
            return
        if self.transport._server_incarnations.get(self.server) != self.incarnation:
            self._fail_restarted()
            return
        if failed is not None:
            self.transport._calls.count_retry()
        channel.request(self.body).add_done_callback(functools.partial(self._settle, channel=channel))

    def _settle(self, done: torch.futures.Future, channel: Channel) -> None:
        try:
            self.result.set_result(done.wait())
            return
        except ChannelLost as error:
            failure = error
        except Exception as error:  # noqa: BLE001 (anything else is this request's own failure)
            self._fail(error)
            return
        if time.monotonic() - self.began >= self.transport.timeout_s:
            self.late_attempts += 1
            if self.late_attempts > 1:
                self._fail(failure)
                return
        if self.transport._ended.is_set():
            self._fail(failure)
            return
        self.send(channel, failure)

    def _fail_restarted(self) -> None:
        roles = self.transport.roles
        self.result.set_exception(ServerRestarted(
            f"server {self.server} ({server_name(self.server)}, rank {roles.server_ranks[self.server]}) restarted "
            f"(incarnation {self.transport._server_incarnations.get(self.server)}, its state restored from its "
            f"checkpoint) with a call of {roles.name} in flight ({self.what.removeprefix('failed ')}): not sent "
            "again, the new process holds older state"))

    def _fail(self, error: BaseException, note: str | None = None) -> None:
        roles = self.transport.roles
        lost = PeerLost(f"server {self.server} ({server_name(self.server)}, rank {roles.server_ranks[self.server]}) "
                        f"{self.what} for {roles.name}: {first_line(error)}")
        lost.__cause__ = error
        if note is not None:
            lost.add_note(note)
        self.result.set_exception(lost)
