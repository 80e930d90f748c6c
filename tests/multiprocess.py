"""Run a function on N gloo ranks in fresh processes, with a hard deadline so a hang fails fast.

Each rank runs `fn(rank, world_size, *args)` after `init_process_group("gloo")` and sends back its
return value (serialised with torch.save) or its formatted traceback. `run_ranks` returns the per-rank results in rank order,
or raises with every failing rank's traceback; ranks still alive at the deadline are killed and
reported as hung. Processes come from a fork server (`multiprocessing`'s "forkserver" start
method): a clean process, started once per test session, that has imported torch, TorchRec and
shadowgba but run nothing, forks each rank. So no thread pool or group is inherited, as with
spawning, but a rank does not pay the imports (seconds of CPU each, most of a small job's cost).

`run_ranks_outcomes` is the same harness for fault-injection tests: it never raises for a rank,
and returns each rank's `RankOutcome` instead, so that a rank killed on purpose (SIGKILL) reads as
killed, and a test can report every rank's message and end time, hung ranks included. A rank
stopped for good (SIGSTOP, never continued) cannot end by itself: with `stopped_for_good`, once
every other rank has sent its result, the harness kills a stopped one at once (no wait for the
deadline) and reports it as stopped.

The job's store lives in the harness's process, as under torchrun (whose agent hosts it and tells
the ranks so with TORCHELASTIC_USE_AGENT_STORE), not in rank 0's: a rank that ends early takes no
store away from ranks still reporting a failure. With `by_hand`, the ranks are started as a user
starts them without torchrun: rank 0's process hosts the store (`env://`), and it ends with that
process (`shadowgba.job.store` is what keeps the job's decisions readable then).

`run_concurrently` runs a file's independent cases (each a job of its own: its processes, port and
folders) in threads at once, and `run_shared_concurrently` several `run_shared` groups: most of a
fault test's wall time is waiting (for a timeout to fire, a frozen process to be continued, a restart
to come up), not computing, so cases that wait side by side cost about the longest one's time. A
module fixture runs them and each test reads its own case's result; a case that failed fails only
the tests that read it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import io
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from multiprocessing import forkserver
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dlrm.host import free_port


PRELOADED = ["torch", "torch.distributed", "torchrec", "shadowgba", "tests.tiny_dmp"]
"""What the fork server imports before it forks any rank."""


CHECKOUT = str(Path(__file__).resolve().parents[1])
"""The checkout this file belongs to: the code every rank must run."""
CHECKOUT_PATH = os.pathsep.join([CHECKOUT, os.path.join(CHECKOUT, "benchmarks")])
"""What a process that imports this file needs first on its `PYTHONPATH` (the checkout, and
benchmarks/, whose `dlrm.host` gives `free_port`), as pytest's own `pythonpath` setting has it."""


def with_checkout_path(environment: Mapping[str, str]) -> dict[str, str]:
    """`environment` with `CHECKOUT_PATH` first on its `PYTHONPATH`: for a rank started by a command
    (torchrun) that imports this file."""
    return {**environment, "PYTHONPATH": os.pathsep.join(filter(None, [CHECKOUT_PATH, environment.get("PYTHONPATH")]))}


_CONTEXT_LOCK = threading.Lock()
"""`_context` edits this process's environment while it starts the server: cases run at once
(`run_concurrently`) call it from several threads, and one must not save another's edit as the
environment to restore."""


def _context() -> Any:
    """The fork-server context, its preload set and its server started (once) from this checkout.

    Python 3.11's fork server does not take the parent's `sys.path` (it is passed to it, and not
    applied): it imports the preloads, shadowgba included, from its own, which starts with the
    working directory and then names the checkout the editable install points at. A harness run
    from another worktree (a before / after comparison) would then measure that code under the
    other's name. So the server starts with this file's checkout first on its `PYTHONPATH` and
    without the working directory (`PYTHONSAFEPATH`), in its environment alone."""
    context = mp.get_context("forkserver")
    with _CONTEXT_LOCK:
        context.set_forkserver_preload(PRELOADED)
        saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "PYTHONSAFEPATH")}
        os.environ["PYTHONPATH"] = with_checkout_path(os.environ)["PYTHONPATH"]
        os.environ["PYTHONSAFEPATH"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name)
                else:
                    os.environ[name] = value
    return context


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results: Any,
           by_hand: bool = False) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if not by_hand:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        encoded = io.BytesIO()
        torch.save(value, encoded)  # bytes, not shared-memory tensors that die with this process
        results.put((rank, True, encoded.getvalue()))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


