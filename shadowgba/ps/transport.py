"""The parameter-server transport: who is a server in a torchrun job, and calls into their services.

This is the one module that knows about `torch.distributed.rpc` (TensorPipe is in maintenance mode
upstream; replacing it touches this file only).

    roles = transport.start(num_servers=2)              # every rank
    if roles.is_server:
        transport.serve("embedding", EmbeddingShard(...))
    else:
        rows = transport.call(0, "embedding", "lookup", {"t0": ids})   # or call_async -> Future
    transport.stop()                                    # every rank; servers wait here for the trainers

Roles: the last `num_servers` ranks are servers (RPC names "ps0", "ps1", ...), the others trainers
("trainer0", ...) with a process group of their own, `Roles.trainer_group`, so that trainer
collectives never involve a server, and a second one over the same ranks for the library's own
collectives (`sync_group()`), so that they never pair with TorchRec's or the user's.

Rendezvous and listening (tested under torchrun and under a plain spawn harness):
- RPC rendezvous uses the store that MASTER_ADDR:MASTER_PORT already names (`env://`); no second
  port is taken. Under torchrun (TORCHELASTIC_USE_AGENT_STORE) that is a client of the agent's store.
  Without an agent, rank 0's default-group TCPStore is multi-tenant, so the RPC rendezvous in the
  same process shares its server instead of binding the port again. RPC keeps its keys under its own
  prefix, apart from the process groups' keys.
- Restarts (`torchrun --max-restarts`): the agent's store outlives an attempt, and RPC's own prefix
  (`rpc_prefix_0`, a per-process counter) is the same in every attempt, so a restarted attempt would
  read the dead one's worker names and TensorPipe/gloo addresses and fail or hang connecting to them.
  Every key of the transport's rendezvous (RPC's, and the default group's when `start()` creates it)
  therefore lives under `attempt_{TORCHELASTIC_RESTART_COUNT}/` (`attempt_store()`, the `shadowgba-
  attempt://` rendezvous).
- TensorPipe listens on ephemeral ports of one address: the interface named by TP_SOCKET_IFNAME,
  else whatever the host name resolves to (on many hosts a public address); gloo groups, including
  the one RPC creates for itself, do the same with GLOO_SOCKET_IFNAME. `start()` sets both, for the
  rest of the process and unless the user has, to the interface of the local address that routes
  to MASTER_ADDR: loopback on one machine, the interface facing the master across machines.

Invariants (why a call cannot deadlock):
- A call is one request and one reply. The service method runs on one of the server's RPC threads
  and must neither issue collectives nor wait on other calls, so no cycle of waits can form.
  Services are called concurrently from those threads and must be thread-safe.
- `start()` returns on trainers before the servers have called `serve()`; a call for a name that
  is not served yet waits up to `SERVE_WAIT_S` for it, then fails naming the served services.
- Every server watches every trainer from `start()` on (`_watch_trainers`, a thread): it pings the
  trainers that have not yet arrived in `stop()` every `PING_INTERVAL_S`. A trainer that has
  answered no ping for `timeout_s` (`sync.timeout_s`; a live trainer's RPC threads answer in
  milliseconds even while it trains), or whose connection was gone on `REFUSED_PINGS` pings in a
  row (a killed process's sockets close; a stopped one's stay open and its pings only time out, so
  a stall shorter than `timeout_s` is no failure), is lost: the server posts it like an abort
  notice, `trainer i (rank r) stopped answering for T s (...); it probably died`, and refuses every
  later call, barrier and `stop()` with it, so each survivor's next push, lookup or barrier ends
  naming it, within `timeout_s` of the loss instead of at the end of the job.
- `stop()` is a barrier over every rank that also drains outstanding calls: servers sit in it until
  every trainer has called it too, or the watch has lost one (`trainer_timeout_s`, default
  `TRAINER_TIMEOUT_S`, then caps the watch's deadline: RPC's graceful shutdown waits without a
  timeout, and `ps0` leads it). Every trainer announces itself to every server (`_arrive`), and
  waits for every server's release by polling it (no RPC is held open while a slow trainer
  finishes), so a server's failure, or its disappearance, reaches them too as a `PeerLost` rather
  than a hang. Only then does everyone enter the graceful RPC shutdown, which drains outstanding
  calls. A trainer that dies after announcing itself and before that shutdown still stalls it:
  that window is the few milliseconds between the two.
- A call whose server is dead, unreachable or silent past the RPC timeout raises `PeerLost` naming
  that server and its rank (`server i (psi, rank r) failed name.method ...`), on every trainer.
  The RPC timeout alone names no one, though: a trainer stopped (SIGSTOP) with a call in flight
  finds the call timed out once it is continued, the server's reply unread. So a call that timed
  out asks its server for a ping (`ALIVE_WITHIN_S`): a server that does not answer is the silent
  one and is named; one that answers gets the call again, as long as the call began less than
  `timeout_s` (`sync.timeout_s`) ago, and once more after (its answer then is the server's verdict,
  e.g. that it lost this very trainer). A stall shorter than `sync.timeout_s` on either side
  is therefore no failure. Retries are safe: every call carries its trainer's call number, and a
  server runs each number once (`_Replies`): a retry of a call that ran, or is running, gets that
  run's reply. Each call also names the calls to that server its trainer has settled since its last
  one there (no retry of them can follow), and the server forgets their replies.
- `abort(reason)` is the way out of a failed trainer, and waits for no peer: it tells every server
  why (`notify_abort`: one call each, at most `ABORT_NOTICE_S`), then shuts RPC down without draining. From then
  on a server refuses every call with `PeerLost` carrying that reason, and its `stop()` ends with
  it at once, after `ABORT_GRACE_S` for the surviving trainers to read it (their calls, their
  polls in `stop()` and `barrier()`): every rank ends naming the trainer that failed instead of
  waiting `trainer_timeout_s`. A process that exits with the transport still started (the user's
  exception escaped before any `stop()` or `abort()`) aborts at exit, so RPC is never alive at
  interpreter exit.
- `barrier(name)` meets every trainer without any collective (the trainer group stays TorchRec's
  and the user's): each trainer announces itself to server 0 and polls it until all have. A
  trainer that aborted makes every waiting one raise `PeerLost` with its reason at once; one that
  neither arrives nor aborts within the transport's `timeout_s` (`sync.timeout_s`: a peer that
  slow is stuck, e.g. in a collective nobody else will enter) makes them raise `PeerLost` naming it.
- `post_abort` / `aborted_peers` are the job's notice board for jobs with or without servers: a
  key in the default group's store per failed rank, so that a peer whose collective fails because
  that rank left (its group was destroyed or its process exited) can say which rank, and why. A
  rank killed or stuck posts nothing, so every trainer also beats there (`Heartbeat`), and
  `silent_peers` names the ranks whose beat stopped.
- An exception raised by a service is raised by the caller's `wait()` with its own type and message
  and the server's traceback as a note (RPC alone would turn most types into RuntimeError).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import datetime
import fcntl
import functools
import itertools
import os
import socket
import struct
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from shadowgba.errors import PeerLost

ATTEMPT_RENDEZVOUS = "shadowgba-attempt"
"""The rendezvous scheme of RPC's init_method: `env://` under this torchrun attempt's prefix."""

SERVE_WAIT_S = 30.0
"""How long a call for a service name that is not served (yet) waits for `serve()` on its server."""
TRAINER_TIMEOUT_S = 300.0
"""The longest a server in `stop()` waits for a trainer that has neither called `stop()` nor answered a
ping before it gives up on it (`PeerLost`), unless the transport's `timeout_s` is shorter;
`stop(trainer_timeout_s=...)` overrides it."""
ABORT_NOTICE_S = 5.0
"""Longest `abort()` waits for each server to take its notice: a server that does not answer that fast
is gone or stuck, and the failed trainer must not wait for it."""
ABORT_GRACE_S = 2.0
"""How long a server whose trainer aborted (or whom it gave up on) keeps answering with the failure
before its `stop()` raises, so that the surviving trainers read the reason rather than a dead server."""
ALIVE_WITHIN_S = 5.0
"""How fast a server must answer the ping that follows a call to it that timed out for the call to be
retried; one that does not is named as the silent rank."""
PING_INTERVAL_S = 1.0
"""How often a server pings the trainers that have not called `stop()` yet (also each ping's RPC
timeout), and at most how long a trainer in `stop()` sleeps between two polls."""
HEARTBEAT_LEFT = "left"
"""The heartbeat of a rank that left the job normally (`Heartbeat.stop`)."""
HEARTBEAT_SILENT_S = 3 * PING_INTERVAL_S
"""How long `silent_peers` waits for a heartbeat to advance before it names that rank: a few beats."""
REFUSED_PINGS = 3
"""A trainer whose connection is gone on this many pings in a row is lost before `sync.timeout_s`:
a killed process's connection closes, a stopped one's stays open (its pings only time out)."""

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


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
    """Global ranks of the servers; server i is `server_ranks[i]`, RPC name `ps{i}`."""
    trainer_ranks: tuple[int, ...]
    """Global ranks of the trainers; trainer i is `trainer_ranks[i]`, RPC name `trainer{i}`."""
    trainer_index: int | None
    """Index of this rank among the trainers; None on servers."""
    server_index: int | None
    """Index of this rank among the servers; None on trainers."""
    trainer_group: dist.ProcessGroup | None = dataclasses.field(default=None, compare=False, repr=False)
    """Process group of the trainers (set by `start()` on trainers; None on servers): TorchRec's and the
    user's; the library's own collectives run on `sync_group()`."""

    @classmethod
    def assign(cls, rank: int, world_size: int, num_servers: int) -> "Roles":
        """The roles of `rank`, without any group; refuses a server count that leaves no trainer."""
        if isinstance(num_servers, bool) or not isinstance(num_servers, int) or not 0 <= num_servers < world_size:
            raise ValueError(
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
        """This rank's RPC name."""
        return server_name(self.server_index) if self.is_server else f"trainer{self.trainer_index}"


