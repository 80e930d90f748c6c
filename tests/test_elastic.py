"""The elastic layout: a GBA job with PS-hosted tables whose trainers leave and rejoin while the
server and the other trainers keep running (`sync.ps.num_trainers`, `sync.ps.on_trainer_lost`), and
the same for S-EASGD's centre on the server (`easgd_ps`).

Every process is started on its own (no torchrun, no process group): the servers and 3 trainers
meet at server 0's store by `SHADOWGBA_RANK`. The test kills trainer 1 (SIGKILL) mid-run and
waits past `RECONNECT_GRACE_S`, or stops it (SIGSTOP) for twice `sync.timeout_s` and continues it
(then the process must find itself departed and exit naming why), so that the server decides on
its own that it left; then it starts trainer 1 again as a new process, and lets every trainer
finish once the new one has trained. The last test kills the server instead: it runs as a torchrun
job of its own, which restarts it, and resumes from its own checkpoint.

Each case is a job of its own (its processes, its store's port, its folders), and most of its time
is waiting: for a lost trainer to be declared departed, for its restart, for torchrun to bring a
server back. So a module fixture (`outages`) runs the jobs side by side, and each test asserts on
its own job's record.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import shadowgba
from shadowgba.config import SyncConfig
from shadowgba.gba.config import GBAConfig
from shadowgba.job.config import PSConfig
from shadowgba.ps.easgd_center import CENTER_SERVICE
from shadowgba.ps.embedding_shard import DEFAULT_SERVICE
from shadowgba.job.rendezvous import ELASTIC_RANK
from shadowgba.ps.server_end import RECONNECT_GRACE_S
from ctrkit.events import Events
from tests.multiprocess import CHECKOUT, CaseResults, _context, free_port, run_concurrently, with_checkout_path

pytestmark = pytest.mark.timeout(300)  # the first test to read a job waits for every job (`outages`)

TRAINERS = 3
BATCH = 4
TABLE = EmbeddingBagConfig(name="items", num_embeddings=50, embedding_dim=4, feature_names=["item"])
KILL_AT_STEP = 15
"""Trainer 1's first process is killed once it has reported this many steps."""
REJOINED_STEPS = 15
"""Steps the restarted trainer 1 reports before the test lets every trainer finish."""
MAX_STEPS = 2000
"""Bound on any trainer's steps (a test that never signals the end fails, it does not hang)."""


TIMEOUT_S = {"kill": 10.0, "stop": 4.0, "server": 10.0, "easgd": 10.0, "easgd_server": 10.0}
"""`sync.timeout_s` per fault: a stop must outlast it, so it is short there."""
SERVERS = {"kill": 2, "stop": 1, "server": 1, "easgd": 1, "easgd_server": 2}
"""Servers per fault: with two, the dense vector has two shards, and a departed trainer's decided
push that never reached shard 1 must not stall it (its void closes the gap); under `easgd_server`
both servers are one torchrun job, which restarts them together."""
EASGD_FAULTS = ("easgd", "easgd_server")
"""The faults run under S-EASGD (`easgd_ps`); the others under GBA."""
EASGD_INTERVAL_MS = 20.0
"""The `easgd` faults (S-EASGD): the shadow thread's pacing, by time alone (`max_round_share` and
`max_step_cost` 1): the assertions count exchanges in windows of a few seconds."""
SERVER_CHECKPOINT_EVERY = 5
"""The `server` faults: global steps (exchanges with a centre slice) between a server's own checkpoints."""
SERVER_KILL_AT = 20
"""The `server` faults: a server is killed once a trainer reports this global step (exchanges)."""


JOIN_S = 8.0
"""How long the processes get to end once the test lets them finish (within pytest's timeout)."""


def join_or_kill(processes: list[Any], joined_by: float) -> None:
    """Join `processes` until the monotonic time `joined_by`; kill any still alive then."""
    for process in processes:
        process.join(max(0.0, joined_by - time.monotonic()))
        if process.is_alive():
            process.kill()


