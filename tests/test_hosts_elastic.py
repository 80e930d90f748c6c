"""The elastic layout (`tests/test_elastic.py`) across simulated hosts (`ctrkit.cluster`): the
servers on host 0, trainers 0 and 2 on host 1, trainer 1 alone on host 2, every process started
on its own in its host's network namespace and meeting at server 0's store at host 0's address, so
that every trainer-server channel crosses a link.

- A trainer killed on one host (SIGKILL) is restarted on another: the server declares it departed
  (its connection closed and no new session came), the others train on, and the new process,
  from a different address, rejoins and trains; the job ends as on one machine.
- A trainer's host cut off (`Cluster.link_down`) past `sync.timeout_s`: the server hears nothing
  and declares it departed, the others train on during the outage; once the link is back, the
  cut-off process finds itself departed and ends naming why, and a new process of it on the same
  host rejoins and trains.

The job, its events and its assertions are test_elastic's (`lose_trainer_1`, `run_process`),
started on hosts (`OnHosts`). Needs root, like `tests/test_hosts.py` (`make test-hosts`); no
GLOO_SOCKET_IFNAME is set: the library finds the interface that reaches MASTER_ADDR itself.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from ctrkit import cluster as cluster_module
from ctrkit.cluster import Cluster
from ctrkit.events import Events
from shadowgba.ps.channel import PING_INTERVAL_S
from tests import fault_table
from tests.test_elastic import (SERVERS, TIMEOUT_S, TRAINERS, Outage,
                                assert_every_push_landed_and_the_restart_trained_on,
                                assert_the_fault_fired_and_the_others_carried_on, config, lose_trainer_1, run_process)

pytestmark = [
    pytest.mark.hosts,
    pytest.mark.timeout(150),
]

SERVER_HOST = 0
"""Where the servers run (server 0's store: MASTER_ADDR is this host's address)."""
TRAINER_HOSTS = {0: 1, 1: 2, 2: 1}
"""Each trainer's host when first started: trainer 1 alone on host 2, so that its link is its own."""
RATE = "1gbit"
WIRE_BYTES_PER_STEP = 1000
"""Bytes a link carries at least per step of the trainers whose traffic crosses it (lookups, pushes,
their replies, heartbeats; 2.5-6x that is measured): below it, the job did not cross that link."""
WATCH_S = 20.0
"""How long a started process may take to enter its host (`OnHosts`)."""
IDLE_WIRE_BYTES = 20_000
"""Bytes a link with no process of the job on it may still carry (IPv6 neighbour discovery, a
closed connection's last resets)."""


def run_on_host(namespace: str, master_addr: str, rank: int, port: int, fault: str, checkpoint_dir: str | None,
                finish: Any, send: Any) -> None:
    """`run_process` on the simulated host whose namespace is `namespace`, the job's store at
    `master_addr` (a forkserver child: it enters the host before it makes any thread or socket)."""
    cluster_module.enter(namespace)
    run_process(rank, port, fault, checkpoint_dir, finish, send, master_addr=master_addr)


def host_of(cluster: Cluster, pid: int) -> int | None:
    """The cluster host whose network namespace process `pid` is in (None: none of them, or gone)."""
    try:
        inode = os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None
    hosts = [host for host, name in enumerate(cluster.host_ns) if os.stat(f"/run/netns/{name}").st_ino == inode]
    return hosts[0] if hosts else None


class OnHosts:
    """test_elastic's `Launch` onto the cluster: servers on SERVER_HOST, trainers on TRAINER_HOSTS,
    trainer 1's restart on `restart_host`. Records the host each process was seen in from outside
    (`placed`, by (rank, start); `settle()` waits for the watchers) and every link's (received,
    sent) bytes just before the restart."""

    def __init__(self, cluster: Cluster, restart_host: int) -> None:
        self.cluster, self.restart_host = cluster, restart_host
        self.placed: dict[tuple[int, int], int | None] = {}
        self.wire_at_restart: list[tuple[int, int]] = []
        self._watchers: list[threading.Thread] = []

    def __call__(self, events: Events, rank: int, start: int, args: tuple) -> Any:
        host = self.restart_host if start > 1 else TRAINER_HOSTS.get(rank, SERVER_HOST)
        if start > 1:
            self.wire_at_restart = wire(self.cluster)
        process = events.start(run_on_host, (self.cluster.host_ns[host], self.cluster.address(SERVER_HOST), rank,
                                             *args))
        # watched on a thread: the harness must go on reading events at once (it injects the fault
        # at a step), while the child takes a while to unpickle its target and enter its host
        watcher = threading.Thread(target=self._watch, args=((rank, start), process), daemon=True)
        watcher.start()
        self._watchers.append(watcher)
        return process

    def _watch(self, key: tuple[int, int], process: Any) -> None:
        """Until `process` is seen in one of the cluster's hosts (it calls `enter` first thing), it
        ends, or WATCH_S pass."""
        seen, deadline = None, time.monotonic() + WATCH_S
        while seen is None and process.is_alive() and time.monotonic() < deadline:
            seen = host_of(self.cluster, process.pid)
            if seen is None:
                time.sleep(0.02)
        self.placed[key] = seen

    def settle(self) -> dict[tuple[int, int], int | None]:
        """`placed`, once every watcher is done."""
        for watcher in self._watchers:
            watcher.join(WATCH_S)
        return self.placed


