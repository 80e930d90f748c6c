"""The PS transport on real ranks, under the spawn harness and under torchrun: roles, calls, errors.

The channel itself (framing, concurrent calls, a killed or stopped peer) is tests/test_ps_channel.py.

Run as a script (`torchrun --nproc_per_node=3 tests/test_ps_transport.py`) it exercises the same
checks with torchrun's agent owning MASTER_PORT and `start()` creating the default process group.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from shadowgba.errors import PeerLost
from shadowgba.job.roles import Roles, failure_message
from shadowgba.ps import channel, same_host, server_end, sessions, trainer_end
from shadowgba.ps.start import start_transport
from shadowgba.ps.transport import Caller
from tests.multiprocess import run_ranks, run_ranks_outcomes, run_shared_concurrently, with_checkout_path

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
SERVE_DELAY_S = 0.5
"""The server serves this long after start(): trainers' first calls must wait for serve(), not fail."""


class Echo:
    """A toy service: returns what it was given, doubles tensors, refuses on request, and answers
    `later(key)` only when some trainer calls `answer(key, value)` (a Future, as a long poll is)."""

    def __init__(self, server_index: int,
                 copy: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None) -> None:
        self.server_index = server_index
        self._copy = copy
        self._lock = threading.Lock()
        self._later: dict[str, concurrent.futures.Future] = {}

    def later(self, key: str) -> concurrent.futures.Future:
        with self._lock:
            return self._later.setdefault(key, concurrent.futures.Future())

    def waiting(self, key: str) -> bool:
        with self._lock:
            return key in self._later

    def answer(self, key: str, value: object) -> None:
        future = self.later(key)
        if isinstance(value, Exception):
            future.set_exception(value)
        else:
            future.set_result(value)

    def describe(self, sender: int, values: torch.Tensor) -> dict:
        return {"server": self.server_index, "sender": sender, "doubled": values * 2}

    def shared(self, values: torch.Tensor) -> torch.Tensor:
        """`values` doubled, copied as a service sends a tensor to every trainer (`shared_copy`)."""
        return self._copy(values * 2, values.dtype)

    def refuse(self, reason: str) -> None:
        raise ValueError(f"push refused: {reason}")


