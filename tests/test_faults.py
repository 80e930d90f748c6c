"""The fault matrix (issue 12, point 3): no fault hangs a job; every rank ends with a clear error.

Cells: every algorithm under both table placements where the configuration exists. TorchRec-sharded
tables over the trainers: ma, easgd (shadow mode), bmuf (foreground mode: the rounds, and an
aborted one, run in the training thread; 2 trainers each), gba in GBA mode (2 trainers +
1 server), gba in sync all-reduce mode (2 trainers), easgd_ps (2 trainers + 1 server). PS-hosted
tables: gba, sync all-reduce and easgd_ps (2 trainers + 1 server hosting the tables); ma, easgd and
bmuf cannot have them (no server to host them: `benchmarks/dlrm/config.py` refuses
`model.embeddings: ps` without `sync.ps.num_servers`, and `SyncConfig` refuses servers for them).
The model is `tests.tiny_dmp`'s (its tables sharded by TorchRec or hosted on the server), wired as a user does:
`shadowgba.join` + `shadowgba.dense_sync`, the faults from `dlrm.faults.FaultInjector`.

Faults, all on trainer 1 (global rank 1) unless said otherwise:
- `fail`: `InjectedFailure` raised in the loop after step FAULT_STEP. Trainer 1 must report its own
  exception (type and message, no library error in its place); every other rank an error naming
  trainer 1 / rank 1; every rank ends within END_WITHIN_S of the fault (`sync.timeout_s` is
  TIMEOUT_S: a fault must be noticed, not waited out). Every cell.
- `stall` (a short freeze: the whole process SIGSTOPped for SHORT_STALL_S, under timeouts of
  SHORT_STALL_TIMEOUT_S but an RPC timeout of SHORT_STALL_RPC_TIMEOUT_S): the job carries on, the
  frozen trainer takes steps after the stall and every rank finishes normally. With servers, a call
  in flight when the trainer was stopped times out once it is continued; it is retried, not blamed
  on the server (issue 26's 60-90 s stop under a 60 s RPC timeout and a 300 s `sync.timeout_s`,
  scaled down: the same order of the three). Every cell; run first in the cell's group, which it leaves usable
  (the failure case after it joins a new job in the same processes).
- `kill` (SIGKILL trainer 1): survivors end within the timeout (KILL_TIMEOUT_S, plus
  KILL_MARGIN_S to leave) naming rank 1: a dead process and a stopped one look alike, only the
  clock tells them apart. The cells whose path differs (`KILLED_CELLS`).
- `kill_server` (trainer 0 SIGKILLs the server): trainers end within the same bound naming the
  server (`SERVER_KILLED_CELLS`).
- `freeze` longer than the timeout (LONG_STALL_S under LONG_TIMEOUT_S): ends as a kill does, the
  survivors before the frozen rank comes back, naming rank 1; the frozen rank ends too once
  continued. ma (collective timeout), gba over TorchRec tables (the all-to-all and close) and gba
  over PS tables (RPC timeouts and the servers' trainer timeout).
- `stop` (trainer 1 SIGSTOPped for good) without servers: the survivor ends within `sync.timeout_s`
  (KILL_TIMEOUT_S) plus STOP_MARGIN_S naming rank 1, though the default group keeps torch's 30-minute
  timeout: TorchRec's all-to-all runs on the trainer group `join` made with `sync.timeout_s`. ma and
  sync all-reduce (`STOPPED_CELLS`).

No group sets the default group's timeout: the library's own groups (the trainer group included)
carry `sync.timeout_s`, and the default group keeps torch's, as under a plain torchrun.

Every fault is asserted to have fired, on the rank and step it was armed for. How the cases share
spawned groups, and why, is `matrix_groups`'s docstring; the groups run PARALLEL_GROUPS at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import shadowgba
from dlrm.faults import Fault, FaultInjector, InjectedFailure, exchange_pids
from shadowgba.config import from_dict
from tests import tiny_dmp
from tests.multiprocess import RankOutcome, run_concurrently, run_ranks_outcomes

TIMEOUT_S = 30.0
"""`sync.timeout_s` (and the RPC and server timeouts) of every case but the long freeze."""
END_WITHIN_S = TIMEOUT_S / 2
"""Every rank must end this soon after the fault: well before any timeout would have fired."""
FAULT_STEP = 12
SHORT_STALL_S = 4.0
SHORT_STALL_TIMEOUT_S = 10.0
"""`sync.timeout_s` (and the server timeout) of the short freeze: 2.5 times the freeze."""
SHORT_STALL_RPC_TIMEOUT_S = 1.0
"""`sync.ps.rpc_timeout_s` of the short freeze: shorter than the freeze."""
KILL_TIMEOUT_S = 10.0
"""`sync.timeout_s` (and the RPC and server timeouts) of the kill cases: a killed rank must be named
within it (a dead process and a stopped one look alike; only the clock tells them apart)."""
KILL_MARGIN_S = 5.0
"""What a survivor may take beyond the timeout to notice the verdict and leave."""
LONG_TIMEOUT_S = 5.0
"""`sync.timeout_s` (and the RPC and server timeouts) of the long freeze."""
LONG_STALL_S = 14.0
STOP_MARGIN_S = 30.0
"""What a survivor may take beyond `sync.timeout_s` to end after a peer stopped for good: naming the
silent peer and aborting (issue 26's bound, loose on loaded cores)."""
STALL_RUN_STEPS = 40
"""The short-stall run's steps, on every trainer (lockstep cells need equal counts)."""
RUN_CAP_S = TIMEOUT_S + 10
"""A survivor that no fault stops trains at most this long, then leaves its loop as if done."""
GROUP_DEADLINE_S = 60 + RUN_CAP_S + LONG_STALL_S
"""A spawned group still running after this is killed and its remaining ranks reported as hung:
start-up on loaded cores, plus a case that only ends on RUN_CAP_S."""

pytestmark = pytest.mark.timeout(600)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One configuration of the matrix."""

    algo: str
    """ma | easgd | bmuf | gba (GBA mode) | sync (gba in sync all-reduce mode) | easgd_ps."""
    tables: str
    """torchrec (sharded over the trainers) | ps (hosted on the server)."""
    mode: str = "shadow"
    """The shadow algorithms' mode: shadow, or foreground (rounds in the training thread)."""

    @property
    def servers(self) -> int:
        return 1 if self.algo in ("gba", "easgd_ps") or self.tables == "ps" else 0

    @property
    def world_size(self) -> int:
        return 2 + self.servers

    @property
    def name(self) -> str:
        return f"{self.algo}-{self.tables}" + ("-foreground" if self.mode == "foreground" else "")

    def sync_config(self, timeout_s: float, rpc_timeout_s: float) -> shadowgba.SyncConfig:
        return from_dict(shadowgba.SyncConfig, {
            "algo": "gba" if self.algo == "sync" else self.algo, "mode": self.mode, "interval_ms": 5.0,
            "foreground_every": 3,
            "first_round_after": 2, "log_interval_s": 0.0, "timeout_s": timeout_s,
            # the matrix checks that a lost trainer ends every rank naming it (the job's fail path);
            # on_trainer_lost continue, where it departs and rejoins, is tests/test_elastic.py's
            "ps": {"num_servers": self.servers, "rpc_timeout_s": rpc_timeout_s, "trainer_timeout_s": timeout_s,
                   "on_trainer_lost": "fail"},
            "gba": {"initial_mode": "sync" if self.algo == "sync" else "gba", "switch_policy": {"enabled": False}},
        })


CELLS = [Cell("ma", "torchrec"), Cell("easgd", "torchrec"), Cell("bmuf", "torchrec", "foreground")] + [
    Cell(algo, "torchrec") for algo in ("gba", "sync", "easgd_ps")] + [
    Cell(algo, "ps") for algo in ("gba", "sync", "easgd_ps")]
TRAINER_1, SERVER = ("trainer 1", "trainer1"), ("server 0", "ps0")
"""How an error may name trainer 1 and the server besides their global ranks (1 and 2)."""
MA, GBA_TORCHREC, GBA_PS, EASGD_PS_PS = Cell("ma", "torchrec"), Cell("gba", "torchrec"), Cell("gba", "ps"), Cell("easgd_ps", "ps")


def describe(error: BaseException) -> dict[str, Any]:
    """Type, message, notes, and every message of its chain (causes and contexts)."""
    chain, seen, current = [], set(), error.__cause__ or error.__context__
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(f"{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    return {"type": type(error).__name__, "message": str(error), "notes": list(getattr(error, "__notes__", [])),
            "chain": chain, "traceback": traceback.format_exc(limit=-6)}


@dataclasses.dataclass(frozen=True)
class Case:
    """One job in a spawned group: `cell` under the faults `arm(injector)` arms. Each rank writes what
    it saw to `directory`/rank{r}.json as soon as the case is over, and the injector logs the fault
    to `directory`/faults.jsonl: both outlive a rank that is killed or hangs in a later case."""

    name: str
    cell: Cell
    arm: Callable[[FaultInjector], Any]
    directory: str
    timeout_s: float = TIMEOUT_S
    steps: int | None = None
    """Steps every trainer takes; None: until a fault stops it, or RUN_CAP_S."""
    rpc_timeout_s: float | None = None
    """`sync.ps.rpc_timeout_s`; None: `timeout_s`."""


def run_case(rank: int, case: Case, pids: list[int]) -> None:
    """One job of `case` on this rank: join, train, close; writes what this rank saw, never raises."""
    cell = case.cell
    record: dict[str, Any] = {"rank": rank, "error": None, "steps": 0, "step_end": []}
    started = time.time()
    try:
        config = cell.sync_config(case.timeout_s, case.rpc_timeout_s or case.timeout_s)
        tables = options = None
        if cell.tables == "ps":
            tables, options = tiny_dmp.table_configs(), shadowgba.ps_table_options(config, 2, tiny_dmp.BATCH)
        job = shadowgba.join(config, tables, options)
        record["role"] = "server" if job.is_server else f"trainer {job.trainer_index}"
        if not job.is_server:
            faults = FaultInjector(job.trainer_index, log=Path(case.directory) / "faults.jsonl", pids=pids)
            case.arm(faults)
            train(cell, job, faults, case.steps, record)
    except BaseException as error:  # noqa: BLE001 (what the rank saw is the test's evidence)
        record["error"] = describe(error)
    record["ended_at"] = time.time()
    record["elapsed_s"] = record["ended_at"] - started
    (Path(case.directory) / f"rank{rank}.json").write_text(json.dumps(record))


def train(cell: Cell, job: shadowgba.Job, faults: FaultInjector, steps: int | None, record: dict[str, Any]) -> None:
    """The user's loop inside `dense_sync`'s `with` block, with the injector after every step."""
    if cell.tables == "ps":
        model: nn.Module = tiny_dmp.TinyRec(job.ps_embeddings())
        optimizer: Any = torch.optim.SGD(model.mlp.parameters(), lr=0.05)
    else:
        model, optimizer = tiny_dmp.build(dmp_kwargs=job.dmp_kwargs())
    started = time.monotonic()
    with shadowgba.dense_sync(model, optimizer, job, local_batch_size=tiny_dmp.BATCH):
        step = 0
        while (step < steps) if steps is not None else (time.monotonic() - started < RUN_CAP_S):
            loss, _ = model(tiny_dmp.batch(job.trainer_index, step))
            optimizer.zero_grad()
            loss.backward()
            if cell.tables == "ps":
                model.ebc.push_gradients()
            optimizer.step()
            step += 1
            record["steps"] = step
            record["step_end"].append(time.time())
            if cell.servers:  # calls sent again after a timeout: reported, as the freeze may catch none in flight
                record["retried_calls"] = job.require_transport().retried_calls()
            faults.after_step(step)


def cell_group(rank: int, world_size: int, cases: list[Case]) -> None:
    """Several cases one after another in this spawned group (each but the last must leave it usable)."""
    pids = exchange_pids()
    for case in cases:
        run_case(rank, case, pids)


# ------------------------------------------------------------------------------------ the arming
def fail_trainer_1(faults: FaultInjector) -> None:
    faults.fail_at(1, FAULT_STEP)


def kill_trainer_1(faults: FaultInjector) -> None:
    faults.kill_at(1, FAULT_STEP)


def kill_the_server(faults: FaultInjector) -> None:
    faults.kill_server_at(2, FAULT_STEP, trainer=0)  # 2 trainers + 1 server: the server is global rank 2


def short_freeze_trainer_1(faults: FaultInjector) -> None:
    faults.stall_at(1, FAULT_STEP, SHORT_STALL_S, freeze=True)


def long_freeze_trainer_1(faults: FaultInjector) -> None:
    faults.stall_at(1, FAULT_STEP, LONG_STALL_S, freeze=True)


def stop_trainer_1(faults: FaultInjector) -> None:
    faults.stop_at(1, FAULT_STEP)


def run_group(cell: Cell, cases: list[Case], deadline_s: float) -> list[RankOutcome]:
    """`cases` in one spawned group of `cell`, the default group at torch's timeout (30 minutes): every
    collective of the library, TorchRec's all-to-all included, runs on groups that `join` and the
    runtimes made with `sync.timeout_s`."""
    stopped_for_good = any(case.arm is stop_trainer_1 for case in cases)
    return run_ranks_outcomes(cell_group, cell.world_size, cases, timeout_s=deadline_s, stopped_for_good=stopped_for_good)


# ---------------------------------------------------------------------------------- the assertions
@dataclasses.dataclass(repr=False)
class Ran:
    """One case of a spawned group, as the test sees it: every rank's outcome and the fault log."""

    case: Case
    outcomes: list[RankOutcome]

    @property
    def records(self) -> list[dict[str, Any] | None]:
        """Each rank's record of the case; None for a rank that was killed, hung or never ran it."""
        paths = [Path(self.case.directory) / f"rank{rank}.json" for rank in range(len(self.outcomes))]
        return [json.loads(path.read_text()) if path.exists() else None for path in paths]

    def fired(self) -> dict[str, Any]:
        """The one fault of the case (asserting exactly one fired), from the log: it outlives a kill."""
        log = Path(self.case.directory) / "faults.jsonl"
        lines = log.read_text().splitlines() if log.exists() else []
        assert len(lines) == 1, f"fault log {lines}\n{self}"
        return json.loads(lines[0])

    def __str__(self) -> str:
        """Every rank's role, error, steps and end, for assertion messages and the report."""
        lines = []
        for rank, (outcome, record) in enumerate(zip(self.outcomes, self.records)):
            if record is None:
                what = ("killed" if outcome.killed else "hung (alive at the deadline)" if outcome.hung
                        else outcome.traceback or "never ran it")
                lines.append(f"rank {rank}: {what}")
                continue
            error = record["error"]
            said = "no error" if error is None else f"{error['type']}: {error['message'][:300]} chain={error['chain'][:3]}"
            lines.append(f"rank {rank} ({record.get('role')}): {said}; {record['steps']} steps, "
                         f"{record.get('retried_calls', 0)} calls retried, ended {record['elapsed_s']:.1f} s after its start")
        return f"{self.case.cell.name} {self.case.name}:\n  " + "\n  ".join(lines)

    __repr__ = __str__  # what an assertion message shows


def names(error: dict[str, Any], rank: int, roles: tuple[str, ...]) -> bool:
    """Whether an error (its message, notes or chain) names global rank `rank` or one of its `roles`."""
    text = " ".join([error["message"], *error["notes"], *error["chain"]])
    return any(name in text for name in (f"rank {rank}", *roles))


def assert_fired(ran: Ran, kind: str, trainer: int) -> dict[str, Any]:
    fault = ran.fired()
    assert (fault["kind"], fault["trainer"], fault["step"]) == (kind, trainer, FAULT_STEP), f"{fault}\n{ran}"
    return fault


def assert_others_end_naming(ran: Ran, lost_rank: int, roles: tuple[str, ...], fault_at: float, within_s: float) -> None:
    """Every rank but `lost_rank` ended by itself with an error naming it, within `within_s` of the fault."""
    for rank, record in enumerate(ran.records):
        if rank == lost_rank:
            continue
        assert record is not None, f"rank {rank} did not end by itself\n{ran}"
        assert record["error"] is not None, f"rank {rank} ended without an error\n{ran}"
        assert names(record["error"], lost_rank, roles), f"rank {rank}'s error names none of {roles}, rank {lost_rank}\n{ran}"
        late = record["ended_at"] - fault_at
        assert late < within_s, f"rank {rank} ended {late:.1f} s after the fault\n{ran}"


# ---------------------------------------------------------------------------------------- the tests
KILLED_CELLS = [MA, GBA_TORCHREC, GBA_PS]
"""Kill cells: ma (easgd, bmuf and sync all-reduce share its collectives on a trainer group), gba
over TorchRec tables (lockstep: the all-to-all) and gba over PS tables (the servers' heartbeat);
easgd_ps over PS tables shares gba-ps's path (RPC only, the same heartbeat)."""
SERVER_KILLED_CELLS = [GBA_PS]
"""Server kill: gba over PS tables (dense shard and tables on the killed server); easgd_ps's centre
fails through the same transport path."""
LONG_FROZEN_CELLS = [MA, GBA_TORCHREC, GBA_PS]
STOPPED_CELLS = [MA, Cell("sync", "torchrec")]
"""A trainer stopped for good without servers: the shadow runtime and GBASync's sync all-reduce, both
over TorchRec's all-to-all."""
PARALLEL_GROUPS = 6
"""Spawned groups run at once: a group spends most of its time waiting (freezes, timeouts), not
computing, so the matrix's wall time is about a sixth of the groups' total, or the longest group's
(`matrix_groups` lists the longest first, so none starts last)."""


def matrix_groups(root: Path) -> dict[str, list[Case]]:
    """Every group of the matrix: name -> its cases, run one after another in one spawned group.

    A case that kills a rank, or leaves one waiting in TorchRec's all-to-all (a failure over
    TorchRec tables: the peer is released only when the failed process exits), must be the last of
    its group. So the PS-table cells share one group (each short freeze, then each failure) that
    ends with gba over TorchRec tables; every other TorchRec cell gets a group of its own. The
    groups come longest first (the shared group, the long freezes and the stops that wait out a
    timeout, then a stall and a failure each, then the kills), the order in which they start."""
    def case(name: str, cell: Cell, arm: Callable[[FaultInjector], Any], timeout_s: float = TIMEOUT_S,
             steps: int | None = None, rpc_timeout_s: float | None = None) -> Case:
        directory = root / f"{cell.name}-{name}"
        directory.mkdir(parents=True)
        return Case(name, cell, arm, str(directory), timeout_s, steps, rpc_timeout_s)

    def stall_then_fail(cell: Cell) -> list[Case]:
        return [case("stall", cell, short_freeze_trainer_1, SHORT_STALL_TIMEOUT_S, STALL_RUN_STEPS,
                     SHORT_STALL_RPC_TIMEOUT_S),
                case("fail", cell, fail_trainer_1)]

    with_servers = [cell for cell in CELLS if cell.tables == "ps"] + [GBA_TORCHREC]
    groups = {"servers": [one for cell in with_servers for one in stall_then_fail(cell)]}
    groups |= {f"freeze-{cell.name}": [case("freeze", cell, long_freeze_trainer_1, LONG_TIMEOUT_S)]
               for cell in LONG_FROZEN_CELLS}
    groups |= {f"stop-{cell.name}": [case("stop", cell, stop_trainer_1, KILL_TIMEOUT_S)] for cell in STOPPED_CELLS}
    groups |= {cell.name: stall_then_fail(cell) for cell in CELLS if cell not in with_servers}
    groups |= {f"kill_server-{cell.name}": [case("kill_server", cell, kill_the_server, KILL_TIMEOUT_S)]
               for cell in SERVER_KILLED_CELLS}
    groups |= {f"kill-{cell.name}": [case("kill", cell, kill_trainer_1, KILL_TIMEOUT_S)] for cell in KILLED_CELLS}
    return groups


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Ran]:
    """Every group, PARALLEL_GROUPS at a time; each case's result by (cell name, case name)."""
    groups = matrix_groups(tmp_path_factory.mktemp("faults"))

    def run(cases: list[Case]) -> list[Ran]:
        deadline_s = GROUP_DEADLINE_S + RUN_CAP_S * (len(cases) - 1)
        outcomes = run_group(cases[0].cell, cases, deadline_s)
        return [Ran(case, outcomes) for case in cases]

    ran = run_concurrently({name: functools.partial(run, cases) for name, cases in groups.items()}, at_once=PARALLEL_GROUPS)
    return {(one.case.cell.name, one.case.name): one for group in ran.values() for one in group}


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.name)
def test_a_trainer_stalled_for_less_than_the_timeout_lets_the_job_carry_on(
        matrix: dict[tuple[str, str], Ran], cell: Cell) -> None:
    """Every rank finishes without an error, every trainer all its steps; the frozen trainer steps on
    after the freeze (over PS tables its peer may have finished first: trainers step independently)."""
    ran = matrix[cell.name, "stall"]
    stall = assert_fired(ran, "freeze", 1)
    for record in ran.records:
        assert record is not None and record["error"] is None, ran
        if record["role"].startswith("trainer"):
            assert record["steps"] == STALL_RUN_STEPS, ran
    frozen = ran.records[1]
    assert frozen is not None and frozen["step_end"][-1] > stall["at"] + SHORT_STALL_S, f"no step after the stall\n{ran}"


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.name)
def test_an_exception_in_the_loop_ends_every_rank_and_is_what_its_own_rank_reports(
        matrix: dict[tuple[str, str], Ran], cell: Cell) -> None:
    ran = matrix[cell.name, "fail"]
    fault = assert_fired(ran, "fail", 1)
    own = ran.records[1]
    assert own is not None and own["error"] is not None, ran
    assert (own["error"]["type"], own["error"]["message"]) == (
        InjectedFailure.__name__, f"injected failure on trainer 1 at step {FAULT_STEP}"), ran
    assert own["error"]["notes"] == [], ran  # aborting the sync after it raised nothing of its own
    assert own["ended_at"] - fault["at"] < END_WITHIN_S, ran
    assert_others_end_naming(ran, 1, TRAINER_1, fault["at"], END_WITHIN_S)