class CutOff:
    """`lose_trainer_1`'s `cut_off` for host `host`: its link down, then up; every link's bytes
    just after the cut and just before the reconnection, and when each happened."""

    def __init__(self, cluster: Cluster, host: int) -> None:
        self.cluster, self.host = cluster, host
        self.wire_down: list[tuple[int, int]] = []
        self.wire_up: list[tuple[int, int]] = []
        self.down_at = self.up_at = 0.0

    def cut(self) -> None:
        self.cluster.link_down(self.host)
        self.down_at, self.wire_down = time.time(), wire(self.cluster)

    def reconnect(self) -> None:
        self.wire_up, self.up_at = wire(self.cluster), time.time()
        self.cluster.link_up(self.host)


def wire(cluster: Cluster) -> list[tuple[int, int]]:
    """Every host's (received, sent) bytes on its link so far."""
    return [cluster.wire_bytes(host) for host in range(cluster.num_hosts)]


def expected_placement(fault: str, restart_host: int) -> dict[tuple[int, int], int]:
    """(rank, start) -> host of every process `lose_trainer_1(fault, OnHosts(.., restart_host))` starts."""
    return {**{(rank, 1): host for rank, host in TRAINER_HOSTS.items()},
            **{(TRAINERS + index, 1): SERVER_HOST for index in range(SERVERS[fault])}, (1, 2): restart_host}


def show(outage: Outage, launch: OnHosts, end: list[tuple[int, int]], cut: CutOff | None = None) -> None:
    """Every process's events and the links' bytes, printed (pytest shows them when a test fails)."""
    print(outage.describe())
    print(f"placed (rank, start) -> host: {launch.settle()}")
    print(f"links (received, sent): at the restart {launch.wire_at_restart}, at the end {end}")
    if cut is not None:
        print(f"host {cut.host} cut at {cut.down_at:.2f} ({cut.wire_down}), reconnected at {cut.up_at:.2f} "
              f"({cut.wire_up})")


def steps_of(outage: Outage, trainers: set[int], after: float = 0.0, process: tuple[int, int] | None = None) -> int:
    """How many steps the processes of `trainers` (or just `process`) reported after the time `after`."""
    return sum(1 for s in outage.steps if s[0] in trainers and s[4] > after and (process is None or s[:2] == process))


def record(outage: Outage, fault: str, fault_at: float | None, **measured: Any) -> None:
    """The fault table's row of an elastic job that lost trainer 1 (`fault_table`): when each server
    declared it departed and when its new process started and first stepped, from the fault."""
    zero = fault_at or 0.0
    restarted_steps = [s[4] for s in outage.steps if s[:2] == (1, 2)]
    fault_table.record(fault, "elastic gba, 3 trainers + servers, 3 hosts",
                       departed_after_s=[final[4][0][2] - zero for final in outage.finals.values() if final[4]],
                       restarted_after_s=None if outage.restarted_at is None else outage.restarted_at - zero,
                       restart_first_step_after_s=restarted_steps[0] - zero if restarted_steps else None,
                       others_steps_until_restart=steps_of(outage, {0, 2}, after=zero)
                       - steps_of(outage, {0, 2}, after=outage.restarted_at or zero),
                       errors=[error[3][:160] for error in outage.errors], **measured)


def test_a_trainer_killed_on_one_host_rejoins_from_another() -> None:
    """Trainer 1 (host 2, alone) is SIGKILLed at its KILL_AT_STEP-th step; once the servers have
    declared it departed (its connection closed, no new session within RECONNECT_GRACE_S), it is
    started again on host 1, beside trainers 0 and 2: test_elastic's `kill` assertions hold across
    hosts, and the links carried the job (host 2's only until the kill)."""
    with Cluster(3, rate=RATE) as cluster:
        launch = OnHosts(cluster, restart_host=1)
        started = time.monotonic()
        outage = lose_trainer_1("kill", launch)
        took, end = time.monotonic() - started, wire(cluster)
    show(outage, launch, end)
    print(f"the job took {took:.1f} s")
    record(outage, "a trainer killed (SIGKILL), restarted on another host", outage.killed_at)
    # every process came up on its host; trainer 1's restart on another host than its first process's
    assert launch.settle() == expected_placement("kill", 1), launch.placed
    # the fault fired and the job went on (test_elastic's own assertions of its `kill` fault)
    assert_the_fault_fired_and_the_others_carried_on(outage, "kill")
    assert_every_push_landed_and_the_restart_trained_on(outage, "kill")
    for _, _, _, _, departures, _ in outage.finals.values():  # each server's own verdict
        [(_, _, _, why)] = departures
        assert "trainer 1 (rank 1) stopped answering" in why, why
    # which process reported what: one error-free end per trainer process that was not killed
    assert sorted(final[1:3] for final in outage.trainer_finals) == [(0, 1), (1, 2), (2, 1)], outage.trainer_finals
    # the links carried it: host 2's the first trainer 1's steps, and nothing after it was killed;
    # host 1's the survivors' and the restarted process's; host 0's every step, in and out
    restart = launch.wire_at_restart
    assert restart[2][1] >= WIRE_BYTES_PER_STEP * steps_of(outage, {1}, process=(1, 1)), (restart, end)
    assert end[2][0] - restart[2][0] + end[2][1] - restart[2][1] < IDLE_WIRE_BYTES, (restart, end)
    after_restart = steps_of(outage, {0, 1, 2}, after=outage.restarted_at)
    assert end[1][1] - restart[1][1] >= WIRE_BYTES_PER_STEP * after_restart, (restart, end, after_restart)
    assert min(end[0]) >= WIRE_BYTES_PER_STEP * len(outage.steps), end