def listening_sockets() -> set[tuple[str, str, str]]:
    """(table, hex address, hex port) of every TCP socket this process listens on, from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            inodes.add(os.readlink(Path("/proc/self/fd", fd)))
        except OSError:  # closed since the listing by another thread (gloo's, a channel's): not a listener
            pass
    listening = set()
    for table in ("tcp", "tcp6"):
        for line in Path("/proc/net", table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and f"socket:[{fields[9]}]" in inodes:  # 0A: LISTEN
                listening.add((table, *fields[1].split(":")))
    return listening


def exercise_transport(rank: int, world_size: int) -> dict:
    """3 ranks, 1 server: every rank checks its roles; trainers call the server's Echo service."""
    before = listening_sockets()
    ps = start_transport(num_servers=1)
    roles = ps.roles
    result: dict = {"roles": dataclasses.replace(roles, trainer_group=None)}
    try:
        assert roles.world_size == 3 and roles.server_ranks == (2,) and roles.trainer_ranks == (0, 1)
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
        if roles.is_server:
            assert (roles.server_index, roles.trainer_index, roles.name) == (0, None, "ps0")
            assert roles.trainer_group is None
            time.sleep(SERVE_DELAY_S)
            ps.serve("echo", Echo(roles.server_index, ps.shared_copy))
            server_end.SERVE_WAIT_S = 0.5  # how long the trainers' call for an unknown service waits
        else:
            assert (roles.server_index, roles.trainer_index, roles.name) == (None, rank, f"trainer{rank}")
            reply = ps.call_async(0, "echo", "describe", rank, torch.arange(3.0)).wait()
            assert reply["server"] == 0 and reply["sender"] == rank
            torch.testing.assert_close(reply["doubled"], torch.tensor([0.0, 2.0, 4.0]))
            with pytest.raises(ValueError, match="push refused: stale token from trainer"):
                ps.call(0, "echo", "refuse", f"stale token from trainer{rank}")
            with pytest.raises(LookupError, match=r"no service 'nope' .*served: \['echo'\]"):
                ps.call(0, "nope", "describe", rank, torch.zeros(1))
            with pytest.raises(AttributeError, match="has no public method '_private'"):
                ps.call(0, "echo", "_private")
            with pytest.raises(ValueError, match=r"server_index must be in \[0, 1\)"):
                ps.call_async(1, "echo", "describe")
            # answers that come later: completed by this trainer's own next call (sent on the same
            # channel after that call's reply), by the other trainer's (sent from the server's pool)
            mine = ps.call_async(0, "echo", "later", f"mine{rank}")
            ps.call(0, "echo", "answer", f"mine{rank}", rank)
            assert mine.wait() == rank
            refused = ps.call_async(0, "echo", "later", f"refused{rank}")
            ps.call(0, "echo", "answer", f"refused{rank}", ValueError(f"late refusal for trainer{rank}"))
            with pytest.raises(ValueError, match=f"late refusal for trainer{rank}"):
                refused.wait()
            if rank == 0:
                assert ps.call_async(0, "echo", "later", "cross").wait() == "from trainer1"
            else:
                while not ps.call(0, "echo", "waiting", "cross"):
                    time.sleep(0.01)
                ps.call(0, "echo", "answer", "cross", "from trainer1")
            total = torch.ones(1)
            dist.all_reduce(total, group=roles.trainer_group)  # the trainer group excludes the server
            assert total.item() == 2.0
            loops = ps._channel(0)._loop_threads  # its session group's gloo loop, lowered (one host)
            result["loop_nice"] = [os.getpriority(os.PRIO_PROCESS, thread) for thread in loops]
            # a shared copy is named on the server's board, not copied into this trainer's lane;
            # the same bytes as a plain reply go through the lane
            lane_in, values = ps._channel(0)._lane_in, torch.arange(100_000.0)
            read_before = lane_in.released
            shared = ps.call(0, "echo", "shared", values)
            on_board = lane_in.released
            plain = ps.call(0, "echo", "describe", rank, values)["doubled"]
            result["lane_bytes"] = (on_board - read_before, lane_in.released - on_board)
            result["shared_equal"] = torch.equal(shared, values * 2) and torch.equal(plain, values * 2)
    finally:  # a failing trainer still releases the server from stop()
        result["opened"] = {(table, address) for table, address, _ in listening_sockets() - before}
        ps.stop()
    return result


def abort_and_barriers(rank: int, world_size: int) -> dict:
    """3 ranks, 1 server. The trainers meet in a barrier; trainer 0 waits alone in a second one (with
    a 1 s deadline); then trainer 1 aborts and trainer 0 waits in a third: what each rank saw, when."""
    ps = start_transport(num_servers=1)
    roles = ps.roles
    seen: dict = {}
    if roles.is_server:
        ps.serve("echo", Echo(roles.server_index))
        try:
            ps.stop()
        except PeerLost as error:
            seen["stop"] = (str(error), time.monotonic())
        return seen
    ps.barrier("both")  # both trainers arrive: no error
    if roles.trainer_index == 0:
        started = time.monotonic()
        with pytest.raises(PeerLost) as alone:
            ps.barrier("alone", timeout_s=1.0)
        seen["alone"] = (str(alone.value), time.monotonic() - started)
    dist.barrier(group=roles.trainer_group)  # trainer 1 aborts only once trainer 0 has given up
    if roles.trainer_index == 1:
        seen["aborted_at"] = time.monotonic()
        ps.abort(failure_message(roles, "ValueError('boom')"))
        return seen
    started = time.monotonic()
    with pytest.raises(PeerLost) as told:
        ps.barrier("after abort")
    seen["barrier"] = (str(told.value), time.monotonic() - started)
    with pytest.raises(PeerLost) as refused:
        ps.call(0, "echo", "describe", rank, torch.zeros(1))
    seen["call"] = str(refused.value)
    with pytest.raises(PeerLost) as stopped:
        ps.stop()
    seen["stop"] = (str(stopped.value), time.monotonic())
    return seen