@pytest.mark.parametrize("cell", KILLED_CELLS, ids=lambda cell: cell.name)
def test_a_killed_trainer_ends_every_survivor_naming_it(matrix: dict[tuple[str, str], Ran], cell: Cell) -> None:
    """Within the timeout (`sync.timeout_s` KILL_TIMEOUT_S) and a margin for the survivors' own exit."""
    ran = matrix[cell.name, "kill"]
    fault = assert_fired(ran, "kill", 1)
    assert ran.outcomes[1].killed, ran
    assert_others_end_naming(ran, 1, TRAINER_1, fault["at"], KILL_TIMEOUT_S + KILL_MARGIN_S)


@pytest.mark.parametrize("cell", SERVER_KILLED_CELLS, ids=lambda cell: cell.name)
def test_a_killed_server_ends_every_trainer_naming_it(matrix: dict[tuple[str, str], Ran], cell: Cell) -> None:
    ran = matrix[cell.name, "kill_server"]
    fault = assert_fired(ran, "kill_server", 0)
    assert fault["rank"] == 2 and ran.outcomes[2].killed, ran
    assert_others_end_naming(ran, 2, SERVER, fault["at"], KILL_TIMEOUT_S + KILL_MARGIN_S)
    for record in ran.records[:2]:  # the error names the server: nothing may call the lost rank unknown
        assert record is not None and not any("unknown" in text for text in [record["error"]["message"],
                                                                          *record["error"]["notes"]]), ran


