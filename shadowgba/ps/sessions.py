"""Trainer-server sessions: how a trainer and a server meet over the job's store and build a `Channel`.

    acceptor = Acceptor(store, server=0, generation=g, on_session=serve)   # server: a thread
    channel = open_session(store, server=0, generation=g, trainer=1, ...)   # trainer, per session

The store is the job's (torchrun's agent store, or MASTER_ADDR:MASTER_PORT's), under this attempt's
prefix (`attempt_store`), so a restarted attempt never reads a dead attempt's keys; in the elastic
layout, the servers' store under `elastic/`. Keys of server s live under `ps/gen{g}/server{s}/{n}/`,
where g counts the transports this rank started (every rank starts every transport of the job, in
the same order, whatever its role in each: the k-th start of a trainer meets the k-th of every
server) and n is the server's incarnation: each process that starts as server s takes the next
number (`server_incarnation`) and publishes it under `ps/gen{g}/server{s}/current` once it accepts
sessions, so a server process restarted in the elastic layout never reads its predecessor's tickets,
and a trainer always asks the newest one (`current_incarnation`):

- `joins`: the ticket counter. A trainer takes a ticket (`store.add(joins, 1)`), writes who it is
  under `join{t}` (a `SessionInfo` as JSON, `shadowgba.ps.codec.to_json`: never a pickle) and
  `trainer{i}/latest` (its newest ticket), and waits for `accepted{t}`.
- The server's acceptor thread polls for the next ticket (`store.check`, so it notices its own end
  and never leaves the shared store client out of step), reads and checks `join{t}`, sets
  `accepted{t}`, and builds the server end of the channel in a thread of its own, so a trainer
  that vanishes mid-setup holds up no other session. A `join{t}` that is not a `SessionInfo` of
  ticket t (anything a process that can write the store put there) is refused: logged naming the
  key, answered with the reason, and the acceptor goes on with the next ticket; nothing in it was
  built or run. So are the numbers under `current` and `trainer{i}/latest` when they are not numbers.
- Both ends then build a 2-rank ProcessGroupGloo over `PrefixStore(".../session{t}", client)`,
  server rank 0, trainer rank 1, where `client` is a store client of the session's own: building
  a group blocks in `get` until the peer has written its address, and a TCPStore client runs one
  operation at a time, so on a shared client a session whose trainer gave up would hold up every
  other session (and the acceptor) for the store's timeout.

Nothing here assumes a fixed set of trainers: a trainer opens a session whenever it wants one (a
reconnect is a new session), and `trainer{i}/latest` tells the server whether a closed session was
replaced by a newer one of the same trainer or left without a successor. Each session names its
trainer process's incarnation (`trainer_incarnation`); the acceptor answers a ticket with the
reason instead of accepting it when the server refuses that process (it departed the job).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import threading
import time
from typing import Callable

import torch.distributed as dist

from shadowgba.job.rendezvous import await_key
from shadowgba.network import StoreUnreachable, bounded
from shadowgba.ps.codec import Malformed, from_json, to_json
from shadowgba.ps.same_host import loop_threads

logger = logging.getLogger("shadowgba")


SESSION_SETUP_S = 30.0
"""The longest one end waits for the other while their session's group is built."""
REFUSED = "refused: "
"""How an acceptor's answer to a ticket starts when it refuses the session (the reason follows)."""
POLL_S = 0.01
"""How often a key awaited in the store is looked for. Polled with `check`: a TCPStore client whose
`wait` timed out is out of step with its server (the late answer is read as the next reply), and
the client is shared."""
STOP_WAIT_S = 5.0
"""The longest `Acceptor.stop` waits for its thread, and `latest_ticket` for the store."""


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    """What a trainer tells a server about the session it opens."""

    ticket: int
    trainer: int
    """The trainer's index among the trainers."""
    rank: int
    """The trainer's global rank."""
    timeout_s: float
    """How long the trainer's end waits for a frame: the server beats 4 times as often."""
    incarnation: int = 1
    """Which process of this trainer index opens it (`trainer_incarnation`): a server refuses the
    sessions of a process that departed, and a newer one replaces an older one."""

    def __post_init__(self) -> None:
        if min(self.ticket, self.incarnation) < 1 or min(self.trainer, self.rank) < 0 \
                or not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"not a session: {self}")