WATCH_TIMEOUT_S = 2.0
"""The watched job's `timeout_s`: how long the server waits for a silent trainer's answer."""
WATCH_PING_S = 0.2
"""The watched job's `channel.PING_INTERVAL_S` (how often an idle channel beats)."""


def freeze_self(seconds: float) -> None:
    """Stop this process (SIGSTOP) for `seconds`: a shell continues it; returns once continued."""
    started = time.monotonic()
    subprocess.Popen(["sh", "-c", f"kill -STOP {os.getpid()}; sleep {seconds}; kill -CONT {os.getpid()}"])
    while time.monotonic() - started < seconds:  # the shell stops us in here
        time.sleep(0.02)


def stalls_watched(rank: int, world_size: int) -> dict:
    """3 ranks, 1 server, `timeout_s` WATCH_TIMEOUT_S. Trainer 1 freezes for half of it, then both
    trainers meet in a barrier; then it freezes for twice it, while trainer 0 keeps calling the
    server: what each rank saw, when (trainer 1 continues and calls once more, on a new session,
    while the server still answers: its grace outlasts the freeze)."""
    pinged_every, channel.PING_INTERVAL_S = channel.PING_INTERVAL_S, WATCH_PING_S
    grace, server_end.ABORT_GRACE_S = server_end.ABORT_GRACE_S, 2 * WATCH_TIMEOUT_S
    try:
        ps = start_transport(num_servers=1, timeout_s=WATCH_TIMEOUT_S, on_trainer_lost="fail")
        roles = ps.roles
        seen: dict = {}
        if roles.is_server:
            ps.serve("echo", Echo(roles.server_index))
        elif roles.trainer_index == 1:
            freeze_self(WATCH_TIMEOUT_S / 2)
            ps.call(0, "echo", "describe", rank, torch.zeros(1))
            ps.barrier("after the short freeze", timeout_s=30.0)
            seen["frozen_at"] = time.monotonic()
            freeze_self(2 * WATCH_TIMEOUT_S)
            with pytest.raises(PeerLost) as refused:
                ps.call(0, "echo", "describe", rank, torch.zeros(1))
            seen["call"] = str(refused.value)
        else:
            ps.barrier("after the short freeze", timeout_s=30.0)
            with pytest.raises(PeerLost) as refused:
                while True:
                    ps.call(0, "echo", "describe", rank, torch.zeros(1))
                    time.sleep(WATCH_PING_S)
            seen["call"] = (str(refused.value), time.monotonic())
        with pytest.raises(PeerLost) as stopped:
            ps.stop()
        seen["stop"] = (str(stopped.value), time.monotonic())
        return seen
    finally:
        channel.PING_INTERVAL_S, server_end.ABORT_GRACE_S = pinged_every, grace


class Counter:
    """A toy service that counts the pushes it applied; each push takes the time it is told."""

    def __init__(self) -> None:
        self.applied = 0
        self._lock = threading.Lock()

    def push(self, seconds: float) -> int:
        time.sleep(seconds)
        with self._lock:
            self.applied += 1
            return self.applied

    def count(self) -> int:
        return self.applied


PAUSE_RPC_TIMEOUT_S = 1.0
"""The paused job's `rpc_timeout_s` (a trainer's channel silence limit); its `timeout_s` is PAUSE_TIMEOUT_S."""
PAUSE_TIMEOUT_S = 20.0
PAUSE_S = 2.0
"""How long trainer 1 is stopped with a call in flight, and how long a push takes: both longer than
the RPC timeout, shorter than `timeout_s`."""
SERVER_STOP_S = 4.0
"""How long trainer 0 stops the server: longer than the RPC timeout and the new session after it."""