@pytest.mark.parametrize("cell", LONG_FROZEN_CELLS, ids=lambda cell: cell.name)
def test_a_trainer_stalled_for_longer_than_the_timeout_ends_the_job_as_a_kill_does(
        matrix: dict[tuple[str, str], Ran], cell: Cell) -> None:
    """The survivors give up on the frozen trainer before it comes back, naming it; once continued,
    it ends too, with an error of its own."""
    ran = matrix[cell.name, "freeze"]
    fault = assert_fired(ran, "freeze", 1)
    assert_others_end_naming(ran, 1, TRAINER_1, fault["at"], LONG_STALL_S)
    frozen = ran.records[1]
    assert frozen is not None and frozen["error"] is not None, ran
    assert frozen["ended_at"] - fault["at"] < LONG_STALL_S + END_WITHIN_S, ran


@pytest.mark.parametrize("cell", STOPPED_CELLS, ids=lambda cell: cell.name)
def test_a_trainer_stopped_for_good_without_servers_ends_every_other_rank_naming_it(
        matrix: dict[tuple[str, str], Ran], cell: Cell) -> None:
    ran = matrix[cell.name, "stop"]
    fault = assert_fired(ran, "stop", 1)
    assert ran.outcomes[1].stopped, ran  # still stopped when the survivor had ended; the harness killed it
    assert_others_end_naming(ran, 1, TRAINER_1, fault["at"], KILL_TIMEOUT_S + STOP_MARGIN_S)