def config(fault: str, checkpoint_dir: str | None = None) -> SyncConfig:
    restart = dict(checkpoint_dir=checkpoint_dir, checkpoint_every=SERVER_CHECKPOINT_EVERY,
                   server_restart_s=30.0) if fault in ("server", "easgd_server") else {}
    return SyncConfig(algo="easgd_ps" if fault in EASGD_FAULTS else "gba", timeout_s=TIMEOUT_S[fault],
                      interval_ms=EASGD_INTERVAL_MS, max_round_share=1.0, max_step_cost=1.0, ps=PSConfig(
        num_servers=SERVERS[fault], num_trainers=TRAINERS, rpc_timeout_s=TIMEOUT_S[fault], on_trainer_lost="continue",
        **restart), gba=GBAConfig(initial_mode="gba"))


class Model(nn.Module):
    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings, self.top = embeddings, nn.Linear(4, 1)

    def forward(self, ids: KeyedJaggedTensor) -> torch.Tensor:
        return self.top(self.embeddings(ids).values())


def run_process(rank: int, port: int, fault: str, checkpoint_dir: str | None, finish: Any,
                send: Callable[[tuple], None], master_addr: str = "127.0.0.1") -> None:
    """One process of the job (`rank`: its SHADOWGBA_RANK; server 0's store at `master_addr`:`port`):
    a trainer reports ("start", trainer, incarnation, how far its dense weights moved from the
    seeded ones when its sync started), then every step as (trainer, incarnation, step, progress,
    time) until `finish` is set (progress: the global step; under S-EASGD its exchanges with the
    centre), then ("final", trainer, incarnation, its metrics, row pushes lost to a server's
    restart), and what ended it if it raised ("error", trainer, incarnation, message); a server
    reports its index, pid, its dense shard's stats (S-EASGD: its centre slice's), its departures
    and its tables' stats when the job is over (`checkpoint_dir`: the `server` faults' server
    checkpoints)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(port), **{ELASTIC_RANK: str(rank)})
    sync_config = config(fault, checkpoint_dir)
    options = shadowgba.ps_table_options(sync_config, TRAINERS, BATCH, lr=0.05)
    job = shadowgba.join(sync_config, tables=[TABLE], table_options=options)
    if job.is_server:
        dense = job.served[CENTER_SERVICE if fault in EASGD_FAULTS else "dense"].stats()
        send(("server", rank - TRAINERS, os.getpid(), dense,
              [dataclasses.astuple(left) for left in job.transport.roster.departures],
              job.served[DEFAULT_SERVICE].stats()))
        return
    torch.manual_seed(0)
    embeddings = job.ps_embeddings()
    model = Model(embeddings)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    incarnation = job.transport.incarnation
    try:
        train(job.trainer_index, incarnation, model, embeddings, optimizer, job, send, finish)
    except Exception as error:
        send(("error", job.trainer_index, incarnation, str(error)))
        raise


def train(trainer: int, incarnation: int, model: nn.Module, embeddings: Any, optimizer: torch.optim.Optimizer,
          job: shadowgba.Job, send: Callable[[tuple], None], finish: Any) -> None:
    generator = torch.Generator().manual_seed(trainer)
    seeded = model.top.weight.detach().clone()
    with shadowgba.dense_sync(model, optimizer, job, local_batch_size=BATCH) as sync:
        send(("start", trainer, incarnation, float((model.top.weight - seeded).abs().max())))
        for step in range(1, MAX_STEPS + 1):
            ids = KeyedJaggedTensor.from_lengths_sync(
                keys=["item"], values=torch.randint(0, 50, (BATCH,), generator=generator),
                lengths=torch.ones(BATCH, dtype=torch.int32))
            loss = model(ids).square().mean()
            loss.backward()
            embeddings.push_gradients()
            optimizer.step()
            optimizer.zero_grad()
            progress = sync.metrics.rounds if job.config.algo == "easgd_ps" else sync.global_step
            send((trainer, incarnation, step, progress, time.time()))
            if finish.is_set():
                break
            time.sleep(0.02)
        embeddings.flush()
    metrics = {"server_restarts": job.transport.server_restarts, **sync.metrics.summary()}  # GBA counts its own
    send(("final", trainer, incarnation, metrics, embeddings.pushes_lost_to_restart))


@dataclasses.dataclass
class Outage:
    """What a job that lost trainer 1 and restarted it recorded (`lose_trainer_1`)."""

    steps: list[tuple[int, int, int, int, float]]
    starts: list[tuple]
    """("start", trainer, incarnation, distance from the seeded weights) of every trainer process."""
    errors: list[tuple]
    finals: dict[int, tuple]
    """The servers' reports, by server index."""
    trainer_finals: list[tuple]
    """("final", trainer, incarnation, metrics, lost row pushes) of every trainer process that ended its loop."""
    servers: list[Any]
    trainers: dict[int, Any]
    killed_at: float | None
    restarted_at: float | None
    continued_exit: int | None
    """The exit code of trainer 1's first process."""

    def describe(self) -> str:
        """Every process's events, for a failure's message: each trainer process's start, steps
        (how many, the first and the last), error and end, and each server's report."""
        zero = min([s[4] for s in self.steps] or [0.0])
        lines = [f"lost at {None if self.killed_at is None else round(self.killed_at - zero, 2)} s, restarted at "
                 f"{None if self.restarted_at is None else round(self.restarted_at - zero, 2)} s (times from the "
                 f"first step); trainer 1's first process exited {self.continued_exit}"]
        for process in sorted({s[:2] for s in self.steps} | {e[1:3] for e in self.starts + self.errors
                                                                 + self.trainer_finals}):
            ours = [s for s in self.steps if s[:2] == process]
            lines.append(f"trainer {process[0]} incarnation {process[1]}: "
                         f"{[e[3:] for e in self.starts if e[1:3] == process]} started, {len(ours)} steps"
                         + (f" (first {ours[0][2:4]} at {ours[0][4] - zero:.2f} s, last {ours[-1][2:4]} at "
                            f"{ours[-1][4] - zero:.2f} s)" if ours else "")
                         + f", errors {[e[3] for e in self.errors if e[1:3] == process]}"
                         + f", final {[e[3:] for e in self.trainer_finals if e[1:3] == process]}")
        for index, server in enumerate(self.servers):
            lines.append(f"server {index} (pid {server.pid}, exit {server.exitcode}): {self.finals.get(index)}")
        return "\n".join(lines)