def paused_calls(rank: int, world_size: int) -> dict:
    """3 ranks, 1 server, `rpc_timeout_s` PAUSE_RPC_TIMEOUT_S, `timeout_s` PAUSE_TIMEOUT_S. Trainer 1
    sends a push and is stopped (SIGSTOP) for PAUSE_S right after, then sends a push the server takes
    PAUSE_S to apply, and loses its channel while that push runs (as a connection that drops): both
    calls outlive the RPC timeout on a live server. Then trainer 0 stops the server for
    SERVER_STOP_S and calls it: that call fails naming the server. Once the server is continued
    every rank stops normally: what each saw."""
    from dlrm.faults import exchange_pids  # the harness's helper; this file's torchrun run needs no dlrm

    pids = exchange_pids()
    alive_within, trainer_end.ALIVE_WITHIN_S = trainer_end.ALIVE_WITHIN_S, 1.0
    try:
        ps = start_transport(num_servers=1, timeout_s=PAUSE_TIMEOUT_S, rpc_timeout_s=PAUSE_RPC_TIMEOUT_S)
        roles = ps.roles
        seen: dict = {}
        if roles.is_server:
            ps.serve("counter", Counter())
        elif roles.trainer_index == 1:
            paused = ps.call_async(0, "counter", "push", 0.1)
            freeze_self(PAUSE_S)
            slow = ps.call_async(0, "counter", "push", PAUSE_S)
            time.sleep(PAUSE_S / 4)
            ps._channel(0)._fail(RuntimeError("test: the connection dropped"))  # the slow push is sent again
            seen["replies"] = [paused.wait(), slow.wait()]
            seen["applied"] = ps.call(0, "counter", "count")
            seen["retried"] = ps.retried_calls()
        dist.barrier()  # the default group: trainer 0 stops the server only after trainer 1's calls
        if roles.trainer_index == 0:
            server = pids[roles.server_ranks[0]]
            subprocess.Popen(["sh", "-c", f"kill -STOP {server}; sleep {SERVER_STOP_S}; kill -CONT {server}"])
            time.sleep(0.5)  # the shell has stopped it
            started = time.monotonic()
            with pytest.raises(PeerLost) as silent:
                ps.call(0, "counter", "push", 0.0)
            seen["silent_server"] = (str(silent.value), list(getattr(silent.value, "__notes__", [])),
                                     time.monotonic() - started)
            time.sleep(SERVER_STOP_S)  # the server is continued before the job stops
        if not roles.is_server:  # trainer 1 calls the server again (in stop()) once it is continued
            dist.barrier(group=roles.trainer_group)
        ps.stop()
        return seen
    finally:
        trainer_end.ALIVE_WITHIN_S = alive_within


LATE_S = 3.0
"""How long after the others trainer 1 starts the transport in `late_start`: longer than its timeout."""
LATE_TIMEOUT_S = 1.5


def late_start(rank: int, world_size: int) -> dict:
    """Trainer 1 reaches `Transport.start` LATE_S after the others (as a trainer that builds its
    model while a server starts at once), with a `timeout_s` of LATE_TIMEOUT_S, the trainer groups'
    own: when it started, how long each rank waited in `start`, and a call's result."""
    if rank == 1:
        time.sleep(LATE_S)
    started = time.monotonic()
    ps = start_transport(num_servers=1, timeout_s=LATE_TIMEOUT_S, lane_bytes=0)  # sync.ps.same_host: false
    seen = {"started": started, "waited": time.monotonic() - started}
    if ps.roles.is_server:
        ps.serve("counter", Counter())
        seen["board"] = ps._board is not None
    else:
        seen["applied"] = ps.call(0, "counter", "push", 0.0)
        seen["lanes"] = ps._channel(0).lanes
        seen["loop_nice"] = sorted({os.getpriority(os.PRIO_PROCESS, thread) for thread in ps._channel(0)._loop_threads})
        seen["own_nice"] = os.getpriority(os.PRIO_PROCESS, 0)  # the suite may run niced itself
    ps.stop()
    return seen


