"""The parameter-server transport: who is a server in a torchrun job, and calls into their services.

    ps = Transport.start(num_servers=2)                  # every rank; job.transport under shadowgba.join
    if ps.roles.is_server:
        ps.serve("embedding", EmbeddingShard(...))
    else:
        rows = ps.call(0, "embedding", "lookup", {"t0": ids})   # or call_async -> Future
    ps.stop()                                            # every rank; servers wait here for the trainers

Roles: the last `num_servers` ranks are servers ("ps0", "ps1", ...), the others trainers
("trainer0", ...) with a process group of their own, `Roles.trainer_group`, so that trainer
collectives never involve a server, and a second one over the same ranks for the library's own
collectives (`sync_group()`), so that they never pair with TorchRec's or the user's. In the
elastic layout (`start(num_trainers=...)`, `sync.ps.num_trainers`) every process is started on
its own, names its rank in `SHADOWGBA_RANK`, and meets the others in the TCPStore server 0 hosts
at MASTER_ADDR:MASTER_PORT; there is no process group at all (`sync_group()` refuses, naming why),
so a trainer process can die and be started again while the others run.

Carriage: every trainer-server pair talks over a `Channel` (`shadowgba.ps.channel`: a 2-rank gloo
process group of its own, tensors sent as tensors, a pickled header for the rest), opened as a
session through the job's store (`shadowgba.ps.sessions`). Only maintained torch.distributed
primitives are used, and no RPC framework. All state is this object's: a process may
run one job after another, each with a transport of its own.

Rendezvous and listening:
- Sessions meet in the store that MASTER_ADDR:MASTER_PORT already names (`env://`): under torchrun
  (TORCHELASTIC_USE_AGENT_STORE) a client of the agent's store; without an agent, rank 0's
  default-group TCPStore is multi-tenant and shared. No second port is taken.
- Restarts (`torchrun --max-restarts`): the agent's store outlives an attempt, so every key of the
  transport (its sessions', and the default group's when `start()` creates it) lives under
  `attempt_{TORCHELASTIC_RESTART_COUNT}/` (`attempt_store()`): a restarted attempt never reads a
  dead attempt's addresses.
- gloo listens on ephemeral ports of the interface that reaches MASTER_ADDR (`start()` sets
  GLOO_SOCKET_IFNAME unless the user has: `shadowgba.network`).

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
  verdict in its `Roster` (`shadowgba.ps.membership`), `trainer i (rank r) stopped answering for T
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
  and the server's traceback as a note.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import datetime
import functools
import itertools
import logging
import os
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from shadowgba.errors import ConfigError, PeerLost, ServerRestarted, SetupError, SyncError
from shadowgba.metrics import LANE_PREFIX
from shadowgba.network import use_interface_to_master
from shadowgba.ps.board import Board
from shadowgba.ps.channel import PING_INTERVAL_S, Channel, ChannelLost, first_line
from shadowgba.ps.config import PSConfig
from shadowgba.ps.membership import Roster, lost_trainer, restart_count
from shadowgba.ps.sessions import (STOP_WAIT_S, Acceptor, SessionInfo, SessionRefused, await_key, current_incarnation,
                                   latest_ticket, request_session, server_incarnation, session_group,
                                   trainer_incarnation)

logger = logging.getLogger("shadowgba")

SERVE_WAIT_S = 30.0
"""How long a call for a service name that is not served (yet) waits for `serve()` on its server."""
TRAINER_TIMEOUT_S = 300.0
"""The longest a server in `stop()` waits for a trainer that has neither called `stop()` nor been
heard from before it gives up on it (`PeerLost`), unless the transport's `timeout_s` is shorter;
`stop(trainer_timeout_s=...)` overrides it."""
ABORT_NOTICE_S = 5.0
"""Longest `abort()` waits for each server to take its notice: a server that does not answer that fast
is gone or stuck, and the failed trainer must not wait for it."""
ABORT_GRACE_S = 2.0
"""How long a server whose trainer aborted (or whom it gave up on) keeps answering with the failure
before its `stop()` raises, so that the surviving trainers read the reason rather than a dead server."""
ALIVE_WITHIN_S = 5.0
"""How fast a server's acceptor must take a trainer's new session (after its channel fell silent or
failed) for the trainer's calls to be sent again; one that does not is named as the lost server."""
RECONNECT_GRACE_S = 3.0
"""How long a server waits, after a trainer's channel closed, for that trainer to open a new session
before it declares the trainer lost (a killed trainer opens none)."""
DEFAULT_RPC_TIMEOUT_S = 60.0
"""A trainer's channel silence limit when `start()` is given no `rpc_timeout_s` (capped at `timeout_s`)."""
SERVER_THREADS = 16
"""Threads a server sends the replies of answers that came later on (a watch that another trainer's
push or its timeout answered), and runs the calls for services not served yet on."""
CALLS_PER_INCARNATION = 1 << 40
"""A trainer process numbers its calls from its incarnation times this: no number of a departed
process of a trainer index can be mistaken, in a server's `_Replies`, for one of its successor's."""
ELASTIC_RANK = "SHADOWGBA_RANK"
"""Elastic layout: the environment variable that names this process's place in the job (trainers
0 .. num_trainers - 1, then the servers, as in one torchrun job)."""
NO_TRAINER_GROUP = ("the elastic layout (sync.ps.num_trainers > 0) has no process group over the trainers, which "
                    "this needs: there, only GBA mode or easgd_ps, with PS-hosted or no tables, runs (no sync mode or "
                    "switch to it, no checkpoint load in GBA mode, no TorchRec-sharded tables)")