def test_a_trainer_host_cut_off_past_the_timeout_departs_and_its_restart_rejoins() -> None:
    """Trainer 1's host (host 2, trainer 1 alone) loses its link at trainer 1's KILL_AT_STEP-th
    step for twice `sync.timeout_s` (4 s, the `stop` fault's): the servers hear nothing from it and declare it departed
    after `timeout_s`, while trainers 0 and 2 (host 1) train on; once the link is back, the cut-off
    process learns that it left and ends naming why, and a new process of it on host 2 rejoins."""
    fault = "stop"  # test_elastic's short sync.timeout_s, and its outage of twice that
    timeout_s = TIMEOUT_S[fault]
    with Cluster(3, rate=RATE) as cluster:
        launch, cut = OnHosts(cluster, restart_host=2), CutOff(cluster, host=2)
        started = time.monotonic()
        outage = lose_trainer_1(fault, launch, cut_off=(cut.cut, cut.reconnect))
        took, end = time.monotonic() - started, wire(cluster)
    show(outage, launch, end, cut)
    print(f"the job took {took:.1f} s")
    record(outage, f"a trainer's host cut off for {cut.up_at - cut.down_at:.0f} s (sync.timeout_s {timeout_s:g})",
           cut.down_at, reconnected_after_s=cut.up_at - cut.down_at)
    assert launch.settle() == expected_placement(fault, 2), launch.placed
    killed_at = outage.killed_at
    # the fault fired: host 2 received nothing while cut off; it was cut for twice the timeout
    assert cut.wire_down[2][0] == cut.wire_up[2][0], (cut.wire_down, cut.wire_up)
    assert cut.down_at <= killed_at and cut.up_at - cut.down_at >= 2 * timeout_s, (cut.down_at, cut.up_at)
    # trainer 1's first process stalled (its lookups wait for the servers) ...
    in_flight = config(fault).gba.queue_size + 2
    assert steps_of(outage, {1}, after=killed_at, process=(1, 1)) <= in_flight, outage.describe()
    # ... while the others kept training, and the global step kept advancing, during the cut
    for index in (0, 2):
        during = [s[3] for s in outage.steps if s[0] == index and cut.down_at < s[4] < cut.up_at]
        assert len(during) >= 10 and during[-1] > during[0], (index, during)
    # test_elastic's `stop` assertions: the servers declared it departed after sync.timeout_s (and
    # nobody else), the process ended by itself (exit 1) saying it is no longer in the job, the
    # restart rejoined and trained, every other process ended with exit code 0. Cutting a link takes
    # a moment (netlink, then every link's counters read) in which trainer 1, about 30 ms a step,
    # steps on until its lookups wait: the cut lands up to 3 steps after KILL_AT_STEP (2 seen once)
    assert_the_fault_fired_and_the_others_carried_on(outage, fault, late_steps=3)
    assert_every_push_landed_and_the_restart_trained_on(outage, fault)
    for _, index, _, _, departures, _ in outage.finals.values():
        [(_, _, left_at, why)] = departures
        assert why.startswith("trainer 1 (rank 1) stopped answering for ") and "(sync.timeout_s)" in why, why
        # the server decided on its own, from the silence: not before timeout_s of it, and while cut off
        assert timeout_s - PING_INTERVAL_S - 0.5 <= left_at - cut.down_at and left_at < cut.up_at, \
            (index, left_at - cut.down_at, cut.up_at - cut.down_at)
    [(_, _, _, message)] = outage.errors
    assert "stopped answering" in message and "start the trainer again to rejoin" in message, message
    assert sorted(final[1:3] for final in outage.trainer_finals) == [(0, 1), (1, 2), (2, 1)], outage.trainer_finals
    # the links carried it: host 2's trainer 1's steps before the cut and after the restart
    assert cut.wire_down[2][1] >= WIRE_BYTES_PER_STEP * steps_of(outage, {1}, process=(1, 1)), cut.wire_down
    rejoined = steps_of(outage, {1}, process=(1, 2))
    assert end[2][1] - launch.wire_at_restart[2][1] >= WIRE_BYTES_PER_STEP * rejoined, (launch.wire_at_restart, end)