class _Calls:
    """A trainer's calls to the servers, numbered: a server runs each number once (`_Replies`), and
    forgets its reply once told that this trainer has settled the call (no retry can follow)."""

    def __init__(self) -> None:
        self._numbers = itertools.count()
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

    def clear(self) -> None:
        with self._lock:
            self._by_trainer.clear()


@dataclasses.dataclass
class _Started:
    roles: Roles
    owns_default_group: bool
    timeout_s: float
    """The trainer group's collective timeout, also the deadline of `barrier()`."""
    sync_group: dist.ProcessGroup | None
    """The library's own group over the trainers (`sync_group()`); None on servers."""
    barriers: dict[str, int] = dataclasses.field(default_factory=dict)
    """Per barrier name, how often this trainer has entered it (every trainer counts alike)."""
    notified: bool = False
    """Whether `notify_abort` has told the servers this trainer failed."""
    lost_after_s: float = 0.0
    """Server: how long a trainer may answer no ping before it is lost (`_watch_trainers`)."""
    watch_ended: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Server: set by the tear-down to end `_watch_trainers`."""
    watch: threading.Thread | None = None
    """Server: the thread of `_watch_trainers`."""
    calls: _Calls = dataclasses.field(default_factory=_Calls)
    """Trainer: the numbers of its calls to the servers, and how many were retried."""


@dataclasses.dataclass
class _StopBarrier:
    """A server's view of the trainers' arrivals in `stop()` and `barrier()` (guarded by `_stop_changed`)."""

    arrived: dict[str, set[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(set))
    """Per barrier key ('stop', or a `barrier()` name and use), the trainer indices that arrived."""
    failure: str | None = None
    """Set when a trainer aborted or this server gave up on one: the message every trainer raises,
    and the reason every later call is refused."""


_started: _Started | None = None
_services: dict[str, object] = {}
_services_changed = threading.Condition()
_replies = _Replies()
_stop_barrier = _StopBarrier()
_stop_changed = threading.Condition()


def server_name(server_index: int) -> str:
    """RPC name of server `server_index`."""
    return f"ps{server_index}"


def start(
    num_servers: int, backend: str = "gloo", timeout_s: float | None = None, rpc_timeout_s: float | None = None
) -> Roles:
    """Join the job as trainer or server (collective: every rank calls it, in the same order).

    Reads torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; initialises the default process
    group (with `backend`) unless it exists, creates the trainer group (its collectives time out
    after `timeout_s`; None: torch's default) and starts RPC (a call fails after `rpc_timeout_s`;
    None: TensorPipe's default of 60 s).
    """
    global _started
    if _started is not None:
        raise RuntimeError("the PS transport is already started; call stop() first")
    master_addr = os.environ.get("MASTER_ADDR")
    if not master_addr or not os.environ.get("MASTER_PORT"):
        raise RuntimeError("the PS transport needs MASTER_ADDR and MASTER_PORT (as set by torchrun)")
    owns_default_group = not dist.is_initialized()
    if owns_default_group:
        try:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except KeyError as missing:
            raise RuntimeError(f"the PS transport needs {missing.args[0]} (as set by torchrun)") from None
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    roles = Roles.assign(rank, world_size, num_servers)  # before any group exists
    if not {"TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} <= set(os.environ):
        interface = listen_interface(master_addr)
        os.environ.setdefault("TP_SOCKET_IFNAME", interface)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    if owns_default_group:
        dist.init_process_group(backend, store=attempt_store(rank, world_size), rank=rank, world_size=world_size)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    trainer_group = dist.new_group(list(roles.trainer_ranks), backend=backend, timeout=timeout)
    sync_group = dist.new_group(list(roles.trainer_ranks), backend=backend, timeout=timeout)
    roles = dataclasses.replace(roles, trainer_group=None if roles.is_server else trainer_group)
    with warnings.catch_warnings():
        # RPC's own device-map exchange passes a bare gloo backend where a group is expected
        warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
        rpc.init_rpc(
            roles.name,
            rank=rank,
            world_size=world_size,
            # TCP (libuv) only: TensorPipe's default shared-memory transport busy-polls in a reactor
            # thread per process, which on few cores halves PS throughput (measured: 2 trainers + 1
            # server on 2 cores, 33K -> 58K samples/s; lookups 10-30 ms -> 6 ms).
            rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                init_method=f"{ATTEMPT_RENDEZVOUS}://", _transports=["uv"],
                **({} if rpc_timeout_s is None else {"rpc_timeout": rpc_timeout_s}),
            ),
        )
    timeout_s = timeout.total_seconds() if timeout is not None else dist.default_pg_timeout.total_seconds()
    _started = _Started(roles, owns_default_group, timeout_s, None if roles.is_server else sync_group,
                        lost_after_s=timeout_s)
    if roles.is_server:
        _started.watch = threading.Thread(target=_watch_trainers, args=(_started,), name="shadowgba-watch", daemon=True)
        _started.watch.start()
    return roles


def restart_count() -> int:
    """Which attempt of a torchrun job this is (0: the first; 0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def attempt_store(rank: int, world_size: int, timeout_s: float | None = None) -> dist.Store:
    """The `env://` store (MASTER_ADDR:MASTER_PORT; torchrun's agent store under torchrun) under a
    prefix of this attempt's own, `attempt_{TORCHELASTIC_RESTART_COUNT}/`: keys written by an
    earlier attempt of a restarted torchrun job (dead workers' addresses) are not read."""
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, **timeout))
    return dist.PrefixStore(f"attempt_{restart_count()}", store)