"""Why a trainer collective is refused in the elastic layout."""
ELASTIC_NAMESPACE = "elastic"
"""The key prefix of an elastic job in its servers' store (one job per set of servers)."""
CONTROL = "shadowgba.transport"
"""The reserved service name of the transport's own requests (barriers, abort notices)."""


@dataclasses.dataclass(frozen=True)
class Roles:
    """This rank's place in a job of trainers and parameter servers."""

    rank: int
    """Global rank of this process."""
    world_size: int
    """Number of ranks, servers included."""
    num_servers: int
    """Number of parameter-server ranks (the last ones)."""
    server_ranks: tuple[int, ...]
    """Global ranks of the servers; server i is `server_ranks[i]`, named `ps{i}`."""
    trainer_ranks: tuple[int, ...]
    """Global ranks of the trainers; trainer i is `trainer_ranks[i]`, named `trainer{i}`."""
    trainer_index: int | None
    """Index of this rank among the trainers; None on servers."""
    server_index: int | None
    """Index of this rank among the servers; None on trainers."""
    trainer_group: dist.ProcessGroup | None = dataclasses.field(default=None, compare=False, repr=False)
    """Process group of the trainers (set by `start()` on trainers; None on servers and in the elastic
    layout): TorchRec's and the user's; the library's own collectives run on `sync_group()`."""
    elastic: bool = False
    """The elastic layout (`sync.ps.num_trainers` > 0): every process started on its own, trainers
    come and go, and there is no process group over the trainers (module docstring)."""

    @classmethod
    def assign(cls, rank: int, world_size: int, num_servers: int) -> "Roles":
        """The roles of `rank`, without any group; refuses a server count that leaves no trainer."""
        if isinstance(num_servers, bool) or not isinstance(num_servers, int) or not 0 <= num_servers < world_size:
            raise ConfigError(
                f"num_servers must be an integer in [0, world_size) so that at least one trainer remains; "
                f"got {num_servers!r} with world_size {world_size}"
            )
        first_server = world_size - num_servers
        is_server = rank >= first_server
        return cls(
            rank=rank,
            world_size=world_size,
            num_servers=num_servers,
            server_ranks=tuple(range(first_server, world_size)),
            trainer_ranks=tuple(range(first_server)),
            trainer_index=None if is_server else rank,
            server_index=rank - first_server if is_server else None,
        )

    @property
    def is_server(self) -> bool:
        """Whether this rank is a parameter server."""
        return self.server_index is not None

    @property
    def name(self) -> str:
        """This rank's name in messages: `ps{i}` or `trainer{i}`."""
        return server_name(self.server_index) if self.is_server else f"trainer{self.trainer_index}"


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

    def run_once(self, caller: tuple[int, int, tuple[int, ...]], work: Callable[[], Any]) -> Any:
        """`work()` for call `caller` = (trainer index, call number, numbers that trainer has settled
        since its last call here), or the reply of the run of that number that came first."""
        trainer, number, settled = caller
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