Launch = Callable[[Events, int, int, tuple], Any]
"""How `lose_trainer_1` starts a process: `launch(events, rank, start, args)` starts
`run_process(rank, *args, send)` as a child of `events` and returns it (`start`: 1 for a rank's
first process, 2 for trainer 1's restart)."""


def launch_here(events: Events, rank: int, start: int, args: tuple) -> Any:
    """`Launch` on this machine, the store on loopback."""
    return events.start(run_process, (rank, *args))


def lose_trainer_1(fault: str, launch: Launch = launch_here,
                   cut_off: tuple[Callable[[], None], Callable[[], None]] | None = None) -> Outage:
    """Run the job, lose trainer 1's process once it reported KILL_AT_STEP steps (`stop`: SIGSTOP,
    continued after twice `sync.timeout_s`; otherwise SIGKILL, restarted after RECONNECT_GRACE_S),
    start it again, and let every trainer finish once the new process reported REJOINED_STEPS steps.
    `launch` starts each process (`Launch`); `cut_off` = (cut, reconnect) loses trainer 1's process
    by `cut()` (e.g. its host's link down) instead of a signal, and `reconnect()` instead of SIGCONT."""
    context = _context()
    events, finish, port = Events(context), context.Event(), free_port()
    errors: list[tuple] = []
    starts: list[tuple] = []
    trainer_finals: list[tuple] = []

    def start(rank: int, count: int = 1) -> Any:
        return launch(events, rank, count, (port, fault, None, finish))

    servers = [start(TRAINERS + index) for index in range(SERVERS[fault])]
    trainers = {index: start(index) for index in range(TRAINERS)}
    steps: list[tuple[int, int, int, int, float]] = []
    finals: dict[int, tuple] = {}
    killed_at = restarted_at = continued_exit = None
    outage_s = 2 * TIMEOUT_S[fault] if fault == "stop" else RECONNECT_GRACE_S + 1
    deadline = time.monotonic() + 50
    try:
        # a trainer reports its end after its part of the job, which may be after the servers'
        while (len(finals) < len(servers) or len(trainer_finals) < TRAINERS) and time.monotonic() < deadline:
            event = events.receive(timeout_s=0.5)
            if event is not None and event[0] == "server":
                finals[event[1]] = event
                continue
            if event is not None:
                {"error": errors, "start": starts, "final": trainer_finals}.get(event[0], steps).append(event)
            ours = [s for s in steps if s[0] == 1]
            if killed_at is None and ours and ours[-1][2] >= KILL_AT_STEP:
                if cut_off is not None:
                    cut_off[0]()
                else:
                    os.kill(trainers[1].pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
                killed_at = time.time()
            elif killed_at is not None and restarted_at is None and time.time() > killed_at + outage_s:
                if cut_off is not None:
                    cut_off[1]()
                elif fault == "stop":
                    os.kill(trainers[1].pid, signal.SIGCONT)
                trainers[1].join(15)  # a continued process must end by itself, naming why
                continued_exit = trainers[1].exitcode
                trainers[1] = start(1, 2)
                restarted_at = time.time()
            elif restarted_at is not None and sum(1 for s in ours if s[1] == 2) >= REJOINED_STEPS:
                finish.set()
    finally:
        finish.set()
        join_or_kill([*servers, *trainers.values()], time.monotonic() + JOIN_S)
    outage = Outage(steps, starts, errors, finals, trainer_finals, servers, trainers, killed_at, restarted_at,
                    continued_exit)
    assert len(finals) == len(servers), f"a server never reported the end of the job:\n{outage.describe()}"
    return outage


def assert_the_fault_fired_and_the_others_carried_on(outage: Outage, fault: str, late_steps: int = 1) -> None:
    """Trainer 1's first process was lost at its KILL_AT_STEP-th step or at most `late_steps` after;
    the survivors kept training during the outage on the same server processes, which decided on
    their own that it left (and nobody else); every process ended with exit code 0 but a killed one."""
    steps, killed_at, restarted_at = outage.steps, outage.killed_at, outage.restarted_at
    first = [s for s in steps if s[:2] == (1, 1)]
    before = [s for s in first if s[4] <= killed_at]  # a continued process may report a step before it fails
    assert killed_at is not None and before and KILL_AT_STEP <= before[-1][2] <= KILL_AT_STEP + late_steps, first[-3:]
    if fault == "stop":  # continued, it learnt that it had left, and ended by itself saying so
        [(_, trainer, incarnation, message)] = outage.errors
        assert (trainer, incarnation) == (1, 1) and outage.continued_exit == 1, (outage.errors, outage.continued_exit)
        assert "trainer 1's process (incarnation 1) is no longer in the job (it departed at" in message, message
    else:
        assert outage.continued_exit == -signal.SIGKILL and not outage.errors, (outage.continued_exit, outage.errors)
        assert not any(s[:2] == (1, 1) and s[4] > killed_at for s in steps)
    for index in (0, 2):
        during = [s for s in steps if s[0] == index and killed_at < s[4] < restarted_at]
        assert len(during) >= 10, (index, len(during))
    assert [outage.finals[index][2] for index in range(len(outage.servers))] == [s.pid for s in outage.servers]
    assert all(server.exitcode == 0 for server in outage.servers), [server.exitcode for server in outage.servers]
    assert all(p.exitcode == 0 for p in outage.trainers.values()), [p.exitcode for p in outage.trainers.values()]
    for _, _, _, _, departures, _ in outage.finals.values():
        [(trainer, incarnation, left_at, why)] = departures
        assert (trainer, incarnation) == (1, 1) and killed_at < left_at < restarted_at, departures
        assert ("(sync.timeout_s)" if fault == "stop" else "its connection closed and no new session came") in why, why
    rejoined = [s for s in steps if s[:2] == (1, 2)]
    assert len(rejoined) >= REJOINED_STEPS, len(rejoined)


AT_ONCE = 2
"""Jobs of `outages` run at a time. The assertions read the job's progress against the harness's
clock: trainer 1 lost within a step of KILL_AT_STEP (the harness must keep up with trainers
stepping every 20 ms), the survivors' steps during the outage (at least 10 each), a server killed
within a checkpoint interval of SERVER_KILL_AT. Each job's 4 or 5 processes step all the time, and
torchrun's restart imports torch afresh: at 3 jobs on 2 cores shared with other work, a survivor
took no step in a 4 s outage; at 2 the survivors kept their margin (over 100 steps each in it)."""


@pytest.fixture(scope="module")
def outages(tmp_path_factory: pytest.TempPathFactory) -> CaseResults:
    """Every job of this file by fault, AT_ONCE at a time (`run_concurrently`): a server lost (`server`,
    `easgd_server`: `ServerOutage`) or a trainer (`kill`, `stop`, `easgd`: `Outage`), in an order that
    starts each torchrun job beside a trainer's loss rather than beside the other torchrun job (the
    restarts' imports are the jobs' heaviest part)."""
    return run_concurrently({
        "server": functools.partial(kill_a_server, "server", tmp_path_factory.mktemp("server")),
        "kill": functools.partial(lose_trainer_1, "kill"),
        "easgd_server": functools.partial(kill_a_server, "easgd_server", tmp_path_factory.mktemp("easgd_server")),
        "stop": functools.partial(lose_trainer_1, "stop"), "easgd": functools.partial(lose_trainer_1, "easgd"),
    }, at_once=AT_ONCE)


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_lost_trainer_departs_the_others_carry_on_and_its_restart_rejoins(outages: CaseResults, fault: str) -> None:
    """`kill`: SIGKILL, the server decides after RECONNECT_GRACE_S. `stop`: SIGSTOP for twice
    `sync.timeout_s`, then SIGCONT: the server decided after `timeout_s` of silence, and the
    continued process finds itself departed and exits naming why (no hang)."""
    outage = outages[fault]
    assert_the_fault_fired_and_the_others_carried_on(outage, fault)
    assert_every_push_landed_and_the_restart_trained_on(outage, fault)


def assert_every_push_landed_and_the_restart_trained_on(outage: Outage, fault: str) -> None:
    """GBA: every dense shard ended at the same global step with nothing pending, the restarted
    trainer 1 started from where the first one had got to, and every push of the survivors and the
    restarted process reached the servers (of the lost one, all but those in flight)."""
    steps, finals, killed_at = outage.steps, outage.finals, outage.killed_at
    first = [s for s in steps if s[:2] == (1, 1)]
    before = [s for s in first if s[4] <= killed_at]
    _, _, _, dense, _, _ = finals[0]
    pushes, global_step = dense["pushes_by_trainer"], dense["global_step"]
    # every other shard applied every decision (by its part or its void) and ended at shard 0's k
    for _, index, _, other, _, _ in finals.values():
        assert (other["global_step"], other["pending_pushes"]) == (global_step, 0), (index, other)
    # the restarted process rejoined and trained on the current parameters, not on fresh ones
    rejoined = [s for s in steps if s[:2] == (1, 2)]
    assert len(rejoined) >= REJOINED_STEPS, len(rejoined)
    assert rejoined[0][3] >= first[-1][3] > 0, (rejoined[0], first[-1])
    # every push of the survivors and of the rejoined process landed; of the killed one, all but at
    # most its in-flight batches (the queue, the push on its way, and the step it did not report)
    for index in (0, 2):
        assert pushes[index] == sum(1 for s in steps if s[0] == index), (index, pushes)
    in_flight = config(fault).gba.queue_size + 2
    assert len(before) + len(rejoined) - in_flight <= pushes[1] <= len(first) + len(rejoined) + 1, (pushes, len(first))
    assert 0 < global_step <= sum(pushes.values()) // TRAINERS, (global_step, pushes)  # kept samples / global batch


def test_the_s_easgd_centre_loses_a_trainer_takes_fewer_exchanges_and_its_restart_starts_at_the_centre(
        outages: CaseResults) -> None:
    """S-EASGD (`easgd_ps`) in the elastic layout: trainer 1 is SIGKILLed; the centre keeps taking the
    survivors' exchanges (nothing waits for the lost one: it holds no token, no share of a batch),
    and the restarted process starts from the centre as it is, not from its own initial weights."""
    outage = outages["easgd"]
    assert_the_fault_fired_and_the_others_carried_on(outage, "easgd")
    steps, killed_at, restarted_at = outage.steps, outage.killed_at, outage.restarted_at
    # the survivors exchanged with the centre during the outage
    for index in (0, 2):
        during = [s[3] for s in steps if s[0] == index and killed_at < s[4] < restarted_at]
        assert during[-1] - during[0] >= 5, (index, during[0], during[-1])
    # every exchange the trainers counted reached the one centre: the survivors' and the rejoined
    # process's all (at the end), the killed one's at least until its last step (its rounds after
    # that are unknown to the test, its last one perhaps half done)
    [(_, _, _, centre, _, _)] = outage.finals.values()
    centre_rounds = centre["rounds"]
    assert sorted(final[1:3] for final in outage.trainer_finals) == [(0, 1), (1, 2), (2, 1)], outage.trainer_finals
    ended = sum(metrics["rounds"] for _, _, _, metrics, _ in outage.trainer_finals)
    killed_rounds = max(s[3] for s in steps if s[:2] == (1, 1))
    assert ended + killed_rounds <= centre_rounds, (ended, killed_rounds, centre_rounds)
    # the first process to come started the centre at its (seeded) weights and started there; one
    # that came later starts where the others' exchanges had moved it: the restarted one surely
    distance = {(trainer, incarnation): moved for _, trainer, incarnation, moved in outage.starts}
    assert set(distance) == {(0, 1), (1, 1), (2, 1), (1, 2)}, distance
    assert min(distance[(index, 1)] for index in range(TRAINERS)) == 0.0 < distance[(1, 2)], distance


@dataclasses.dataclass
class ServerOutage:
    """What a job whose first server worker was killed and restarted by torchrun recorded (`kill_a_server`)."""

    steps: list[tuple[int, int, int, int, float]]
    """(trainer, incarnation, step, progress, time) of every trainer step."""
    finals: dict[int, tuple]
    """("final", trainer, incarnation, its metrics, lost row pushes) by trainer."""
    errors: list[tuple]
    trainers: list[Any]
    killed: int | None
    """The pid of the worker killed."""
    killed_at: float | None
    killed_step: int | None
    """The largest progress any trainer had reported when it was killed."""
    server_exit: int | None
    """torchrun's exit code."""
    output: str
    """torchrun's output."""
    report: Path
    """Each server process's report of the end of the job (`serve_under_torchrun`)."""
    checkpoint_dir: Path


def kill_a_server(fault: str, tmp_path: Path) -> ServerOutage:
    """The job of `test_a_killed_server_restarts_from_its_own_checkpoint_and_the_trainers_carry_on`
    (its docstring), its folders under `tmp_path`: start the servers under torchrun and the 3
    trainers, kill the first worker once a trainer reports SERVER_KILL_AT, and let every trainer
    finish once each has taken 10 steps after the kill."""
    context = _context()
    events, finish, port = Events(context), context.Event(), free_port()
    checkpoint_dir, report, servers = tmp_path / "ckpt", tmp_path / "server.jsonl", SERVERS[fault]
    server = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={servers}",
         "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=1", "--monitor-interval=0.5",
         "-m", "tests.test_elastic", str(port), str(checkpoint_dir), str(report), fault],
        cwd=CHECKOUT, env=with_checkout_path({**os.environ, "OMP_NUM_THREADS": "1"}),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    trainers = [events.start(run_process, (index, port, fault, str(checkpoint_dir), finish))
                for index in range(TRAINERS)]
    steps: list[tuple[int, int, int, int, float]] = []
    finals: dict[int, tuple] = {}
    errors: list[tuple] = []
    killed = killed_at = killed_step = None
    deadline = time.monotonic() + 45
    try:
        while len(finals) < TRAINERS and time.monotonic() < deadline:
            event = events.receive(timeout_s=0.5)
            if event is not None:
                kind = event[0]
                if kind == "final":
                    finals[event[1]] = event
                elif kind != "start":
                    (errors if kind == "error" else steps).append(event)
            if killed_at is None and steps and steps[-1][3] >= SERVER_KILL_AT:
                killed = int(Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()[0])  # a worker
                os.kill(killed, signal.SIGKILL)
                killed_at, killed_step = time.time(), max(step[3] for step in steps)
            elif killed_at is not None and all(sum(1 for step in steps if step[0] == index and step[4] > killed_at) >= 10
                                               for index in range(TRAINERS)):
                finish.set()
    finally:
        finish.set()
        joined_by = time.monotonic() + JOIN_S
        join_or_kill(trainers, joined_by)
        try:
            output, _ = server.communicate(timeout=max(1.0, joined_by - time.monotonic()))
        except subprocess.TimeoutExpired:
            server.kill()
            output, _ = server.communicate()
    return ServerOutage(steps, finals, errors, trainers, killed, killed_at, killed_step, server.returncode, output,
                        report, checkpoint_dir)