@dataclasses.dataclass
class RankOutcome:
    """How one rank of `run_ranks_outcomes` ended: exactly one of returned, raised, killed, stopped, hung."""

    value: Any = None
    """What `fn` returned (when it returned)."""
    traceback: str | None = None
    """The formatted traceback of what `fn` raised (when it raised)."""
    killed: bool = False
    """The process died by SIGKILL or SIGTERM before sending a result (`exitcode` says which)."""
    stopped: bool = False
    """The process was stopped (SIGSTOP) when every other rank had sent its result; the harness killed it."""
    hung: bool = False
    """Still alive at the deadline (then killed by the harness), or gone without a result otherwise."""
    exitcode: int | None = None
    """The process's exit code (negative: the signal that ended it)."""

    @property
    def returned(self) -> bool:
        return not (self.traceback is not None or self.killed or self.stopped or self.hung)


def run_ranks_outcomes(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 90.0,
                       stopped_for_good: bool = False, by_hand: bool = False) -> list[RankOutcome]:
    """Run `fn` on `world_size` ranks; every rank's `RankOutcome`, in rank order. `stopped_for_good`:
    the job stops a rank and never continues it, so a rank found stopped when every other one has
    sent its result is killed then (without it, a stopped rank may yet be continued: it is waited for).
    `by_hand`: rank 0's process hosts the job's store, not this one (module docstring)."""
    context = _context()
    results = context.Queue()
    port = free_port()
    # the "agent's" store, unless rank 0 hosts it
    store = None if by_hand else dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    processes = [
        context.Process(target=_entry, args=(fn, rank, world_size, port, args, results, by_hand), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    received: dict[int, tuple[bool, Any]] = {}
    alive_at_deadline: set[int] = set()
    stopped: set[int] = set()
    try:
        deadline = time.monotonic() + timeout_s
        while len(received) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                alive_at_deadline = {rank for rank, process in enumerate(processes) if process.is_alive()}
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                waiting = [processes[rank] for rank in range(world_size) if rank not in received]
                if results.empty() and all(not p.is_alive() or (stopped_for_good and _is_stopped(p)) for p in waiting):
                    stopped = {rank for rank in range(world_size) if rank not in received and processes[rank].is_alive()}
                    break
                continue
            received[rank] = (ok, value)
    finally:
        for rank, process in enumerate(processes):
            process.join(timeout=0 if rank in alive_at_deadline | stopped else 5)
            if process.is_alive():
                process.kill()
                process.join()
        del store
    outcomes = []
    for rank, process in enumerate(processes):
        exitcode = process.exitcode
        if rank in received:
            ok, value = received[rank]
            outcomes.append(RankOutcome(value=torch.load(io.BytesIO(value), weights_only=False), exitcode=exitcode)
                            if ok else RankOutcome(traceback=value, exitcode=exitcode))
        elif rank in stopped:
            outcomes.append(RankOutcome(stopped=True, exitcode=exitcode))
        elif rank not in alive_at_deadline and exitcode in (-signal.SIGKILL, -signal.SIGTERM):
            outcomes.append(RankOutcome(killed=True, exitcode=exitcode))
        else:
            outcomes.append(RankOutcome(hung=True, exitcode=exitcode))
    return outcomes


def _is_stopped(process: Any) -> bool:
    """Whether `process` is alive and stopped by a signal (state T in /proc/<pid>/stat)."""
    try:
        stat = Path(f"/proc/{process.pid}/stat").read_text()
    except OSError:  # gone already
        return False
    return stat.rpartition(")")[2].split()[0] == "T"


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 90.0) -> list[Any]:
    """Run `fn` on `world_size` ranks; return their results or raise with the failures."""
    outcomes = run_ranks_outcomes(fn, world_size, *args, timeout_s=timeout_s)
    failures = [f"rank {rank}:\n{outcome.traceback}" for rank, outcome in enumerate(outcomes)
                if outcome.traceback is not None]
    missing = [rank for rank, outcome in enumerate(outcomes) if outcome.killed or outcome.stopped or outcome.hung]
    if missing:
        failures.append(f"ranks {missing} hung or died without a result (deadline {timeout_s}s)")
    if failures:
        raise AssertionError("\n".join(failures))
    return [outcome.value for outcome in outcomes]


def _run_jobs(rank: int, world_size: int, jobs: list[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    results = []
    for index, (fn, args) in enumerate(jobs):
        if index:
            _align_group_names()
        results.append(fn(rank, world_size, *args))
    return results


def _align_group_names() -> None:
    """Between two jobs in the same processes: every rank continues from the largest process-group
    count. torch names a group by how many this process has created, so the ranks of one group must
    have created equally many; a job whose ranks had different roles leaves them apart (TorchRec
    builds groups on the trainers, which servers never see), and the next job, where those ranks may
    be trainers together, would then wait forever in its first `new_group`. A collective on the
    world: never after the last job, whose failed rank must exit (so that a peer waiting in TorchRec's
    all-to-all is released) rather than wait for that peer here."""
    from torch.distributed import distributed_c10d

    count = torch.tensor([distributed_c10d._world.group_count])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    distributed_c10d._world.group_count = int(count)


def run_shared(world_size: int, jobs: dict[str, tuple[Callable[..., Any], tuple]], timeout_s: float = 90.0) -> dict[str, list[Any]]:
    """Run several independent jobs one after another in ONE spawned group of `world_size` ranks
    (process start-up is most of a small job's cost); returns each job's per-rank results by name.
    Every rank runs the jobs in the same order, so their collectives pair up job by job."""
    per_rank = run_ranks(_run_jobs, world_size, list(jobs.values()), timeout_s=timeout_s)
    return {name: [results[index] for results in per_rank] for index, name in enumerate(jobs)}


class CaseResults(Mapping[str, Any]):
    """The cases `run_concurrently` ran, by name: reading one returns what it returned, or raises what
    it raised (with its traceback), so a failed case fails the tests that read it, not its neighbours."""

    def __init__(self, read: dict[str, Callable[[], Any]]) -> None:
        self._read = read

    def __getitem__(self, name: str) -> Any:
        return self._read[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._read)

    def __len__(self) -> int:
        return len(self._read)


def run_concurrently(cases: dict[str, Callable[[], Any]], at_once: int | None = None) -> CaseResults:
    """Call every case in a thread of its own, `at_once` at a time (None: all at once), and return
    once every one has ended. A case must be a job of its own: its processes (`run_ranks_outcomes`
    starts a group, on a free port, per call), its folders (made beforehand, in the calling thread:
    pytest's `tmp_path_factory` is not thread-safe), and a deadline of its own, so that one that
    hangs or is killed ends alone. Cases whose assertions bound a time that computing side by
    side could stretch (a timeout short enough that a starved healthy rank reads as lost) run fewer
    at a time (`at_once`): the point is to wait side by side, not to compute side by side."""
    with concurrent.futures.ThreadPoolExecutor(at_once or len(cases)) as pool:
        futures = {name: pool.submit(case) for name, case in cases.items()}
    return CaseResults({name: future.result for name, future in futures.items()})


def run_shared_concurrently(world_size: int, groups: list[dict[str, tuple[Callable[..., Any], tuple]]],
                            timeout_s: float = 90.0) -> CaseResults:
    """`run_shared` for each of `groups` (jobs by name, names unique across groups), each group in a
    spawned group of its own and all of them at once (`run_concurrently`); each job's per-rank
    results by name. Jobs that must follow one another in the same processes (one leaves them in a
    state the next relies on) belong to one group, in that order; a group that fails fails only the
    readers of its own jobs."""
    ran = run_concurrently({str(index): functools.partial(run_shared, world_size, jobs, timeout_s)
                            for index, jobs in enumerate(groups)})

    def job(group: str, name: str) -> list[Any]:
        return ran[group][name]

    return CaseResults({name: functools.partial(job, str(index), name) for index, jobs in enumerate(groups) for name in jobs})
