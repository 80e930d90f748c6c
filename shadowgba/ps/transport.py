"""The parameter-server transport: who is a server in a torchrun job, and calls into their services.

    ps = start_transport(num_servers=2)                  # every rank; job.transport under shadowgba.join
    if ps.roles.is_server:                               # a ServerTransport
        ps.serve("embedding", EmbeddingShard(...))
    else:                                                # a TrainerTransport
        rows = ps.call(0, "embedding", "lookup", {"t0": ids})   # or call_async -> Future
    ps.stop()                                            # every rank; servers wait here for the trainers

Two ends of one `Transport` (this module: what both hold, and leaving): a server's
(`shadowgba.ps.server_end.ServerTransport`: sessions taken, calls answered, trainers lost) and a
trainer's (`shadowgba.ps.trainer_end.TrainerTransport`: calls sent and retried, barriers, abort
notices); `shadowgba.ps.start.start_transport` makes this rank's.

Roles: the last `num_servers` ranks are servers ("ps0", "ps1", ...), the others trainers
("trainer0", ...) with a process group of their own, `Roles.trainer_group`, so that trainer
collectives never involve a server, and a second one over the same ranks for the library's own
collectives (`sync_group()`), so that they never pair with TorchRec's or the user's. In the
elastic layout (`start(num_trainers=...)`, `sync.ps.num_trainers`) every process is started on
its own, names its rank in `SHADOWGBA_RANK`, and meets the others in the TCPStore server 0 hosts
at MASTER_ADDR:MASTER_PORT; there is no process group at all (`sync_group()` refuses, naming why),
so a trainer process can die and be started again while the others run.

Carriage: every trainer-server pair talks over a `Channel` (`shadowgba.ps.channel`: a 2-rank gloo
process group of its own, tensors sent as tensors, the rest as JSON by `shadowgba.ps.codec`, never
pickled), opened as a session through the job's store (`shadowgba.ps.sessions`). A call is a
`Call` (who calls, which service and method, the arguments); its answer the service's return
value or a `ServiceFailure`. Arguments and return values are plain data, CPU tensors, and the
dataclasses and enums registered with the codec (`codec.LIBRARY_TYPES`; a service of the user's
registers its own with `codec.register`): anything else is refused when it is sent. Only maintained torch.distributed
primitives are used, and no RPC framework. All state is this object's: a process may
run one job after another, each with a transport of its own.

Rendezvous (roles, the attempt's store, the elastic layout's store): `shadowgba.job.rendezvous`.

Invariants (why a call cannot deadlock, and why no survivor hangs):
- A call is one request and one reply. A service method must not issue collectives, and runs on
  the receiving channel's thread, in its trainer's order, waiting at most for a lock of its
  service (the hop to a pool thread would cost more than most calls). One that must wait on other
  calls (a long-poll `watch`) returns a `concurrent.futures.Future` instead of waiting, and the
  reply is sent when it completes: by the thread that completed it when that is the same
  channel's receiver (no hop; in one message with the reply of the call it runs), else by one of
  the server's `SERVER_THREADS` (a thread serving one trainer never spends its time on another's
  reply). So no cycle of waits can form. Services are called concurrently (one thread per
  trainer, plus the pool) and must be thread-safe.
- `start()` returns on trainers before the servers have called `serve()`; a call for a name that
  is not served yet waits up to `SERVE_WAIT_S` for it, then fails naming the served services.
- Liveness is the channels': both ends send a heartbeat every `PING_INTERVAL_S` when idle. A server
  whose channel to a trainer hears nothing for `timeout_s` (`sync.timeout_s`; a live trainer's
  channel threads beat even while it trains), or whose channel closed without a new session of
  that trainer within `RECONNECT_GRACE_S` (a killed process's sockets close; a stopped one's stay
  open, so a stall shorter than `timeout_s` is no failure), has lost that trainer: it records the
  verdict in its `Roster` (`shadowgba.job.roster`), `trainer i (rank r) stopped answering for T
  s (...); it probably died`. Under `on_trainer_lost` continue that trainer process departs:
  its channel is closed, its replies forgotten, its later sessions refused with the reason, and
  barriers and `stop()` stop counting it; a new process of that trainer (a higher incarnation)
  rejoins. Under fail the server refuses every later call, barrier and `stop()` with the verdict,
  so each survivor's next push, lookup or barrier ends naming it, within `timeout_s` of the loss.
  Call numbers start at incarnation x `CALLS_PER_INCARNATION`, so `_Replies` never mistakes a
  departed process's call for its successor's.
- A trainer's channel that hears nothing from its server for `rpc_timeout_s`, or fails, is
  replaced: the trainer opens a new session, which the server's acceptor must take within
  `ALIVE_WITHIN_S`. If it does not, every call in flight there raises `PeerLost` naming that server
  and its rank (`server i (psi, rank r) failed name.method for trainerj: ...`, noted "accepted no
  new session"); if it does, the calls are sent again on the new channel, as long as each began
  less than `timeout_s` ago, and once more after (its answer then is the server's verdict, e.g.
  that it lost this very trainer). So a stall of either side shorter than `sync.timeout_s` is no
  failure. Retries are safe: every call carries its trainer's call number, and a server runs each
  number once (`_Replies`): a retry of a call that ran, or is running, gets that run's reply. Each
  call also names the calls to that server its trainer has settled since its last one there (no
  retry of them can follow), and the server forgets their replies.
- `stop()` is a barrier over every rank that also drains outstanding calls: servers sit in it until
  every member trainer has called it too (a departed one is not waited for), or one is lost (a trainer silent for the shorter of `timeout_s`
  and `trainer_timeout_s`, default `TRAINER_TIMEOUT_S`, is lost there too). Every trainer
  announces itself to every server and polls them for the release (no call is held open while a
  slow trainer finishes), so a server's failure reaches them as a `PeerLost` rather than a hang;
  then it waits for its own calls to settle and closes its channels, and each server waits for
  every trainer's channel to close (or fail) before it tears down.
- `abort(reason)` is the way out of a failed trainer, and waits for no peer: it tells every server
  why (`notify_abort`: one message each, at most `ABORT_NOTICE_S`), then closes its channels without
  draining. From then on a server refuses every call with `PeerLost` carrying that reason, and its
  `stop()` ends with it at once, after `ABORT_GRACE_S` for the surviving trainers to read it: every
  rank ends naming the trainer that failed. A process that exits with the transport still started
  (the user's exception escaped before any `stop()` or `abort()`) aborts at exit.
- `barrier(name)` meets every trainer without any collective (the trainer group stays TorchRec's
  and the user's): each trainer announces itself to server 0 and polls it until all have. A
  trainer that aborted makes every waiting one raise `PeerLost` with its reason at once; one that
  neither arrives nor aborts within the transport's `timeout_s` (a peer that slow is stuck, e.g. in
  a collective nobody else will enter) makes them raise `PeerLost` naming it.
- An exception raised by a service is raised by the caller's `wait()` with its own type and message
  and the server's traceback as a note (one of a class outside builtins and shadowgba as a
  `RuntimeError` naming its class: `shadowgba.ps.codec`).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
from typing import Any, Sequence

import torch
import torch.distributed as dist

from shadowgba.errors import SyncError
from shadowgba.metrics import LANE_PREFIX
from shadowgba.ps.channel import PING_INTERVAL_S, Channel
from shadowgba.job.roles import Roles, failure_message

logger = logging.getLogger("shadowgba")

TRAINER_TIMEOUT_S = 300.0
"""The longest a server in `stop()` waits for a trainer that has neither called `stop()` nor been
heard from before it gives up on it (`PeerLost`), unless the transport's `timeout_s` is shorter;
`stop(trainer_timeout_s=...)` overrides it."""
DEFAULT_RPC_TIMEOUT_S = 60.0
"""A trainer's channel silence limit when `start()` is given no `rpc_timeout_s` (capped at `timeout_s`)."""
CONTROL = "shadowgba.transport"
"""The reserved service name of the transport's own requests (barriers, abort notices)."""