def _attempt_rendezvous(url: str, timeout: datetime.timedelta | None = None, **_: Any):
    """Rendezvous handler of `shadowgba-attempt://?rank=R&world_size=N` (what `init_rpc` passes)."""
    query = dict(part.split("=", 1) for part in url.partition("?")[2].split("&") if part)
    rank, world_size = int(query["rank"]), int(query["world_size"])
    yield attempt_store(rank, world_size, None if timeout is None else timeout.total_seconds()), rank, world_size


dist.register_rendezvous_handler(ATTEMPT_RENDEZVOUS, _attempt_rendezvous)


def sync_group() -> dist.ProcessGroup:
    """The library's own process group over the trainers, apart from `Roles.trainer_group` (TorchRec's
    and the user's), so that the library's collectives never pair with theirs. Held here only, and
    destroyed by `stop()` and `abort()`: a caller that does not keep it lets `abort()` free it, which
    makes a peer's pending collective on it fail at once."""
    group = _require_started().sync_group
    if group is None:
        raise RuntimeError("sync_group() is the trainers' group; this rank is a server")
    return group


def roles() -> Roles:
    """This rank's roles in the started job."""
    return _require_started().roles


def serve(name: str, service: object) -> None:
    """Make `service`'s public methods callable by other ranks as `name` (server ranks only)."""
    roles = _require_started().roles
    if not roles.is_server:
        raise RuntimeError(f"serve() runs on server ranks; rank {roles.rank} is {roles.name}")
    with _services_changed:
        if name in _services:
            raise ValueError(f"service '{name}' is already served on {roles.name}")
        _services[name] = service
        _services_changed.notify_all()