@pytest.fixture(scope="module")
def spawned() -> Mapping[str, list]:
    """The spawned-rank cases of this file in three groups of 3 ranks, run at once
    (`run_shared_concurrently`): the jobs mostly wait (freezes, stopped peers, a late start), and one
    after another in one group they took about 35 s. Each group holds about a third of that: the
    RPC-timeout job alone, the watched freezes after the plain calls (whose server keeps the short
    wait for an unknown service it sets, as it always has), the abort, the departure and the late
    start, each group in the order the jobs always ran. No job relies on another's state beyond
    that: each starts and stops its own transport, and restores the module settings it changes.
    (The dead-trainer tests below stay apart: their bound, under `trainer_timeout_s`, counts their
    processes' start, which 15 ranks starting at once on shared cores stretched past it.)"""
    return run_shared_concurrently(3, [
        {"paused": (paused_calls, ())},
        {"calls": (exercise_transport, ()), "stalls": (stalls_watched, ())},
        {"abort": (abort_and_barriers, ()), "departs": (stall_departs, ()), "late": (late_start, ())},
    ], timeout_s=160)


def test_roles_calls_and_remote_errors_on_three_spawned_ranks(spawned: Mapping[str, list]) -> None:
    results = spawned["calls"]
    assert [result["roles"].is_server for result in results] == [False, False, True]
    loopback = {("tcp", "0100007F"), ("tcp6", "00000000000000000000000001000000")}
    for result in results:  # the trainers' channels are open by now (the server's may still be building)
        assert result["opened"] <= loopback and (result["opened"] or result["roles"].is_server), result["opened"]
        if not result["roles"].is_server:
            assert result["loop_nice"] == [same_host.LOOP_NICE], result["loop_nice"]
            assert result["shared_equal"] and result["lane_bytes"][0] == 0 and result["lane_bytes"][1] >= 400_000, result


def test_a_trainer_that_starts_the_transport_later_than_its_timeout_still_joins(spawned: Mapping[str, list]) -> None:
    trainer0, trainer1, server = spawned["late"]
    assert trainer1["started"] - trainer0["started"] >= LATE_S - 0.5, (trainer0, trainer1)  # it did come late
    for seen in (trainer0, server):  # the others waited for it, past their timeout
        assert seen["waited"] >= LATE_S - 0.5 > LATE_TIMEOUT_S, seen
    assert {trainer0["applied"], trainer1["applied"]} == {1, 2}, (trainer0, trainer1)
    # the job ran without the same-host path: no lane mapped, no board, gloo's loop at its own priority
    assert server["board"] is False and trainer0["lanes"] == trainer1["lanes"] == (False, False), (trainer0, trainer1)
    for trainer in (trainer0, trainer1):
        assert trainer["loop_nice"] == [trainer["own_nice"]], (trainer0, trainer1)


def test_an_aborted_trainer_ends_every_barrier_call_and_stop_at_once_naming_it(spawned: Mapping[str, list]) -> None:
    trainer0, trainer1, server = spawned["abort"]
    message, waited = trainer0["alone"]
    assert message == ("trainer0 gave up in barrier 'alone#1' after 1s (sync.timeout_s): trainer 1 (rank 1) "
                       "neither arrived nor aborted (stuck, e.g. in a collective no peer will enter, or dead)"), message
    assert 1.0 <= waited < 5.0, waited
    aborted = "trainer 1 (rank 1) aborted: ValueError('boom')"
    message, waited = trainer0["barrier"]
    assert message == aborted and waited < 2.0, trainer0
    assert trainer0["call"].startswith(f"ps0 refuses echo.describe: the job failed: {aborted}"), trainer0["call"]
    for rank, seen in ((0, trainer0), (2, server)):
        message, ended = seen["stop"]
        assert message == aborted, (rank, message)
        # monotonic clocks of one machine: the server waits ABORT_GRACE_S for the trainers to read it
        assert ended - trainer1["aborted_at"] < server_end.ABORT_GRACE_S + 5.0, (rank, ended - trainer1["aborted_at"])