class SessionRefused(RuntimeError):
    """The server refused a trainer's session; the message says why (its process left the job)."""


def _server_root(generation: int, server: int) -> str:
    """Where every key of server `server` in transport generation `generation` lives."""
    return f"ps/gen{generation}/server{server}"


def server_key(generation: int, server: int, incarnation: int, key: str) -> str:
    """The store key `key` of incarnation `incarnation` of server `server` in transport generation `generation`."""
    return f"{_server_root(generation, server)}/{incarnation}/{key}"


def server_incarnation(store: dist.Store, generation: int, server: int) -> int:
    """A new number for this process of server `server` (1, 2, ...), taken in the job's store."""
    return store.add(f"{_server_root(generation, server)}/incarnations", 1)


def _current_key(generation: int, server: int) -> str:
    """The key naming the incarnation of server `server` that accepts sessions (its `Acceptor` sets it)."""
    return f"{_server_root(generation, server)}/current"


def stored_count(value: bytes, key: str) -> int:
    """The number a shadowgba process stored under `key` (`str(n)`), or `Malformed` naming the key."""
    if not value.isdigit() or len(value) > 20:
        raise Malformed(f"refused {key}: {value[:40]!r} is not a number shadowgba stores")
    return int(value)


def current_incarnation(store: dist.Store, generation: int, server: int, within_s: float,
                        newer_than: int = 0) -> int | None:
    """The incarnation of server `server` that accepts sessions, once it is newer than `newer_than`;
    None if none is within `within_s` (or the store is gone, or holds no number there: logged)."""
    key = _current_key(generation, server)
    deadline = time.monotonic() + within_s
    while True:
        try:
            if store.check([key]) and (incarnation := stored_count(store.get(key), key)) > newer_than:
                return incarnation
        except RuntimeError:
            return None
        except Malformed as error:
            logger.warning("shadowgba: %s", error)
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


def trainer_incarnation(store: dist.Store, generation: int, trainer: int) -> int:
    """A new number for this process of trainer `trainer` (1, 2, ...: one per process that starts
    the transport as that trainer), taken in the job's store."""
    return store.add(f"ps/gen{generation}/trainer{trainer}/incarnations", 1)


def session_group(namespace: str, generation: int, server: int, incarnation: int, ticket: int, rank: int,
                  timeout_s: float) -> tuple[dist.ProcessGroup, list[int]]:
    """This end (server rank 0, trainer rank 1) of session `ticket`'s 2-rank gloo group, whose
    operations time out after `timeout_s`, and the id of the event-loop thread gloo started for it
    (`Channel` lowers its priority), in a list that is empty where it cannot be told apart: no
    /proc, or another group built meanwhile by another thread (two new loops; neither is touched);
    built over a store client of its own (module docstring), under `namespace`, the prefix of the
    transport's store."""
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=datetime.timedelta(seconds=SESSION_SETUP_S))
    prefix = f"{namespace}/{server_key(generation, server, incarnation, f'session{ticket}')}"
    before = loop_threads()
    group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, client), rank, 2, datetime.timedelta(seconds=timeout_s))
    started = loop_threads() - before
    return group, sorted(started) if len(started) == 1 else []