# ------------------------------------------------------------------------- the injector, in-process
def test_the_harness_arms_faults_from_the_environment_and_refuses_a_malformed_spec(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SHADOWGBA_TEST_KILL_AT_STEP", "1:15")
    monkeypatch.setenv("SHADOWGBA_TEST_FAULTS", "fail:0:20, stall:1:10:2.5,freeze:1:30:4,stop:1:35,nan:1:40")
    monkeypatch.setenv("SHADOWGBA_TEST_FAULT_LOG", str(tmp_path / "faults.jsonl"))
    weights = [torch.ones(3), torch.ones(2, 2)]
    injector = FaultInjector.from_env(1, weights)
    assert injector.faults == [Fault("kill", 1, 15), Fault("fail", 0, 20), Fault("stall", 1, 10, 2.5),
                               Fault("freeze", 1, 30, 4.0), Fault("stop", 1, 35), Fault("nan", 1, 40)]
    assert injector.log == tmp_path / "faults.jsonl"
    injector.after_step(40)  # the nan fault: the first value of every dense parameter, and it is logged
    assert [int(torch.isnan(weight).sum()) for weight in weights] == [1, 1] and injector.fired[-1]["kind"] == "nan"
    with pytest.raises(ValueError, match="nan_at needs FaultInjector"):
        FaultInjector.from_env(1)
    for spec in ("kill:1", "stall:1:10", "fail:1:10:3", "stop:1:10:3", "explode:1:10", "fail:one:10", "nan:1:10:2"):
        monkeypatch.setenv("SHADOWGBA_TEST_FAULTS", spec)
        with pytest.raises(ValueError, match="SHADOWGBA_TEST_FAULTS a list of"):
            FaultInjector.from_env(0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted attempt runs through
    monkeypatch.setenv("SHADOWGBA_TEST_FAULTS", "fail:1:3")
    assert FaultInjector.from_env(1).faults == []


def test_a_fault_fires_only_on_its_trainer_and_step_is_logged_before_it_acts_and_is_checked(tmp_path: Path) -> None:
    log = tmp_path / "faults.jsonl"
    on_0, on_1 = (FaultInjector(trainer, log=log).fail_at(1, 3).stall_at(1, 4, 0.2) for trainer in (0, 1))
    for step in range(1, 6):
        on_0.after_step(step)
    assert on_0.fired == [] and not log.exists()
    on_0.check_fired(5)  # trainer 0 was armed with nothing of its own
    with pytest.raises(RuntimeError, match="a fail fault was armed for trainer 1 at step 3, but the run ended at step 2"):
        on_1.check_fired(2)
    on_1.after_step(2)
    with pytest.raises(InjectedFailure, match="injected failure on trainer 1 at step 3"):
        on_1.after_step(3)
    started = time.monotonic()
    on_1.after_step(4)
    assert time.monotonic() - started >= 0.2
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert logged == on_1.fired and [(f["kind"], f["trainer"], f["step"]) for f in logged] == [("fail", 1, 3), ("stall", 1, 4)]
    assert logged[1]["seconds"] == 0.2 and logged[0]["restart_count"] == 0
    on_1.check_fired(5)
    with pytest.raises(ValueError, match="kill_server_at needs"):
        on_1.kill_server_at(2, 3)
