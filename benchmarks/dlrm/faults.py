"""Test-only fault injection, for the tests' spawned jobs and the harness alike: faults armed on every
rank the same way, each fired by the trainer it names, right after its training step N.

    faults = FaultInjector(job.trainer_index, log=path, pids=pids)
    faults.fail_at(1, step=20)                   # trainer 1 raises InjectedFailure after step 20
    faults.kill_at(1, step=20)                   # trainer 1 SIGKILLs itself (no clean-up of any kind)
    faults.stall_at(1, step=20, seconds=3)       # trainer 1's training thread sleeps 3 s
    faults.stall_at(1, step=20, seconds=3, freeze=True)  # its whole process is stopped (SIGSTOP) for 3 s
    faults.stop_at(1, step=20)                   # trainer 1's process is stopped for good (never continued)
    faults.term_at(1, step=20)                   # trainer 1 SIGTERMs itself (a scheduler or a user ends it)
    faults.kill_server_at(0, step=20, trainer=0)  # trainer 0 SIGKILLs server 0's process
    faults.nan_at(1, step=20)                    # trainer 1's dense weights turn NaN (needs params=)
    fail_round_after(sync, rounds=3)             # the shadow thread's 4th round raises InjectedFailure
    for step in ...:
        ...; optimizer.step()
        faults.after_step(step)

`nan` writes NaN into the first value of every dense parameter the injector was given (`params`):
a replica gone bad, whose every later gradient is NaN, as a diverged step or a bit flip leaves it.

A plain sleep stalls only the training thread: the shadow thread, RPC threads and the pings a
server sends still run, as under a slow batch. `freeze` stops every thread of the process, as a
descheduled or swapped-out host would: a helper process (started before the stop) continues it.
`stop` starts no helper: the process stays stopped, as a hung host would, until someone kills it
(a test harness, torchrun's agent tearing the job down); SIGKILL ends a stopped process.

Every fault that fires is recorded before it acts (`FaultInjector.fired`, and one JSON line
`{"kind", "trainer", "step", "restart_count", "pid", "at"}` appended to `log`, flushed and synced
so that it outlives a kill, and printed to stderr), so a test asserts that it fired, where and when
(`at`: wall-clock time, comparable across the job's processes). `check_fired` raises for an armed
fault the run ended before, instead of letting it pass silently. Faults fire only in a job's first
attempt (`TORCHELASTIC_RESTART_COUNT`, 0 when unset): the attempt torchrun restarts runs through.

The harness arms the injector from the environment (`FaultInjector.from_env`):

    SHADOWGBA_TEST_KILL_AT_STEP=1:15          # trainer 1 is killed right after step 15 (and its checkpoint)
    SHADOWGBA_TEST_FAULTS="fail:0:20,stall:1:10:2.5,freeze:1:30:4,kill:1:40,nan:1:50,stop:1:60,term:1:70"
    SHADOWGBA_TEST_FAULT_LOG=faults.jsonl     # where fired faults are recorded

Killing a server needs its pid, which only a collective can tell a trainer (`exchange_pids`), so
the harness's environment cannot arm it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from shadowgba.job.rendezvous import restart_count  # re-exported: the harness reads it here

KILL_ENV = "SHADOWGBA_TEST_KILL_AT_STEP"
FAULTS_ENV = "SHADOWGBA_TEST_FAULTS"
LOG_ENV = "SHADOWGBA_TEST_FAULT_LOG"


class InjectedFailure(RuntimeError):
    """The exception a `fail_at` fault raises in the training loop (a user's bug, on purpose), and
    `fail_round_after` in the shadow thread."""


def fail_round_after(sync: Any, rounds: int) -> None:
    """The shadow algorithm of `sync` (a started `ShadowSync`) raises InjectedFailure in its round
    after `rounds` good rounds: a failure inside the shadow thread, not the training loop."""
    algorithm = sync._algorithm
    original = algorithm.sync
    done = 0

    def failing_round(snapshot: Any, stop: bool) -> Any:
        nonlocal done
        if done >= rounds:
            raise InjectedFailure(f"injected at round {rounds}")
        done += 1
        return original(snapshot, stop)

    algorithm.sync = failing_round


@dataclasses.dataclass(frozen=True)
class Fault:
    """One armed fault: `trainer` fires it right after its step `step`."""

    kind: str
    """fail | kill | term | stall | freeze | stop | kill_server | nan."""
    trainer: int
    step: int
    seconds: float = 0.0
    """stall / freeze: how long."""
    rank: int | None = None
    """kill_server: the global rank of the server process to kill."""


class FaultInjector:
    """The faults of a job, armed alike on every rank; `after_step` fires this trainer's own."""

    def __init__(self, trainer_index: int | None, log: str | os.PathLike[str] | None = None,
                 pids: Sequence[int] | None = None, params: Sequence[torch.Tensor] | None = None) -> None:
        """`trainer_index`: this rank's index among the trainers (None on a server: nothing fires
        there). `log`: a file each fired fault is appended to. `pids`: every rank's process id by
        global rank (`exchange_pids`), needed by `kill_server_at`. `params`: this trainer's dense
        parameters, needed by `nan_at`."""
        self.trainer_index = trainer_index
        self.log = Path(log) if log is not None else None
        self.pids = list(pids) if pids is not None else None
        self.params = list(params) if params is not None else None
        self.faults: list[Fault] = []
        self.fired: list[dict[str, object]] = []
        self._actions: dict[str, Callable[[Fault], None]] = {
            "fail": self._fail, "kill": self._kill, "term": self._term, "stall": self._stall, "freeze": self._freeze,
            "stop": self._stop, "kill_server": self._kill_server, "nan": self._nan,
        }

    @classmethod
    def from_env(cls, trainer_index: int, params: Sequence[torch.Tensor] | None = None) -> "FaultInjector":
        """The harness's injector: faults from `SHADOWGBA_TEST_KILL_AT_STEP` (TRAINER:STEP, a kill)
        and `SHADOWGBA_TEST_FAULTS` (comma-separated KIND:TRAINER:STEP[:SECONDS]), logged to
        `SHADOWGBA_TEST_FAULT_LOG`; `params` for a `nan` fault."""
        injector = cls(trainer_index, os.environ.get(LOG_ENV) or None, params=params)
        specs = [f"kill:{spec}" for spec in [os.environ.get(KILL_ENV, "")] if spec]
        specs += [spec for spec in os.environ.get(FAULTS_ENV, "").split(",") if spec]
        for spec in specs:
            kind, *numbers = spec.strip().split(":")
            try:
                trainer, step, *seconds = (float(number) for number in numbers)
                if kind not in ("fail", "kill", "term", "stop", "stall", "freeze", "nan") or len(seconds) != (
                        kind in ("stall", "freeze")):
                    raise ValueError
            except ValueError:
                raise ValueError(f"{KILL_ENV} must be TRAINER:STEP and {FAULTS_ENV} a list of "
                                 f"fail|kill|term|stop|nan:TRAINER:STEP "
                                 f"or stall|freeze:TRAINER:STEP:SECONDS, got {spec!r}") from None
            if kind == "nan":
                injector.nan_at(int(trainer), int(step))
            else:
                injector._arm(Fault(kind, int(trainer), int(step), *seconds))
        return injector

    def fail_at(self, trainer: int, step: int) -> "FaultInjector":
        """Trainer `trainer` raises `InjectedFailure` in its loop right after step `step`."""
        return self._arm(Fault("fail", trainer, step))

    def kill_at(self, trainer: int, step: int) -> "FaultInjector":
        """Trainer `trainer` SIGKILLs its own process right after step `step`."""
        return self._arm(Fault("kill", trainer, step))

    def term_at(self, trainer: int, step: int) -> "FaultInjector":
        """Trainer `trainer` SIGTERMs its own process right after step `step` (Python's default
        action: the process ends at once, as a scheduler's or a user's stop ends it)."""
        return self._arm(Fault("term", trainer, step))

    def stall_at(self, trainer: int, step: int, seconds: float, freeze: bool = False) -> "FaultInjector":
        """Trainer `trainer` stalls for `seconds` after step `step`: its training thread sleeps, or
        with `freeze` its whole process is stopped (SIGSTOP) and continued (SIGCONT) by a helper."""
        return self._arm(Fault("freeze" if freeze else "stall", trainer, step, seconds))

    def stop_at(self, trainer: int, step: int) -> "FaultInjector":
        """Trainer `trainer` stops its whole process (SIGSTOP) after step `step`, for good: nothing
        continues it (a hung host); only a kill ends it."""
        return self._arm(Fault("stop", trainer, step))

    def kill_server_at(self, server_rank: int, step: int, trainer: int = 0) -> "FaultInjector":
        """Trainer `trainer` SIGKILLs the process of global rank `server_rank` after step `step`."""
        if self.pids is None:
            raise ValueError("kill_server_at needs FaultInjector(..., pids=exchange_pids())")
        return self._arm(Fault("kill_server", trainer, step, rank=server_rank))

    def nan_at(self, trainer: int, step: int) -> "FaultInjector":
        """Trainer `trainer` writes NaN into the first value of each of its dense parameters after step `step`."""
        if self.params is None:
            raise ValueError("nan_at needs FaultInjector(..., params=the trainer's dense parameters)")
        return self._arm(Fault("nan", trainer, step))

    def after_step(self, step: int) -> None:
        """Fire this trainer's faults due at `step` (call it right after each training step)."""
        for fault in self.faults:
            if fault.trainer == self.trainer_index and fault.step == step:
                self._record(fault)
                self._actions[fault.kind](fault)

    def check_fired(self, last_step: int) -> None:
        """Raise if a fault armed for this trainer was never fired: the run ended at `last_step` first."""
        fired = {(record["kind"], record["step"]) for record in self.fired}
        for fault in self.faults:
            if fault.trainer == self.trainer_index and (fault.kind, fault.step) not in fired:
                raise RuntimeError(f"a {fault.kind} fault was armed for trainer {fault.trainer} at step {fault.step}, "
                                   f"but the run ended at step {last_step} without firing it")

    def _arm(self, fault: Fault) -> "FaultInjector":
        if restart_count() == 0:
            self.faults.append(fault)
        return self

    def _record(self, fault: Fault) -> None:
        record: dict[str, object] = {"kind": fault.kind, "trainer": fault.trainer, "step": fault.step,
                                     "restart_count": restart_count(), "pid": os.getpid(), "at": time.time()}
        if fault.kind in ("stall", "freeze"):
            record["seconds"] = fault.seconds
        if fault.rank is not None:
            record["rank"] = fault.rank
        self.fired.append(record)
        line = json.dumps(record)
        if self.log is not None:
            with open(self.log, "a") as log:
                log.write(line + "\n")
                log.flush()
                os.fsync(log.fileno())
        print(f"fault injection: {line}", file=sys.stderr, flush=True)

    def _fail(self, fault: Fault) -> None:
        raise InjectedFailure(f"injected failure on trainer {fault.trainer} at step {fault.step}")

    def _kill(self, fault: Fault) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def _term(self, fault: Fault) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    def _stall(self, fault: Fault) -> None:
        time.sleep(fault.seconds)

    def _freeze(self, fault: Fault) -> None:
        subprocess.Popen(["sh", "-c", f"sleep {fault.seconds}; kill -CONT {os.getpid()}"], start_new_session=True)
        os.kill(os.getpid(), signal.SIGSTOP)

    def _stop(self, fault: Fault) -> None:
        os.kill(os.getpid(), signal.SIGSTOP)

    def _nan(self, fault: Fault) -> None:
        assert self.params is not None  # nan_at checked it
        with torch.no_grad():
            for param in self.params:
                param.view(-1)[0] = float("nan")

    def _kill_server(self, fault: Fault) -> None:
        assert self.pids is not None and fault.rank is not None  # kill_server_at checked both
        os.kill(self.pids[fault.rank], signal.SIGKILL)


def exchange_pids() -> list[int]:
    """Every rank's process id by global rank (collective over the default group, every rank)."""
    pids: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return pids