@dataclasses.dataclass(frozen=True)
class ServiceFailure:
    """A service's exception on its way back to the caller."""

    error: Exception
    traceback: str


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who makes a numbered call: a trainer, the call's number, and the numbers of the calls to
    this server it has settled since its last call here (their replies can be forgotten)."""

    trainer: int
    number: int
    settled: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Call:
    """One request of a trainer to a server: `service.method(*args)`, or (`service` `CONTROL`,
    no `caller`) one of the transport's own requests (barriers, abort notices)."""

    caller: Caller | None
    service: str
    method: str
    args: tuple[Any, ...]


class Transport:
    """One rank's part in a job of trainers and parameter servers: what both ends hold (roles, the
    store, the channels and their pulse) and how they leave (`stop`, `abort`); see the module docstring."""

    def __init__(self, roles: Roles, store: dist.Store, namespace: str, generation: int, timeout_s: float,
                 rpc_timeout_s: float, owns_default_group: bool, sync_group: dist.ProcessGroup | None,
                 incarnation: int, lane_bytes: int | None) -> None:
        self.roles = roles
        self._lane_bytes = lane_bytes
        """Size of each same-host lane of this rank's channels (`sync.ps.lane_mb`; None: `LANE_BYTES`)."""
        self.timeout_s = timeout_s
        """The trainer group's collective timeout, the deadline of `barrier()`, and how long a server
        waits on a silent trainer."""
        self.rpc_timeout_s = rpc_timeout_s
        """How long a trainer's channel may hear nothing from its server before it is replaced."""
        self._store, self._namespace, self._generation = store, namespace, generation
        self.incarnation = incarnation
        """Which process of its trainer index (`trainer_incarnation`) or server index
        (`server_incarnation`) this is."""
        self._owns_default_group = owns_default_group
        self._sync_group = sync_group
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._channels: dict[int, Channel] = {}
        """A trainer's: per server index, the current channel; a server's: per trainer index."""
        self._pulse = threading.Thread(target=self._beat, name="shadowgba-pulse", daemon=True)

    def _begin(self) -> None:
        """The pulse, and an abort at interpreter exit should nothing stop this transport."""
        self._pulse.start()
        atexit.register(self._abort_at_exit)

    @property
    def store(self) -> dist.Store:
        """The job's store, under this transport's namespace (the elastic layout's notice board)."""
        return self._store

    def lane_buffers(self) -> dict[str, torch.Tensor]:
        """The shared memory this rank's channels map (`Channel.lane_buffers`), by peer and direction."""
        with self._lock:
            channels = dict(self._channels)
        return {f"{LANE_PREFIX}{kind}_{peer}": buffer for peer, channel in channels.items()
                for kind, buffer in channel.lane_buffers().items()}

    def stop(self, trainer_timeout_s: float | None = None) -> None:
        """Leave the job (collective): waits for every rank and every outstanding call, then tears down.

        On a server, raises `PeerLost` once a trainer has aborted (`abort()`: with its reason), or has
        neither called `stop()` nor been heard from for the shorter of `timeout_s` and `trainer_timeout_s`
        (default `TRAINER_TIMEOUT_S`), or its connection closed for good; trainers waiting here raise it
        as well. Either way this rank's transport is torn down. The default process group is destroyed
        only if `start()` created it.
        """
        if self._ended.is_set():
            raise SyncError("the PS transport has ended (job.close() or an abort ended it)")
        lost_after_s = min(self.timeout_s, TRAINER_TIMEOUT_S if trainer_timeout_s is None else trainer_timeout_s)
        try:
            self._leave(lost_after_s)
        except BaseException:
            self._tear_down(graceful=False)
            raise
        self._tear_down(graceful=True)

    def abort(self, message: str) -> None:
        """Leave the job at once after a failure on this rank, waiting for no peer: `notify_abort(message)`
        unless already done, then the channels are closed without draining and the groups the transport
        created are destroyed, which makes a peer's pending collective on them fail at once. Never
        raises; a no-op once the transport has ended."""
        if self._ended.is_set():
            return
        try:
            self.notify_abort(message)
        finally:
            self._tear_down(graceful=False)

    def _abort_at_exit(self) -> None:
        """At interpreter exit with the transport still started: nothing stopped it, so abort it."""
        self.abort(failure_message(self.roles, "its process exited without leaving the job (transport.stop() or "
                                   "abort() never ran)"))

    def _tear_down(self, graceful: bool) -> None:
        """End this rank's part: no more sessions, channels closed (answered by the peers when
        `graceful`), calls refused, and the groups `start()` created destroyed."""
        atexit.unregister(self._abort_at_exit)
        self._ended.set()
        self._stop_accepting()
        self._pulse.join()
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            channel.close(wait_s=PING_INTERVAL_S if graceful else 0.0)
        self._end_services(graceful)
        sync_group, self._sync_group = self._sync_group, None
        if not dist.is_initialized():  # every group is gone already (the user destroyed them, at exit)
            return
        if self._owns_default_group:
            dist.destroy_process_group()
        else:
            for group in (self.roles.trainer_group, sync_group):
                if group is not None:
                    dist.destroy_process_group(group)

    def _beat(self) -> None:
        """The pulse thread: a heartbeat on every idle channel (`Channel.pulse`) until the tear-down."""
        while not self._ended.wait(PING_INTERVAL_S / 8):
            with self._lock:
                channels = list(self._channels.values())
            for channel in channels:
                channel.pulse()

    def _leave(self, lost_after_s: float) -> None:
        """`stop()`'s wait for the peers, this end's way (`lost_after_s`: a server's patience with a
        silent trainer)."""
        raise NotImplementedError

    def notify_abort(self, message: str, ranks: Sequence[int] | None = None) -> None:
        """Tell the servers this trainer failed (`TrainerTransport`), `message` naming `ranks` as the
        cause (None: this trainer's own failure); a server has no one to tell."""

    def _stop_accepting(self) -> None:
        """At the tear-down, before the channels close: a server takes no more sessions."""

    def _end_services(self, graceful: bool) -> None:
        """At the tear-down, after the channels closed: a server's services and threads end."""