def test_a_trainer_frozen_for_less_than_the_timeout_carries_on_and_one_frozen_longer_is_lost(
        spawned: Mapping[str, list]) -> None:
    """The server's channel to each trainer: a freeze of half `timeout_s` passes unnoticed (the
    barrier after it meets both); one of twice `timeout_s` makes the server give up on trainer 1
    while it is still frozen, and every rank, trainer 1 once continued, ends naming it."""
    trainer0, trainer1, server = spawned["stalls"]
    lost = re.compile(r"trainer 1 \(rank 1\) stopped answering for [23] s \(sync\.timeout_s\); it probably died "
                      r"\(ps0's channel: .*\)$")
    message, told_at = trainer0["call"]
    assert message.startswith("ps0 refuses echo.describe: the job failed: trainer 1") and lost.search(message), message
    # monotonic clocks of one machine: trainer 0 is told while trainer 1 is still frozen (its last
    # answer may precede the freeze by a few pings on a loaded machine, hence no lower bound here;
    # the message's silence is at least the timeout, and the short freeze above was not lost)
    assert 0 < told_at - trainer1["frozen_at"] < 2 * WATCH_TIMEOUT_S, told_at - trainer1["frozen_at"]
    assert lost.search(trainer1["call"]), trainer1["call"]
    for seen in (trainer0, trainer1, server):
        assert lost.fullmatch(seen["stop"][0]), seen["stop"][0]


def test_a_call_that_outlives_the_rpc_timeout_on_a_live_server_is_retried_and_applied_once(
        spawned: Mapping[str, list]) -> None:
    """Trainer 1 stopped with a push in flight, and a push slower than the RPC timeout whose channel
    failed while it ran: both return (the slow one sent again on a new session), each applied once."""
    trainer1 = spawned["paused"][1]
    assert trainer1["replies"] == [1, 2] and trainer1["applied"] == 2, trainer1
    assert trainer1["retried"] >= 1, trainer1  # the slow push at least: its channel failed under it


def test_a_call_to_a_stopped_server_fails_naming_it_within_the_rpc_timeout_and_a_ping(spawned: Mapping[str, list]) -> None:
    message, notes, waited = spawned["paused"][0]["silent_server"]
    assert message.startswith("server 0 (ps0, rank 2) failed counter.push for trainer0: "), message
    assert "for trainer0: ps0 sent nothing for 1 s (" in message, message
    assert len(notes) == 1 and notes[0].startswith("shadowgba: ps0 accepted no new session within 1 s either"), notes
    assert waited < SERVER_STOP_S, waited  # told while the server is still stopped


def test_a_server_runs_each_call_number_once_and_forgets_the_replies_its_trainer_settled() -> None:
    replies, runs = server_end._Replies(), []

    def work(value: str) -> str:
        runs.append(value)
        return value

    assert replies.run_once(Caller(0, 0), lambda: work("first")) == "first"
    assert replies.run_once(Caller(0, 0), lambda: work("retry")) == "first"  # a retry: the first run's reply
    assert replies.run_once(Caller(1, 0), lambda: work("other trainer")) == "other trainer"
    assert replies.run_once(Caller(0, 1, (0,)), lambda: work("next")) == "next"  # trainer 0 settled call 0
    assert runs == ["first", "other trainer", "next"]
    assert sorted(replies._by_trainer[0]) == [1]  # call 0's reply is forgotten, call 1's kept
    calls = trainer_end._Calls()
    assert [calls.begin(0), calls.begin(1)] == [(0, ()), (1, ())]
    calls.settled(0, 0)
    calls.settled(1, 1)
    assert calls.begin(0) == (2, (0,)) and calls.begin(0) == (3, ()) and calls.begin(1) == (4, (1,))