@dataclasses.dataclass
class _Failure:
    """A service's exception on its way back to the caller."""

    error: Exception
    traceback: str


Caller = tuple[int, int, tuple[int, ...]]
"""(trainer index, call number, numbers that trainer settled since its last call to this server)."""


class Transport:
    """One rank's part in a job of trainers and parameter servers (see the module docstring)."""

    def __init__(self, roles: Roles, store: dist.Store, namespace: str, generation: int, timeout_s: float,
                 rpc_timeout_s: float, owns_default_group: bool, sync_group: dist.ProcessGroup | None,
                 on_trainer_lost: str, incarnation: int = 0, server_restart_s: float = 0.0,
                 lane_bytes: int | None = None) -> None:
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
        self.server_restart_s = server_restart_s
        """Trainer: how long a lost server may take to come back as a new process before the calls to
        it fail (`sync.ps.server_restart_s`; 0: it is lost once it takes no session in `ALIVE_WITHIN_S`)."""
        self._owns_default_group = owns_default_group
        self._sync_group = sync_group
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._channels: dict[int, Channel] = {}
        """Trainer: per server index, the current channel; server: per trainer index."""
        self._sessions: dict[int, SessionInfo] = {}
        """Server: per trainer index, its current session."""
        self._pulse = threading.Thread(target=self._beat, name="shadowgba-pulse", daemon=True)
        # server side
        self._services: dict[str, object] = {}
        self._services_changed = threading.Condition()
        self._replies = _Replies()
        self._later = threading.local()
        """Server: per receiver thread, the answers that came later which a call it is running
        completed (`_answer_later`), sent in one message with that call's own reply."""
        self.roster = Roster(len(roles.trainer_ranks), on_trainer_lost)
        """Server: the trainers' arrivals and the first failure it knows of (`shadowgba.ps.membership`)."""
        self._started_at = time.monotonic()
        self._admitted_at: dict[int, float] = {}
        """Server: per trainer index, when its newest session was admitted (a rejoining process has
        no channel until the session's group is built)."""
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._acceptor: Acceptor | None = None
        self._board: Board | None = None
        """Server: where `shared_copy` writes the tensors its services send to every trainer
        (`shadowgba.ps.board`, as large as a lane); None where shared memory is unavailable."""
        # trainer side
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

    # ------------------------------------------------------------------------------------ joining
    @classmethod
    def start(cls, num_servers: int, backend: str = "gloo", timeout_s: float | None = None,
              rpc_timeout_s: float | None = None, on_trainer_lost: str = PSConfig.on_trainer_lost,
              num_trainers: int = 0, server_restart_s: float = 0.0, lane_bytes: int | None = None) -> "Transport":
        """Join the job as trainer or server.

        One torchrun job (`num_trainers` 0; collective: every rank calls it, in the same order): reads
        torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; initialises the default process
        group (with `backend`) unless it exists, and creates the trainer group (its collectives time
        out after `timeout_s`; None: torch's default). The elastic layout (`num_trainers` > 0: every
        process on its own): reads `SHADOWGBA_RANK` and MASTER_ADDR:MASTER_PORT, where server 0 hosts
        the job's store; no process group is created. Either way every trainer opens a channel to
        every server (replaced after `rpc_timeout_s` of silence; None: `DEFAULT_RPC_TIMEOUT_S`,
        capped at `timeout_s`), and a server that loses a trainer acts on `on_trainer_lost`
        (`sync.ps.on_trainer_lost`). A trainer whose server stops answering waits up to
        `server_restart_s` for a new process of it (`sync.ps.server_restart_s`; elastic layout).
        Each same-host channel's lanes hold `lane_bytes` (`sync.ps.lane_mb`; None: `LANE_BYTES`).
        """
        use_interface_to_master()
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        timeout_s = timeout.total_seconds() if timeout is not None else dist.default_pg_timeout.total_seconds()
        if num_trainers:
            roles, store, namespace = elastic_roles(num_trainers, num_servers, timeout_s)
            generation, owns_default_group, sync_group = 0, False, None
        else:
            roles, store, generation, owns_default_group, sync_group = _torchrun_roles(num_servers, backend, timeout)
            namespace = attempt_namespace()
        rpc_timeout_s = min(DEFAULT_RPC_TIMEOUT_S if rpc_timeout_s is None else rpc_timeout_s, timeout_s)
        incarnation = (server_incarnation(store, generation, roles.server_index) if roles.is_server
                       else trainer_incarnation(store, generation, roles.trainer_index))
        transport = cls(roles, store, namespace, generation, timeout_s, rpc_timeout_s, owns_default_group,
                        sync_group, on_trainer_lost, incarnation, server_restart_s, lane_bytes)
        if roles.is_server:
            transport._board = Board.create(lane_bytes)
            transport._pool = concurrent.futures.ThreadPoolExecutor(SERVER_THREADS, f"shadowgba-{roles.name}")
            transport._acceptor = Acceptor(store, generation, roles.server_index, incarnation, transport._accept,
                                           transport._refusal)
        else:
            for server in range(num_servers):
                transport._channels[server], transport._server_incarnations[server] = transport._open(server, timeout_s)
        transport._pulse.start()
        atexit.register(transport._abort_at_exit)
        return transport

    @property
    def store(self) -> dist.Store:
        """The job's store, under this transport's namespace (the elastic layout's notice board)."""
        return self._store

    def sync_group(self) -> dist.ProcessGroup:
        """The library's own process group over the trainers, apart from `Roles.trainer_group` (TorchRec's
        and the user's), so that the library's collectives never pair with theirs. Held here only, and
        destroyed by `stop()` and `abort()`: a caller that does not keep it lets `abort()` free it, which
        makes a peer's pending collective on it fail at once."""
        if self.roles.elastic and not self.roles.is_server:
            raise SetupError(NO_TRAINER_GROUP)
        if self._sync_group is None:
            raise RuntimeError("sync_group() is the trainers' group; this rank is a server"
                               if self.roles.is_server else "the PS transport has ended")
        return self._sync_group

    # ------------------------------------------------------------------------------------ serving
    def serve(self, name: str, service: object) -> None:
        """Make `service`'s public methods callable by the trainers as `name` (server ranks only)."""
        if not self.roles.is_server:
            raise RuntimeError(f"serve() runs on server ranks; rank {self.roles.rank} is {self.roles.name}")
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
            loop_threads=loop_threads, lane_bytes=self._lane_bytes, lend=True, board=self._board)
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
        service is not served yet: that one waits for it on the pool, holding up no other."""
        _, name, _, _ = body
        if name == CONTROL or name in self._services:
            self._answer(channel, request_id, body)
            return
        pool = self._pool
        if pool is None:
            return
        try:
            pool.submit(self._answer, channel, request_id, body)
        except RuntimeError:  # the pool is shut down: this server has ended
            pass

    def _answer(self, channel: Channel, request_id: int, body: Any) -> None:
        caller, name, method, args = body
        if name == CONTROL:
            channel.reply(request_id, self._control(method, *args))
            return
        self._later.replies = later = []
        try:
            value = self._replies.run_once(caller, lambda: self._serve_call(name, method, args))
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
            value = _Failure(error, traceback.format_exc())
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
        """A service call's return value, or its exception as a `_Failure`."""
        try:
            failure = self.roster.failure
            if failure is not None:
                raise PeerLost(f"{self.roles.name} refuses {name}.{method}: {failure}")
            with self._services_changed:
                if not self._services_changed.wait_for(lambda: name in self._services, timeout=SERVE_WAIT_S):
                    raise LookupError(f"no service '{name}' after {SERVE_WAIT_S:g}s; served: {sorted(self._services)}")
                service = self._services[name]
            if method.startswith("_") or not callable(getattr(service, method, None)):
                raise AttributeError(f"service '{name}' ({type(service).__name__}) has no public method '{method}'")
            return getattr(service, method)(*args)
        except Exception as error:
            return _Failure(error, traceback.format_exc())

    def _control(self, method: str, *args: Any) -> Any:
        """The transport's own requests: barrier arrivals and polls, abort notices."""
        if method == "arrive":
            self.roster.arrive(*args)
            return None
        if method == "missing":
            return self.roster.missing(*args)
        if method == "met":
            return self.roster.met(*args)
        if method == "abort":
            self.roster.abort(*args)
            return None
        raise ValueError(f"unknown transport request {method!r}")

    def _refusal(self, info: SessionInfo) -> str | None:
        """Server: why `info`'s session is refused (its trainer process departed), or None: the
        process is (again) a member (`Roster.join`), heard from now."""
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
        session (within `RECONNECT_GRACE_S` when its connection closed), it is lost: the verdict."""
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

    # ------------------------------------------------------------------------------------ calling
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
        reply = self._request(server_index, ((self.roles.trainer_index, number, settled), name, method, args),
                              f"failed {name}.{method}")
        result: torch.futures.Future = torch.futures.Future()

        def settle(done: torch.futures.Future) -> None:
            calls.settled(server_index, number)
            try:
                value = done.wait()
            except Exception as error:  # the transport failed: `_request` named the server
                result.set_exception(error)
                return
            if isinstance(value, _Failure):
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

    def lane_buffers(self) -> dict[str, torch.Tensor]:
        """The shared memory this rank's channels map (`Channel.lane_buffers`), by peer and direction."""
        with self._lock:
            channels = dict(self._channels)
        return {f"{LANE_PREFIX}{kind}_{peer}": buffer for peer, channel in channels.items()
                for kind, buffer in channel.lane_buffers().items()}

    def retried_calls(self) -> int:
        """How many times this trainer sent a call again on a new channel after its channel failed."""
        return self._calls.retried

    def _request(self, server: int, body: Any, what: str) -> torch.futures.Future:
        """`body` to server `server`, a Future of the reply, sent again on a new channel when its
        channel fails (`_Request`); a failure names the server."""
        if self.roles.is_server:
            raise RuntimeError(f"calls run on trainer ranks; {self.roles.name} is a server")
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
                          lane_bytes=self._lane_bytes)
        return channel, incarnation

    def _server_channel_lost(self, server: int, channel: Channel, _: ChannelLost) -> None:
        """Trainer: replace a failed channel at once, so a server waiting for this trainer's new
        session (`RECONNECT_GRACE_S`) sees it even when no call is in flight."""
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
                                f"{waited} ({first_line(error)})")
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

    # ------------------------------------------------------------------------------------ meeting
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
        if self.roles.is_server:
            raise RuntimeError(f"barrier() is for trainers; {self.roles.name} is a server")
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
                    missing, failure = self._control_call(server, "missing", key)
                except ServerRestarted:
                    self._arrive(server, key)
                    continue
                if failure is not None:
                    raise PeerLost(failure)
                if not missing:
                    waiting.remove(server)
                elif deadline is not None and time.monotonic() > deadline:
                    raise PeerLost(
                        f"{roles.name} gave up in barrier '{key}' after {timeout_s:g}s (sync.timeout_s): "
                        + ", ".join(f"trainer {i} (rank {roles.trainer_ranks[i]})" for i in missing)
                        + " neither arrived nor aborted (stuck, e.g. in a collective no peer will enter, or dead)"
                    )
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
        return self._request(server, (None, CONTROL, method, args), "went away in transport.stop() or barrier()").wait()

    # ------------------------------------------------------------------------------------ leaving
    def stop(self, trainer_timeout_s: float | None = None) -> None:
        """Leave the job (collective): waits for every rank and every outstanding call, then tears down.

        On a server, raises `PeerLost` once a trainer has aborted (`abort()`: with its reason), or has
        neither called `stop()` nor been heard from for the shorter of `timeout_s` and `trainer_timeout_s`
        (default `TRAINER_TIMEOUT_S`), or its connection closed for good; trainers waiting here raise it
        as well. Either way this rank's transport is torn down. The default process group is destroyed
        only if `start()` created it.
        """
        if self._ended.is_set():
            raise RuntimeError("the PS transport has ended")
        lost_after_s = min(self.timeout_s, TRAINER_TIMEOUT_S if trainer_timeout_s is None else trainer_timeout_s)
        try:
            if self.roles.is_server:
                self._await_trainers(lost_after_s)
            else:
                self._await_release("stop", timeout_s=None)
                with self._in_flight_changed:  # drain: the replies of calls still in flight
                    self._in_flight_changed.wait_for(lambda: self._in_flight == 0, timeout=self.timeout_s)
        except BaseException:
            self._tear_down(graceful=False)
            raise
        self._tear_down(graceful=True)

    def _await_trainers(self, lost_after_s: float) -> None:
        """Server: return once every trainer has arrived in `stop()` and closed its channel; raise
        `PeerLost` for one that aborted or was lost, or that nothing was heard from for `lost_after_s`."""
        while True:
            with self.roster.changed:
                self.roster.changed.wait_for(lambda: self.roster.missing("stop") == ([], None),
                                             timeout=PING_INTERVAL_S / 4)
            missing, failure = self.roster.missing("stop")
            if failure is not None:
                time.sleep(ABORT_GRACE_S)  # let the surviving trainers' calls and polls read the failure
                raise PeerLost(failure)
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

    def notify_abort(self, reason: str) -> None:
        """Tell every server that this trainer failed (`reason`: what failed), waiting for no peer: each
        notice `"trainer {i} (rank r) aborted: {reason}"` waits at most `ABORT_NOTICE_S`, and a server that
        is gone is skipped. The servers refuse every later call with it and end their `stop()` with it,
        so the other trainers end naming this one. Sent once; never raises; a no-op on a server or
        once the transport has ended. `abort()` follows."""
        if self.roles.is_server or self._notified or self._ended.is_set():
            return
        self._notified = True
        message = failure_message(self.roles, reason)
        with self._lock:
            channels = list(self._channels.values())
        notice = (None, CONTROL, "abort", (self.roles.trainer_index, self.incarnation, message))
        notices = [channel.request(notice) for channel in channels]
        deadline = time.monotonic() + ABORT_NOTICE_S
        for notice in notices:
            answered = threading.Event()
            notice.add_done_callback(lambda _, answered=answered: answered.set())
            answered.wait(max(0.0, deadline - time.monotonic()))

    def abort(self, reason: str) -> None:
        """Leave the job at once after a failure on this rank, waiting for no peer: `notify_abort(reason)`
        unless already done, then the channels are closed without draining and the groups the transport
        created are destroyed, which makes a peer's pending collective on them fail at once. Never
        raises; a no-op once the transport has ended."""
        if self._ended.is_set():
            return
        try:
            self.notify_abort(reason)
        finally:
            self._tear_down(graceful=False)

    def _abort_at_exit(self) -> None:
        """At interpreter exit with the transport still started: nothing stopped it, so abort it."""
        self.abort("its process exited without leaving the job (transport.stop() or abort() never ran)")

    def _tear_down(self, graceful: bool) -> None:
        """End this rank's part: no more sessions, channels closed (answered by the peers when
        `graceful`), calls refused, and the groups `start()` created destroyed."""
        atexit.unregister(self._abort_at_exit)
        self._ended.set()
        if self._acceptor is not None:
            self._acceptor.stop()
        self._pulse.join()
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            channel.close(wait_s=PING_INTERVAL_S if graceful else 0.0)
        if self._pool is not None:
            self._pool.shutdown(wait=graceful, cancel_futures=not graceful)
        if self._board is not None:  # its memory lives on while copies of it are held
            self._board.close()
        with self._services_changed:
            self._services.clear()
        self._replies.clear()
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