def call_async(server_index: int, name: str, method: str, *args: Any) -> torch.futures.Future:
    """Run `service.method(*args)` of service `name` on server `server_index`; a Future of the result.

    `wait()` returns the result or raises the service's exception: same type, same message, the
    server's traceback attached as a note. A transport failure (the server is dead, unreachable, or
    did not answer within the RPC timeout nor a ping after it) raises `PeerLost` naming the server
    and its rank, chaining RPC's error; a call that timed out on a server that still answers is sent
    again (`_request`), and run once however often it is sent.
    """
    started = _require_started()
    roles = started.roles
    num_servers = roles.num_servers
    if not 0 <= server_index < num_servers:
        raise ValueError(f"server_index must be in [0, {num_servers}), got {server_index}")
    calls = started.calls  # not `started`, which holds the groups an abort must free
    number, settled = calls.begin(server_index)
    reply = _request(started, server_index, _dispatch, (name, method, args, (roles.trainer_index, number, settled)),
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


def retried_calls() -> int:
    """How many times this trainer sent a call again after it timed out on a server that still answered."""
    return _require_started().calls.retried


def _request(started: _Started, server: int, function: Callable[..., Any], args: tuple[Any, ...],
             what: str) -> torch.futures.Future:
    """`function(*args)` on server `server` over RPC, a Future of its return value. A transport
    failure sets `PeerLost` naming the server (`_server_lost(..., what, ...)`), except a timeout on a
    server that answers a ping within `ALIVE_WITHIN_S`: then the same request is sent again while it
    began less than `timeout_s` ago, and once more after (see the module docstring). Never blocks:
    the ping and the retries are chained on the RPC futures. RPC's own refusal (shut down) of the
    first attempt is raised here."""
    request = _Request(started.roles, started.timeout_s, started.calls, server, function, args, what)
    request.send(request.began)
    return request.result


class _Request:
    """One `_request` in flight: its attempts, pings and outcome. Its callbacks are bound methods, not
    closures that refer to one another: such a cycle would outlive the request until the garbage
    collector ran, and with it what it refers to (a group that an abort destroys must be freed then:
    its peers are released only when its connections close)."""

    def __init__(self, roles: Roles, timeout_s: float, calls: _Calls, server: int, function: Callable[..., Any],
                 args: tuple[Any, ...], what: str) -> None:
        self.roles, self.timeout_s, self.calls = roles, timeout_s, calls
        self.server, self.function, self.args, self.what = server, function, args, what
        self.began = time.monotonic()
        self.result: torch.futures.Future = torch.futures.Future()

    def send(self, attempt_began: float) -> None:
        attempt = rpc.rpc_async(server_name(self.server), self.function, args=self.args)
        attempt.add_done_callback(functools.partial(self._settle, attempt_began=attempt_began))

    def _settle(self, done: torch.futures.Future, attempt_began: float) -> None:
        try:
            self.result.set_result(done.wait())
            return
        except Exception as error:  # noqa: BLE001 (RPC raises RuntimeError, or a service-side type)
            failure = error
        if not _timed_out(_first_line(failure)) or attempt_began - self.began >= self.timeout_s:
            self._fail(failure)
            return
        try:
            ping = rpc.rpc_async(server_name(self.server), _alive, timeout=ALIVE_WITHIN_S)
        except RuntimeError:  # RPC is shut down (this trainer aborted meanwhile)
            self._fail(failure)
            return
        ping.add_done_callback(functools.partial(self._retry, failure=failure))

    def _retry(self, answer: torch.futures.Future, failure: BaseException) -> None:
        try:
            answer.wait()
        except Exception:  # noqa: BLE001 (the server is silent too: it is the one to name)
            self._fail(failure, f"shadowgba: {server_name(self.server)} answered no ping within {ALIVE_WITHIN_S:g} s "
                                "either")
            return
        self.calls.count_retry()
        try:
            self.send(time.monotonic())
        except RuntimeError as error:  # RPC is shut down (this trainer aborted meanwhile)
            self._fail(error)

    def _fail(self, error: BaseException, note: str | None = None) -> None:
        lost = _server_lost(self.roles, self.server, self.what, error)
        if note is not None:
            lost.add_note(note)
        self.result.set_exception(lost)


def call(server_index: int, name: str, method: str, *args: Any) -> Any:
    """Blocking `call_async`: the result, or the service's exception raised here."""
    return call_async(server_index, name, method, *args).wait()


def call_each(name: str, method: str, args_by_server: Sequence[tuple[Any, ...]], first_server: int = 0) -> list[Any]:
    """`method(*args_by_server[i])` of service `name` on server `first_server + i`, all in flight at
    once; the results in server order (or the first failure raised here)."""
    return torch.futures.wait_all([
        call_async(first_server + index, name, method, *args) for index, args in enumerate(args_by_server)
    ])


def stop(trainer_timeout_s: float | None = None) -> None:
    """Leave the job (collective): waits for every rank and every outstanding call, then tears down.

    On a server, raises `PeerLost` once a trainer has aborted (`abort()`: with its reason), or has
    neither called `stop()` nor answered a ping for the shorter of `start()`'s `timeout_s` and
    `trainer_timeout_s` (default `TRAINER_TIMEOUT_S`), or its connection is gone (`_watch_trainers`);
    trainers waiting here raise it as well. Either way this rank's transport
    is torn down. The default process group is destroyed only if `start()` created it.
    """
    started = _require_started()
    timeout_s = TRAINER_TIMEOUT_S if trainer_timeout_s is None else trainer_timeout_s
    try:
        if started.roles.is_server:
            _await_trainers(started, timeout_s)
        else:
            _await_release(started.roles, "stop", timeout_s=None)
    except BaseException:
        _tear_down(started, graceful=False)
        raise
    _tear_down(started, graceful=True)


def notify_abort(reason: str) -> None:
    """Tell every server that this trainer failed (`reason`: what failed), waiting for no peer: each
    notice `"trainer {i} (rank r) aborted: {reason}"` waits at most `ABORT_NOTICE_S`, and a server that
    is gone is skipped. The servers refuse every later call with it and end their `stop()` with it,
    so the other trainers end naming this one. Sent once; never raises; a no-op on a server or
    when the transport is not started. `abort()` follows."""
    if _started is None or _started.roles.is_server or _started.notified:
        return
    _started.notified = True
    roles = _started.roles
    message = failure_message(roles, reason)
    notices = []
    for server in range(roles.num_servers):
        try:
            notices.append(rpc.rpc_async(server_name(server), _abort, args=(message,), timeout=ABORT_NOTICE_S))
        except Exception:  # RPC itself is failing here: that server learns from the lost connection
            pass
    for notice in notices:
        try:
            notice.wait()
        except Exception:  # that server is gone or stuck: it learns from the lost connection
            pass


def failure_message(roles: Roles, reason: str) -> str:
    """How a failed trainer is named to its peers and servers: `trainer {i} (rank r) aborted: reason`."""
    return f"trainer {roles.trainer_index} (rank {roles.rank}) aborted: {reason}"


def abort(reason: str) -> None:
    """Leave the job at once after a failure on this rank, waiting for no peer: `notify_abort(reason)`
    unless already done, then RPC is shut down without draining and the groups the transport created
    are destroyed, which makes a peer's pending collective on them fail at once. Never raises; a
    no-op when the transport is not started."""
    if _started is None:
        return
    try:
        notify_abort(reason)
    finally:
        _tear_down(_started, graceful=False)


def barrier(name: str, timeout_s: float | None = None) -> None:
    """Wait until every trainer has called `barrier(name)` (as often as this one), with no collective.

    Raises `PeerLost` with its reason as soon as a trainer has aborted, naming the trainers still
    missing once `timeout_s` has passed (None: the trainer group's timeout given to `start()`; a
    peer that late is stuck, or too slow to be told from stuck), and naming server 0 if it is gone.
    Trainers only; server 0 keeps the count."""
    started = _require_started()
    if started.roles.is_server:
        raise RuntimeError(f"barrier() is for trainers; {started.roles.name} is a server")
    use = started.barriers[name] = started.barriers.get(name, 0) + 1
    _await_release(started.roles, f"{name}#{use}", started.timeout_s if timeout_s is None else timeout_s, servers=1)


def post_abort(job: str, rank: int, reason: str) -> None:
    """Put `reason` on the notice board of `job` (a name every rank gives the same job) as rank
    `rank`'s: why it left. Never raises: the board's store may be gone with its host."""
    _set_notice(_notice_key(job, rank), reason)


def aborted_peers(job: str, ranks: Sequence[int]) -> dict[int, str]:
    """The ranks among `ranks` that posted an abort on `job`'s notice board, with their reasons."""
    reasons = {rank: _read_notice(_notice_key(job, rank)) for rank in ranks}
    return {rank: reason for rank, reason in reasons.items() if reason is not None}


class Heartbeat:
    """This rank's heartbeat on `job`'s notice board: a counter in the default group's store that a
    thread of its own advances every `PING_INTERVAL_S` while the rank is in the job, and marks as
    left when it leaves normally. A peer whose collective failed without any notice posted (a rank
    killed or stuck posts none) asks `silent_peers` which rank stopped beating."""

    def __init__(self, job: str, rank: int) -> None:
        self._key = _notice_key(job, rank, "beat")
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="shadowgba-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        """Start beating (returns self)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and mark this rank as left: from then on its silence names no failure."""
        self._ended.set()
        self._thread.join()
        _set_notice(self._key, HEARTBEAT_LEFT)

    def _beat(self) -> None:
        for count in itertools.count():
            _set_notice(self._key, str(count))
            if self._ended.wait(PING_INTERVAL_S):
                return


def silent_peers(job: str, ranks: Sequence[int], within_s: float = HEARTBEAT_SILENT_S) -> list[int]:
    """The ranks among `ranks` whose heartbeat on `job`'s notice board (`Heartbeat`) did not advance
    for `within_s`, left ones excepted: dead or stuck. Returns as soon as every other one has beaten,
    so with live peers it waits about `PING_INTERVAL_S`. Empty when the board cannot be read."""
    keys = {rank: _notice_key(job, rank, "beat") for rank in ranks}
    first = {rank: _read_notice(key) for rank, key in keys.items()}
    waiting = {rank for rank, beat in first.items() if beat != HEARTBEAT_LEFT}
    deadline = time.monotonic() + within_s
    while waiting and time.monotonic() < deadline:
        time.sleep(PING_INTERVAL_S / 4)
        waiting = {rank for rank in waiting if _read_notice(keys[rank]) in (first[rank], None)}
    return sorted(waiting)


def _set_notice(key: str, value: str) -> None:
    """Write `value` under `key` on the notice board; never raises (its host may be gone)."""
    try:
        _notice_store().set(key, value)
    except Exception:  # the store's host is gone: the peers learn only that the rank left
        pass


def _read_notice(key: str) -> str | None:
    """The value under `key` on the notice board; None if there is none or the board cannot be read."""
    try:
        store = _notice_store()
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # the store's host is gone: nothing can be read
        return None


def _notice_store() -> dist.Store:
    """The default group's store (the agent's under torchrun, which outlives every rank)."""
    return dist.distributed_c10d._get_default_store()


def _notice_key(job: str, rank: int, kind: str = "aborted") -> str:
    return f"shadowgba/attempt_{restart_count()}/{job}/{kind}/{rank}"


def _tear_down(started: _Started, graceful: bool) -> None:
    """Shut RPC down (draining outstanding calls when `graceful`), forget this rank's services and
    arrivals, and destroy the groups `start()` created."""
    global _started, _stop_barrier
    started.watch_ended.set()
    if started.watch is not None:
        started.watch.join()  # its pings end within PING_INTERVAL_S; none may be in flight at shutdown
    try:
        rpc.shutdown(graceful=graceful)
    finally:
        with _services_changed:
            _services.clear()
        _replies.clear()
        with _stop_changed:
            _stop_barrier = _StopBarrier()
        _started = None
        if not dist.is_initialized():  # every group is gone already (the user destroyed them, at exit)
            pass
        elif started.owns_default_group:
            dist.destroy_process_group()
        elif started.roles.trainer_group is not None:
            dist.destroy_process_group(started.roles.trainer_group)
            dist.destroy_process_group(started.sync_group)


def _abort_at_exit() -> None:
    """At interpreter exit with the transport still started: nothing stopped it, so abort it."""
    if _started is not None:
        abort("its process exited without leaving the job (transport.stop() or abort() never ran)")


atexit.register(_abort_at_exit)


def _await_trainers(started: _Started, trainer_timeout_s: float) -> None:
    """Server: return once every trainer has arrived; raise `PeerLost` for one that aborted or that
    the watch (`_watch_trainers`) gave up on, now within `trainer_timeout_s` at the latest."""
    started.lost_after_s = min(started.lost_after_s, trainer_timeout_s)
    trainers = len(started.roles.trainer_ranks)
    with _stop_changed:
        _stop_changed.wait_for(lambda: len(_stop_barrier.arrived["stop"]) == trainers
                               or _stop_barrier.failure is not None)
        failure = _stop_barrier.failure
    if failure is None:
        return
    time.sleep(ABORT_GRACE_S)  # let the surviving trainers' calls and polls read the failure
    raise PeerLost(failure)


def _watch_trainers(started: _Started) -> None:
    """Server thread, from `start()` to the tear-down: ping every trainer that has not arrived in
    `stop()` every `PING_INTERVAL_S` (each ping's timeout too). One that has answered no ping for
    `lost_after_s` (`timeout_s`, the job's `sync.timeout_s`; lowered by `stop(trainer_timeout_s)`),
    or whose pings failed on a lost connection `REFUSED_PINGS` times in a row, is lost: posted like
    an abort notice, so every later call of any trainer, every barrier and every `stop()` raise
    `PeerLost` naming it. A stopped process (SIGSTOP) keeps its connections and only times out, so
    only the clock declares it lost: a stall shorter than `lost_after_s` is not a failure."""
    roles = started.roles
    trainers = range(len(roles.trainer_ranks))
    last_heard = dict.fromkeys(trainers, time.monotonic())
    refused = dict.fromkeys(trainers, 0)
    last_error: dict[int, str] = {}
    while not started.watch_ended.wait(PING_INTERVAL_S):
        with _stop_changed:
            if _stop_barrier.failure is not None:
                return
            missing = [index for index in trainers if index not in _stop_barrier.arrived["stop"]]
        try:
            pings = {index: rpc.rpc_async(f"trainer{index}", _alive, timeout=PING_INTERVAL_S) for index in missing}
        except RuntimeError:  # RPC is shutting down with the transport
            return
        for index, ping in pings.items():
            try:
                ping.wait()
                last_heard[index], refused[index] = time.monotonic(), 0
            except RuntimeError as error:  # dead, stopped or unreachable: the clock keeps running
                last_error[index] = _first_line(error)
                refused[index] = 0 if _timed_out(last_error[index]) else refused[index] + 1
        now = time.monotonic()
        with _stop_changed:  # one that arrived while we pinged is not lost
            lost = [index for index in missing if index not in _stop_barrier.arrived["stop"]
                    and (now - last_heard[index] > started.lost_after_s or refused[index] >= REFUSED_PINGS)]
            if lost and _stop_barrier.failure is None:
                index = lost[0]
                why = (f"{REFUSED_PINGS} pings in a row found its connection gone" if refused[index] >= REFUSED_PINGS
                       else "sync.timeout_s" if started.lost_after_s == started.timeout_s else "trainer_timeout_s")
                _stop_barrier.failure = (
                    f"trainer {index} (rank {roles.trainer_ranks[index]}) stopped answering for "
                    f"{now - last_heard[index]:.0f} s ({why}); it probably died "
                    f"({roles.name}'s last ping: {last_error.get(index, 'timed out')})"
                )
                _stop_changed.notify_all()
                return


def _await_release(roles: Roles, key: str, timeout_s: float | None, servers: int | None = None) -> None:
    """Trainer: announce this trainer under `key` to the first `servers` servers (default: all), then
    poll them until every trainer has arrived there; `PeerLost` on a failure, or after `timeout_s`
    (None: no deadline, the servers' own `trainer_timeout_s` decides)."""
    servers = roles.num_servers if servers is None else servers
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for server in range(servers):
        _call_in_stop(server, _arrive, key, roles.trainer_index)
    waiting = list(range(servers))
    pause = 0.005
    while waiting:
        for server in list(waiting):
            missing, failure = _call_in_stop(server, _release_state, key, len(roles.trainer_ranks))
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


def _call_in_stop(server: int, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` (idempotent) on a server from a trainer in `stop()` or `barrier()`; a server
    that is gone is a PeerLost (`_request`)."""
    return _request(_require_started(), server, function, args, "went away in transport.stop() or barrier()").wait()


def _server_lost(roles: Roles, server: int, what: str, error: BaseException) -> PeerLost:
    """How a trainer names a server its RPC to failed (dead, unreachable, or no answer within the RPC
    timeout): `server i (psi, rank r) <what> for trainerj: <RPC's error>`, chaining it."""
    lost = PeerLost(f"server {server} ({server_name(server)}, rank {roles.server_ranks[server]}) {what} for "
                    f"{roles.name}: {_first_line(error)}")
    lost.__cause__ = error
    return lost


def _arrive(key: str, trainer_index: int) -> None:
    """Runs on a server's RPC thread: trainer `trainer_index` has arrived at barrier `key`."""
    with _stop_changed:
        _stop_barrier.arrived[key].add(trainer_index)
        _stop_changed.notify_all()


def _release_state(key: str, num_trainers: int) -> tuple[list[int], str | None]:
    """Runs on a server's RPC thread: (the trainers not yet arrived at `key`, why this server gave up or None)."""
    with _stop_changed:
        return [i for i in range(num_trainers) if i not in _stop_barrier.arrived[key]], _stop_barrier.failure


def _abort(message: str) -> None:
    """Runs on a server's RPC thread: a trainer aborted (`message` names it and why). The first one
    is what every later call and every trainer's `stop()` or `barrier()` is refused with."""
    with _stop_changed:
        if _stop_barrier.failure is None:
            _stop_barrier.failure = message
        _stop_changed.notify_all()


def _first_line(error: BaseException) -> str:
    """The first line of an RPC error's message (the rest is C++ context), or its type."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _timed_out(message: str) -> bool:
    """Whether an RPC error message says the call timed out (the peer may be stopped, not gone)."""
    return "timeout" in message.lower() or "timed out" in message.lower()


def _alive() -> bool:
    """Runs on a trainer's RPC thread: the ping of a server waiting in `stop()`; and on a server's: the
    ping of a trainer whose call to it timed out (`_request`)."""
    return True


def listen_interface(master_addr: str) -> str:
    """Name of the network interface whose IPv4 address this host uses to reach `master_addr`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_addr, 9))  # a UDP connect sends nothing; it only picks the route
        except OSError as error:
            raise RuntimeError(
                f"no IPv4 route to MASTER_ADDR {master_addr} ({error}); set TP_SOCKET_IFNAME and "
                "GLOO_SOCKET_IFNAME to the interface the PS transport should listen on"
            ) from None
        local_address = probe.getsockname()[0]
    for _, interface in socket.if_nameindex():
        if _ipv4_address(interface) == local_address:
            return interface
    raise RuntimeError(
        f"no network interface holds {local_address}, the address that reaches MASTER_ADDR {master_addr}; "
        "set TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME to the interface the PS transport should listen on"
    )


def _ipv4_address(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as query:
        try:
            reply = fcntl.ioctl(query.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:  # the interface has no IPv4 address
            return None
    return socket.inet_ntoa(reply[20:24])  # struct ifreq: 16-byte name, then sockaddr_in


def _require_started() -> _Started:
    if _started is None:
        raise RuntimeError("the PS transport is not started; call start() first")
    return _started


@dataclasses.dataclass
class _Failure:
    """A service's exception on its way back to the caller (RPC itself keeps only a few types)."""

    error: Exception
    traceback: str


def _dispatch(name: str, method: str, args: tuple[Any, ...], caller: tuple[int, int, tuple[int, ...]]) -> Any:
    """Runs on the server's RPC thread: look the service up (waiting for serve()) and call it, once
    per call number of `caller` (`_Replies`: a retried call gets the first run's reply)."""
    return _replies.run_once(caller, lambda: _serve_call(name, method, args))


def _serve_call(name: str, method: str, args: tuple[Any, ...]) -> Any:
    """A service call's return value, or its exception as a `_Failure`."""
    try:
        with _stop_changed:
            failure = _stop_barrier.failure
        if failure is not None:
            raise PeerLost(f"{_require_started().roles.name} refuses {name}.{method}: {failure}")
        with _services_changed:
            if not _services_changed.wait_for(lambda: name in _services, timeout=SERVE_WAIT_S):
                raise LookupError(f"no service '{name}' after {SERVE_WAIT_S:g}s; served: {sorted(_services)}")
            service = _services[name]
        if method.startswith("_") or not callable(getattr(service, method, None)):
            raise AttributeError(f"service '{name}' ({type(service).__name__}) has no public method '{method}'")
        return getattr(service, method)(*args)
    except Exception as error:
        return _Failure(error, traceback.format_exc())