def test_the_same_checks_pass_under_torchrun() -> None:
    """torchrun's agent owns MASTER_PORT; start() creates the default group and joins the agent's store."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", __file__]
    env = {**{key: value for key, value in os.environ.items() if key != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=with_checkout_path(env), capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the ranks share torchrun's stdout, so their lines may interleave
    assert sorted(re.findall(r"transport ok: (ps\d+|trainer\d+)", done.stdout)) == ["ps0", "trainer0", "trainer1"]


def trainer_dies(rank: int, world_size: int, trainer_timeout_s: float, on_trainer_lost: str = "fail") -> list:
    """3 ranks, 1 server: trainer 1 exits abruptly after a call; the others end up in stop(). The
    server's departures (on_trainer_lost continue)."""
    ps = start_transport(num_servers=1, on_trainer_lost=on_trainer_lost)
    roles = ps.roles
    if roles.is_server:
        ps.serve("echo", Echo(roles.server_index))
    elif roles.trainer_index == 1:
        ps.call(0, "echo", "describe", rank, torch.zeros(1))
        os._exit(3)  # no stop(), no exception, no goodbye: as a killed or crashed process
    ps.stop(trainer_timeout_s=trainer_timeout_s)
    return [(left.trainer, left.incarnation, left.why) for left in ps.roster.departures] if roles.is_server else []


def test_a_server_whose_trainer_died_fails_with_a_clear_error_instead_of_waiting_forever() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(trainer_dies, 3, 30.0, timeout_s=60)
    report = str(failed.value)
    assert time.monotonic() - started < 25, "a rank waited for trainer_timeout_s or the harness deadline"
    assert "ranks [1] hung or died without a result" in report, report
    # its connection is gone, and no new session came within RECONNECT_GRACE_S: well before trainer_timeout_s
    server_error = (
        r"PeerLost: trainer 1 \(rank 1\) stopped answering for [0-5] s \(its connection closed and no new session "
        r"came\); it probably died \(ps0's channel: trainer 1 \(rank 1\) closed its connection .+\)"
    )
    for rank in (0, 2):  # the server, and the surviving trainer that waited for it, both say why
        assert re.search(rf"rank {rank}:\n(?:(?!\nrank ).)*{server_error}", report, re.DOTALL), report


def test_a_dead_trainer_departs_under_continue_and_stop_ends_without_it() -> None:
    """on_trainer_lost continue: the server records the departure (its connection closed, no new
    session within RECONNECT_GRACE_S) and neither it nor the surviving trainer waits for it in stop()."""
    started = time.monotonic()
    trainer0, trainer1, server = run_ranks_outcomes(trainer_dies, 3, 30.0, "continue", timeout_s=60)
    assert trainer0.returned and server.returned, (trainer0, server)
    assert not trainer1.returned and trainer1.exitcode == 3, trainer1
    assert time.monotonic() - started < 25, "a rank waited for trainer_timeout_s or the harness deadline"
    [(trainer, incarnation, why)] = server.value
    assert (trainer, incarnation) == (1, 1), server.value
    assert re.match(r"trainer 1 \(rank 1\) stopped answering for [0-5] s \(its connection closed and no new "
                    r"session came\)", why), why