class _Request:
    """One `_request` in flight: its attempts and outcome. Its callbacks are bound methods, not
    closures that refer to one another, so a finished request is freed at once."""

    def __init__(self, transport: Transport, server: int, body: Any, what: str) -> None:
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


def server_name(server_index: int) -> str:
    """The name of server `server_index` in messages: `ps{i}`."""
    return f"ps{server_index}"


def failure_message(roles: Roles, reason: str) -> str:
    """How a failed trainer is named to its peers and servers: `trainer {i} (rank r) aborted: reason`."""
    return f"trainer {roles.trainer_index} (rank {roles.rank}) aborted: {reason}"


def _torchrun_roles(num_servers: int, backend: str, timeout: datetime.timedelta | None
                    ) -> tuple[Roles, dist.Store, int, bool, dist.ProcessGroup | None]:
    """One torchrun job: (this rank's roles with its trainer group, the attempt's store, the transport
    generation, whether the default group was created here, the library's sync group on trainers).
    Roles are checked before any group exists.

    The trainer groups are built only once every rank has arrived (`_await_every_rank`): building a
    group waits for its members for the group's own timeout (`sync.timeout_s`, seconds, meant for
    a dead peer), and ranks reach the start far apart when the default group already existed: a
    server arrives at once while trainers build and shard their model for minutes, and on a loaded
    host even adjacent lines can be seconds apart."""
    owns_default_group = not dist.is_initialized()
    if owns_default_group:
        try:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except KeyError as missing:
            raise SetupError(f"the PS transport needs {missing.args[0]} (as set by torchrun)") from None
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    roles = Roles.assign(rank, world_size, num_servers)
    store = attempt_store(rank, world_size, None if timeout is None else timeout.total_seconds())
    if owns_default_group:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    generation = store.add(f"ps/rank{rank}/starts", 1)  # equal on every rank: each starts every transport
    _await_every_rank(store, f"ps/gen{generation}/arrived", world_size, dist.default_pg_timeout.total_seconds())
    trainer_group = dist.new_group(list(roles.trainer_ranks), backend=backend, timeout=timeout)
    sync_group = dist.new_group(list(roles.trainer_ranks), backend=backend, timeout=timeout)
    if roles.is_server:
        return roles, store, generation, owns_default_group, None
    return (dataclasses.replace(roles, trainer_group=trainer_group), store, generation, owns_default_group,
            sync_group)