@pytest.mark.parametrize("fault", ["server", "easgd_server"])
def test_a_killed_server_restarts_from_its_own_checkpoint_and_the_trainers_carry_on(outages: CaseResults,
                                                                                    fault: str) -> None:
    """The servers (with PS-hosted tables) run as a torchrun job (`--max-restarts=1`, its agent
    hosting the store at `--master-port`, where the 3 trainers meet them) and save their state every
    SERVER_CHECKPOINT_EVERY global steps (`easgd_server`: exchanges with a centre slice). The first
    worker is SIGKILLed once a trainer reports SERVER_KILL_AT; torchrun starts the worker group
    again (`easgd_server`: both servers, restarting together), which resume from their newest
    checkpoints, while the trainers, never restarted, wait (`sync.ps.server_restart_s`), then
    take the restored state and train on. GBA allows one server (`server`); the centre's slices
    need no common cut, so S-EASGD allows several."""
    ran: ServerOutage = outages[fault]
    steps, finals, errors, trainers, killed, killed_at, killed_step, output = (
        ran.steps, ran.finals, ran.errors, ran.trainers, ran.killed, ran.killed_at, ran.killed_step, ran.output)
    report, checkpoint_dir, servers = ran.report, ran.checkpoint_dir, SERVERS[fault]
    assert len(finals) == TRAINERS and ran.server_exit == 0, (sorted(finals), errors, steps[-3:], output[-3000:])
    # the fault fired: a first worker was killed at SERVER_KILL_AT or just after, and every server
    # that reports the end of the job is a process of torchrun's restart
    assert killed is not None and SERVER_KILL_AT <= killed_step <= SERVER_KILL_AT + 3, killed_step
    reports = {index: (pid, restart, state, tables)
               for index, pid, restart, state, tables in map(json.loads, report.read_text().splitlines())}
    assert sorted(reports) == list(range(servers)), reports
    for index, (pid, restart, state, tables) in reports.items():
        assert pid != killed and restart == 1, (index, pid, killed, restart)
        # each resumed from a checkpoint of its first process, and trained on from there
        restored, progress = (state["restored_at"], state["rounds"] if fault in EASGD_FAULTS else state["global_step"])
        assert restored > 0 and restored % SERVER_CHECKPOINT_EVERY == 0 and progress >= restored + 5, (index, state)
        assert tables["restored_at"] is not None, tables
        saved = sorted(path.name for path in (checkpoint_dir / f"ps{index}").iterdir())
        assert len(saved) == 2 and all(name.startswith("step_") for name in saved), saved  # the newest KEEP_LAST
    # the trainers were never restarted, saw each server restart once, and trained on after it
    assert not errors and all(process.exitcode == 0 for process in trainers), (errors, [p.exitcode for p in trainers])
    assert {step[1] for step in steps} == {1}
    after = [step for step in steps if step[4] > killed_at]
    for index in range(TRAINERS):
        _, _, _, metrics, _ = finals[index]
        assert metrics["server_restarts"] == servers, (index, metrics)
        assert sum(1 for step in after if step[0] == index) >= 10, index
    if fault == "server":  # the global step went back to the restored one (a trainer that waited longer may first train later)
        restored = reports[0][2]["restored_at"]
        assert killed_step - 2 * SERVER_CHECKPOINT_EVERY <= restored <= killed_step, (restored, killed_step)
        # the first step after the restart is the restored one's next; not "at most killed_step": the
        # server may have stepped past the last step a trainer reported before the kill, and when it
        # restored that very step (its checkpoint landed just before the kill) every later step exceeds it
        assert min(step[3] for step in after) <= restored + 1, (restored, killed_step, after[:6])
    else:  # every trainer's exchanges went on after the restart
        for index in range(TRAINERS):
            rounds = [step[3] for step in after if step[0] == index]
            assert rounds[-1] - rounds[0] >= 5, (index, rounds[0], rounds[-1])


def serve_under_torchrun(port: int, checkpoint_dir: str, report: str, fault: str) -> None:
    """A server of the test above, as torchrun's worker (server LOCAL_RANK): it reports (its index,
    pid, torchrun's restart count, its dense shard's or centre slice's stats, its tables' stats) as
    one JSON line appended to `report`."""
    def send(event: tuple) -> None:
        with open(report, "a") as file:
            file.write(json.dumps([event[1], os.getpid(), int(os.environ["TORCHELASTIC_RESTART_COUNT"]), event[3],
                                   event[5]]) + "\n")

    run_process(TRAINERS + int(os.environ["LOCAL_RANK"]), port, fault, checkpoint_dir, None, send)


if __name__ == "__main__":
    serve_under_torchrun(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