def request_session(store: dist.Store, generation: int, server: int, server_incarnation: int, trainer: int,
                    rank: int, timeout_s: float, accept_within_s: float, incarnation: int = 1) -> SessionInfo:
    """Trainer: take a ticket at incarnation `server_incarnation` of `server`, announce it, and wait
    up to `accept_within_s` for the server's acceptor to take it. Raises `TimeoutError` when it does
    not (the server is gone or stopped), at once when a newer process of the server has published
    itself meanwhile (this one is dead: no need to wait the rest), `SessionRefused` with the
    server's reason when it refuses this process."""
    def key(name: str) -> str:
        return server_key(generation, server, server_incarnation, name)

    ticket = store.add(key("joins"), 1)
    info = SessionInfo(ticket, trainer, rank, timeout_s, incarnation)
    store.set(key(f"trainer{trainer}/latest"), str(ticket))
    store.set(key(f"join{ticket}"), to_json(info))
    accepted = key(f"accepted{ticket}")
    if not await_key(store, accepted, accept_within_s, superseded=lambda: current_incarnation(
            store, generation, server, 0.0, newer_than=server_incarnation) is not None):
        raise TimeoutError(f"no acceptance of session {ticket} by incarnation {server_incarnation} within "
                           f"{accept_within_s:g} s, or a newer process of the server came first")
    answer = store.get(accepted).decode()
    if answer.startswith(REFUSED):
        raise SessionRefused(answer[len(REFUSED):])
    return info


def latest_ticket(store: dist.Store, generation: int, server: int, incarnation: int, trainer: int,
                  within_s: float) -> int | None:
    """Server: the newest session ticket trainer `trainer` took here (None if the store cannot say
    within `within_s`: its host is gone, or this one cut off from it; or holds no number: logged)."""
    key = server_key(generation, server, incarnation, f"trainer{trainer}/latest")
    try:
        return stored_count(bounded(lambda: store.get(key), within_s), key)
    except StoreUnreachable:
        return None
    except Malformed as error:
        logger.warning("shadowgba: %s", error)
        return None


class Acceptor:
    """Server: a thread that takes the trainers' session tickets in order and hands each to
    `on_session(info)` in a thread of its own (which builds the channel), until `stop()`; a
    session for which `refusal(info)` gives a reason is answered with it instead, and so is a
    ticket whose join is not a `SessionInfo` of that ticket (module docstring). Its incarnation
    of the server is published as the current one when it starts."""

    def __init__(self, store: dist.Store, generation: int, server: int, incarnation: int,
                 on_session: Callable[[SessionInfo], None], refusal: Callable[[SessionInfo], str | None]) -> None:
        self._store, self._generation, self._server, self._incarnation = store, generation, server, incarnation
        self._on_session, self._refusal = on_session, refusal
        store.set(_current_key(generation, server), str(incarnation))
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"shadowgba-acceptor-ps{server}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the acceptor (within `POLL_S`, or `STOP_WAIT_S` if a store access holds it: a store
        cut off from this host can block one for minutes; the thread is left behind then);
        sessions already handed over are not touched."""
        self._ended.set()
        self._thread.join(STOP_WAIT_S)

    def _accept(self) -> None:
        ticket = 1
        while not self._ended.is_set():
            key = server_key(self._generation, self._server, self._incarnation, f"join{ticket}")
            if not await_key(self._store, key, float("inf"), self._ended):
                self._ended.wait(POLL_S)  # the store is gone: keep looking, slowly, until the end
                continue
            try:
                joined = self._store.get(key)
            except RuntimeError:  # the store's host is gone
                continue
            info, refused = self._admit(ticket, key, joined)
            try:
                self._store.set(server_key(self._generation, self._server, self._incarnation, f"accepted{ticket}"),
                                "1" if refused is None else REFUSED + refused)
            except RuntimeError:  # the store's host is gone
                continue
            ticket += 1
            if refused is not None:
                continue
            threading.Thread(target=self._on_session, args=(info,), name=f"shadowgba-session-{info.ticket}",
                             daemon=True).start()

    def _admit(self, ticket: int, key: str, joined: bytes) -> tuple[SessionInfo | None, str | None]:
        """The session `joined` (the value under `key`) announces, and why it is refused (None: it is
        not); one that is not a `SessionInfo` of `ticket` is refused and logged, naming the key."""
        try:
            info = from_json(joined, SessionInfo, key)
            if info.ticket != ticket:
                raise Malformed(f"refused {key}: it names session {info.ticket}")
        except Malformed as error:  # written by a process that is not a shadowgba trainer of this job
            logger.warning("shadowgba: ps%d's acceptor %s; nothing in it was run", self._server, error)
            return None, str(error)
        return info, self._refusal(info)