def _await_every_rank(store: dist.Store, key: str, world_size: int, within_s: float) -> None:
    """Count this rank in at `key` and wait until all `world_size` ranks are (the last one in marks
    it, `await_key` polls for the mark); raises naming how many came when some do not within `within_s`."""
    if store.add(key, 1) == world_size:
        store.set(f"{key}/all", "1")
    if not await_key(store, f"{key}/all", within_s):
        raise SyncError(f"only {store.add(key, 0)} of {world_size} ranks started the PS transport "
                           f"within {within_s:g} s")


def elastic_roles(num_trainers: int, num_servers: int, timeout_s: float) -> tuple[Roles, dist.Store, str]:
    """The elastic layout: (this process's roles, from `SHADOWGBA_RANK`, the job's store, its key
    namespace). Server 0 hosts the store at MASTER_ADDR:MASTER_PORT, unless torchrun's agent does
    (`store_hosted_elsewhere`: the servers are a torchrun job, whose restarted server processes find
    the same store); every other process is a client of it, and waits up to `timeout_s` for it to be
    up. No process group is created."""
    try:
        rank = int(os.environ[ELASTIC_RANK])
    except (KeyError, ValueError):
        raise SetupError(f"the elastic layout (sync.ps.num_trainers > 0) needs {ELASTIC_RANK}, this process's "
                           f"place in the job: 0 .. {num_trainers - 1} for a trainer, {num_trainers} .. "
                           f"{num_trainers + num_servers - 1} for a server") from None
    roles = dataclasses.replace(Roles.assign(rank, num_trainers + num_servers, num_servers), elastic=True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=roles.server_index == 0 and not store_hosted_elsewhere(), wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return roles, dist.PrefixStore(ELASTIC_NAMESPACE, store), ELASTIC_NAMESPACE


def store_hosted_elsewhere() -> bool:
    """Whether the store at MASTER_ADDR:MASTER_PORT is hosted outside the job's processes: torchrun's
    agent store (TORCHELASTIC_USE_AGENT_STORE), which outlives the processes it restarts."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def attempt_namespace() -> str:
    """The key prefix of this torchrun attempt, `attempt_{TORCHELASTIC_RESTART_COUNT}`."""
    return f"attempt_{restart_count()}"


def attempt_store(rank: int, world_size: int, timeout_s: float | None = None) -> dist.Store:
    """The `env://` store (MASTER_ADDR:MASTER_PORT; torchrun's agent store under torchrun) under a
    prefix of this attempt's own (`attempt_namespace`): keys written by an earlier attempt of a
    restarted torchrun job (dead workers' addresses) are not read."""
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, **timeout))
    return dist.PrefixStore(attempt_namespace(), store)