def stall_departs(rank: int, world_size: int) -> dict:
    """3 ranks, 1 server, on_trainer_lost continue, `timeout_s` WATCH_TIMEOUT_S: trainer 1 freezes
    (SIGSTOP) for twice it. What each rank saw: the server's departures; trainer 0's calls made
    meanwhile (they must all succeed) and its stop(); trainer 1's refused call once continued."""
    pinged_every, channel.PING_INTERVAL_S = channel.PING_INTERVAL_S, WATCH_PING_S
    try:
        ps = start_transport(num_servers=1, timeout_s=WATCH_TIMEOUT_S, on_trainer_lost="continue")
        roles = ps.roles
        seen: dict = {}
        if roles.is_server:
            ps.serve("echo", Echo(roles.server_index))
            ps.stop()
            seen["departures"] = [(left.trainer, left.incarnation, left.why) for left in ps.roster.departures]
        elif roles.trainer_index == 1:
            ps.call(0, "echo", "describe", rank, torch.zeros(1))
            freeze_self(2 * WATCH_TIMEOUT_S)
            with pytest.raises(PeerLost) as refused:
                ps.call(0, "echo", "describe", rank, torch.zeros(1))
            seen["call"] = str(refused.value)
            with pytest.raises(PeerLost):
                ps.stop()
        else:
            calls, until = 0, time.monotonic() + 4 * WATCH_TIMEOUT_S  # past trainer 1's freeze and refusal
            while time.monotonic() < until:
                ps.call(0, "echo", "describe", rank, torch.zeros(1))
                calls += 1
                time.sleep(WATCH_PING_S)
            seen["calls"] = calls
            ps.stop()
        return seen
    finally:
        channel.PING_INTERVAL_S = pinged_every


def test_a_trainer_stopped_past_the_timeout_departs_under_continue_and_is_refused_once_continued(
        spawned: Mapping[str, list]) -> None:
    trainer0, trainer1, server = spawned["departs"]
    [(trainer, incarnation, why)] = server["departures"]
    assert (trainer, incarnation) == (1, 1) and "(sync.timeout_s)" in why, server
    assert trainer0["calls"] >= 4 * WATCH_TIMEOUT_S / (2 * WATCH_PING_S), trainer0  # none failed, few were slow
    assert re.search(r"refused trainer1: trainer 1's process \(incarnation 1\) is no longer in the job \(it "
                     r"departed at \d\d:\d\d:\d\d: trainer 1 \(rank 1\) stopped answering", trainer1["call"]), trainer1


def test_roles_are_assigned_before_any_group_and_bad_server_counts_are_refused() -> None:
    roles = Roles.assign(rank=1, world_size=4, num_servers=2)
    assert (roles.trainer_ranks, roles.server_ranks, roles.trainer_index) == ((0, 1), (2, 3), 1)
    assert not roles.is_server and roles.server_index is None
    assert Roles.assign(rank=3, world_size=4, num_servers=2).name == "ps1"
    assert Roles.assign(rank=0, world_size=1, num_servers=0).trainer_ranks == (0,)
    for bad in (3, -1, 1.0, True):
        with pytest.raises(ValueError, match=r"num_servers must be an integer in \[0, world_size\)"):
            Roles.assign(rank=0, world_size=3, num_servers=bad)


def test_start_refuses_a_bad_server_count_before_creating_any_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens there: a group would fail differently
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="got 2 with world_size 2"):
        start_transport(num_servers=2)
    assert not dist.is_initialized()


if __name__ == "__main__":
    outcome = exercise_transport(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    print(f"transport ok: {outcome['roles'].name}", flush=True)


def test_a_trainer_stops_waiting_on_a_dead_server_process_once_a_newer_one_is_current() -> None:
    """A session request at server incarnation 1 fails at once, not after its `accept_within_s`,
    when incarnation 2 of that server has published itself (the old process is dead: a trainer
    reaches the restarted server sooner); with none newer it waits its whole time."""
    store = dist.HashStore()
    for within_s, newest in ((0.3, 1), (30.0, 2)):
        store.set(sessions._current_key(0, 0), str(newest))
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no acceptance of session .* by incarnation 1"):
            sessions.request_session(store, 0, 0, 1, trainer=0, rank=0, timeout_s=10.0, accept_within_s=within_s)
        waited = time.monotonic() - started
        assert (waited >= within_s) if newest == 1 else (waited < 1.0), (newest, waited)
