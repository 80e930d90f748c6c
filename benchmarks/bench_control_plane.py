"""The control plane at scale: what a job's store carries per rank, and how start-up, a round and the
naming of a lost rank grow with the number of ranks (docs/scaling.md, "The control plane").

    python benchmarks/bench_control_plane.py store                       # the store's own capacity
    python benchmarks/bench_control_plane.py jobs --ranks 16,32,64 --layouts flat,2d --reps 3

`store`: one torch `TCPStore` server (libuv, as torchrun's agent hosts it) in this process and
`--clients` client processes, each doing one kind of operation back to back for `--seconds`: a
heartbeat's `set`, a notice board read (`check` + `get`), a counter's `add`, and a `multi_get` of
`--keys` keys (a batched read of every peer's beat). It reports operations (and keys) per second
and the server's CPU seconds per operation (this process's getrusage: the server's loop thread is
nearly all it does), the figure that bounds one store on a core of its own.

`jobs`: ma jobs of N ranks forked from one preloaded process (`tests/multiprocess.py`: a rank does
not pay torch's imports, which a real job pays once per host, in parallel), the store in that
process as under torchrun. `flat`: a dense-only MLP (the control plane does not see the step's
all-to-all); `2d`: `sync.sharding_group_size: 2`, TorchRec's tiny model (`tests/tiny_dmp.py`)
sharded within each pair. Compute is simulated (each step sleeps up to `--step-ms`). Each job
SIGKILLs one rank (`--kill-rank`) at `--kill-step`; every survivor's error must name it. Per job:

- start: launch to the first step, median over ranks (fork, the gloo group, `join`, the model,
  `dense_sync`), and its slowest rank;
- store operations per second per rank in the steady window (first step to the kill), counted on
  every rank by wrapping `torch.distributed.Store`'s methods (Python calls only: torch's C++
  rendezvous inside a group's creation is not counted), and the operations each survivor made
  from the kill to naming the lost rank;
- naming: the kill to every survivor's `PeerLost` naming the killed rank (median and slowest);
- a round: the shadow rounds' mean latency (`sync.metrics`), median over ranks;
- CPU seconds of every rank (getrusage, summed) and of the store's process; each rank's peak RSS.

Results print as Markdown tables and go to `--output` as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

STORE_METHODS = ("set", "get", "check", "add", "compare_set", "wait", "delete_key", "multi_get", "multi_set",
                 "append", "num_keys")
"""The `torch.distributed.Store` operations that go to the store's server, counted by `StoreOps`."""


class StoreOps:
    """Counts this process's store operations by kind while it is entered: every Python call of
    `STORE_METHODS` on any store (a `TCPStore`, a `PrefixStore` over it, their clones), from any thread."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(STORE_METHODS, 0)
        self._lock = threading.Lock()
        self._originals = {name: getattr(dist.Store, name) for name in STORE_METHODS}

    def __enter__(self) -> StoreOps:
        for name, method in self._originals.items():
            setattr(dist.Store, name, self._counting(name, method))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, method in self._originals.items():
            setattr(dist.Store, name, method)

    def total(self) -> int:
        """Operations so far, every kind."""
        with self._lock:
            return sum(self.counts.values())

    def _counting(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def counted(store: dist.Store, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.counts[name] += 1
            return method(store, *args, **kwargs)
        return counted


# -- the store's capacity ------------------------------------------------------------------------------

STORE_KINDS = ("set", "read", "add", "multi_get")


def _store_client(port: int, client: int, keys: int, seconds: float, results: Any) -> None:
    """One client process: once every client is connected, each kind of `STORE_KINDS` back to back
    for `seconds`, the kinds `PHASE_GAP_S` apart from the start the launcher set; puts (kind, operations, keys read, seconds) after each, its last operation
    answered (a `set` is not: a `check` after it waits until the server has taken every one)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    store.add("connected", 1)
    store.wait(["start_at"])
    start_at = float(store.get("start_at"))
    names = [f"beat/{index}" for index in range(keys)]
    own = names[client % keys]
    operations: dict[str, Callable[[], int]] = {
        "set": lambda: store.set(own, "1") or 0,
        "read": lambda: int(store.check([own])) and len(store.get(own)) and 1,
        "add": lambda: store.add("counter", 1) and 0,
        "multi_get": lambda: len(store.multi_get(names)),
    }
    for phase, kind in enumerate(STORE_KINDS):
        time.sleep(max(0.0, start_at + phase * (seconds + PHASE_GAP_S) - time.time()))
        done = read = 0
        begun = time.monotonic()
        while time.monotonic() - begun < seconds:
            read += operations[kind]()
            done += 2 if kind == "read" else 1  # a read is two operations: check, then get
        store.check([own])
        results.put((kind, done, read if kind in ("read", "multi_get") else done, time.monotonic() - begun))


PHASE_GAP_S = 2.0
"""Between two kinds of `measure_store`: every client's last operation answered before the next kind."""
START_TIMEOUT_S = 900.0
"""How long `measure_store` waits for its clients to start (each imports torch) and connect."""


def measure_store(clients: int, keys: int, seconds: float) -> list[dict[str, Any]]:
    """Each kind of `STORE_KINDS` from `clients` processes at once against one libuv TCPStore server
    here; the server's CPU seconds are this process's over the kind's phase and the gap after it
    (its loop thread's: this thread sleeps)."""
    context = multiprocessing.get_context("spawn")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    for index in range(keys):
        server.set(f"beat/{index}", "0")
    results = context.Queue()
    processes = [context.Process(target=_store_client, args=(server.port, client, keys, seconds, results))
                 for client in range(clients)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while server.add("connected", 0) < clients:  # every client connected before the clock starts
        if time.monotonic() > deadline:
            raise SystemExit(f"only {server.add('connected', 0)} of {clients} store clients connected")
        time.sleep(0.2)
    start_at = time.time() + 1.0
    server.set("start_at", str(start_at))
    cpu = {}
    for phase, kind in enumerate(STORE_KINDS):  # a kind's phase ends when the next one starts: its drain included
        time.sleep(max(0.0, start_at + phase * (seconds + PHASE_GAP_S) - time.time()))
        cpu_before = _cpu_s(resource.RUSAGE_SELF)
        time.sleep(max(0.0, start_at + (phase + 1) * (seconds + PHASE_GAP_S) - time.time()))
        cpu[kind] = _cpu_s(resource.RUSAGE_SELF) - cpu_before
    counts = [results.get(timeout=60) for _ in range(clients * len(STORE_KINDS))]
    rows = []
    for kind in STORE_KINDS:
        mine = [count for count in counts if count[0] == kind]
        operations, keys_read = sum(count[1] for count in mine), sum(count[2] for count in mine)
        elapsed = max(count[3] for count in mine)
        rows.append({"kind": kind, "clients": clients, "keys": keys if kind == "multi_get" else 1,
                     "ops_per_s": operations / elapsed, "keys_per_s": keys_read / elapsed,
                     "server_cpu_s": cpu[kind], "server_us_per_op": 1e6 * cpu[kind] / max(operations, 1),
                     "server_us_per_key": 1e6 * cpu[kind] / max(keys_read, 1)})
    for process in processes:
        process.join()
    return rows


# -- the jobs ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One job of the `jobs` benchmark, the same on every rank."""

    group_size: int
    """`sync.sharding_group_size`: 0 flat, 2 the 2D layout."""
    steps: int
    step_s: float
    """Simulated compute: each step lasts at least this long."""
    kill_rank: int | None
    kill_step: int
    timeout_s: float
    """`sync.timeout_s`."""
    launched_at: float
    """Wall clock when the launcher started the ranks."""
    log: str
    """The fault log (the killed rank's own record of when it died)."""


def _flat_model() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[int], tuple[Any, ...]]]:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    inputs = torch.randn(64, 16)
    return model, torch.optim.SGD(model.parameters(), lr=0.01), lambda step: (inputs,)


def _2d_model(job: Any, rank: int) -> tuple[nn.Module, Any, Callable[[int], tuple[Any, ...]]]:
    """TorchRec's tiny model (`tests/tiny_dmp.py`) sharded within this rank's group, as a 2D job builds it
    (`job.dmp_kwargs()`: the sharding guard plans for the group)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from shadowgba.integrations.torchrec import dense_named_parameters
    from tests import tiny_dmp

    model = tiny_dmp.TinyRec()
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.1})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), **job.dmp_kwargs())
    optimizer = KeyedOptimizerWrapper(dict(dense_named_parameters(dmp)), tiny_dmp.dense_optimizer)
    return dmp, optimizer, lambda step: (tiny_dmp.batch(rank, step),)


def job_rank(rank: int, world_size: int, spec: JobSpec) -> dict[str, Any]:
    """One rank of a `jobs` job (`tests.multiprocess`): train with simulated compute, one rank killed;
    what this rank saw, with wall-clock times."""
    import shadowgba
    from dlrm.faults import FaultInjector
    from shadowgba.config import SyncConfig, from_dict

    entered = time.time()
    with StoreOps() as ops:
        config = from_dict(SyncConfig, {"algo": "ma", "sharding_group_size": spec.group_size, "timeout_s": spec.timeout_s,
                                        "first_round_after": 2, "log_interval_s": 0.0})
        job = shadowgba.join(config)
        record: dict[str, Any] = {"rank": rank, "entered": entered, "joined": time.time(), "ops_at_join": ops.total()}
        model, optimizer, inputs = _2d_model(job, rank) if spec.group_size else _flat_model()
        faults = FaultInjector(rank, log=spec.log)
        if spec.kill_rank is not None:
            faults.kill_at(spec.kill_rank, spec.kill_step)
        sync = shadowgba.dense_sync(model, optimizer, job)
        try:
            with sync:
                for step in range(spec.steps):
                    begun = time.perf_counter()
                    output = model(*inputs(step))
                    (output[0] if isinstance(output, tuple) else output).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    time.sleep(max(0.0, spec.step_s - (time.perf_counter() - begun)))
                    if step == 0:
                        record.update(first_step=time.time(), ops_at_first_step=ops.total())
                    record.update(last_step=time.time(), ops_at_last_step=ops.total(), steps=step + 1)
                    faults.after_step(step)
        except Exception as error:  # the lost rank's peers: what they name, and when
            record.update(failed=time.time(), named=list(getattr(error, "ranks", ()) or ()), error=repr(error)[:300])
        usage = resource.getrusage(resource.RUSAGE_SELF)
        summary = sync.metrics.summary()
        record.update(ops_at_end=ops.total(), ops=dict(ops.counts), cpu_s=usage.ru_utime + usage.ru_stime,
                      max_rss_mib=usage.ru_maxrss / 1024, rounds=summary["rounds"],
                      round_ms=summary["round_latency_ms_mean"])
        return record


def run_job(ranks: int, layout: str, args: argparse.Namespace) -> dict[str, Any]:
    """One job of `ranks` ranks; its figures (`summarise`) and every rank's record."""
    from tests.multiprocess import run_ranks_outcomes

    with tempfile.TemporaryDirectory() as directory:
        log = Path(directory) / "faults.jsonl"
        spec = JobSpec(group_size=2 if layout == "2d" else 0, steps=args.steps, step_s=args.step_ms / 1e3,
                       kill_rank=args.kill_rank, kill_step=args.kill_step, timeout_s=args.timeout_s,
                       launched_at=time.time(), log=str(log))
        cpu_before = _cpu_s(resource.RUSAGE_SELF)
        with MemoryUse() as memory:
            outcomes = run_ranks_outcomes(job_rank, ranks, spec, timeout_s=args.deadline_s)
        store_cpu = _cpu_s(resource.RUSAGE_SELF) - cpu_before
        killed_at = [json.loads(line)["at"] for line in log.read_text().splitlines()] if log.exists() else []
    records = [outcome.value for outcome in outcomes if outcome.returned]
    broken = {rank: outcome.traceback or ("killed" if outcome.killed else "hung") for rank, outcome in
              enumerate(outcomes) if not outcome.returned and rank != args.kill_rank}
    return {"ranks": ranks, "layout": layout, **summarise(spec, records, killed_at, store_cpu),
            "job_memory_mib": memory.peak_mib, "broken": broken, "records": records}


class MemoryUse:
    """The machine's memory taken while the block runs: the largest drop of MemAvailable
    (/proc/meminfo) below its value at the start, sampled every half second. Forked ranks share
    the preloaded process's pages, which each rank's RSS counts again; this counts them once."""

    def __init__(self) -> None:
        self.peak_mib = 0.0
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> MemoryUse:
        self._start = self._available_mib()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ended.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._ended.wait(0.5):
            self.peak_mib = max(self.peak_mib, self._start - self._available_mib())

    @staticmethod
    def _available_mib() -> float:
        line = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemAvailable"))
        return int(line.split()[1]) / 1024


def summarise(spec: JobSpec, records: Sequence[dict[str, Any]], killed_at: Sequence[float],
              store_cpu_s: float) -> dict[str, Any]:
    """A job's figures from its ranks' records (the killed rank's is missing)."""
    started = [record["first_step"] - spec.launched_at for record in records if "first_step" in record]
    steady = [(record["ops_at_last_step"] - record["ops_at_first_step"]) / (record["last_step"] - record["first_step"])
              for record in records if record.get("last_step", 0) > record.get("first_step", float("inf"))]
    named = [record["failed"] - killed_at[0] for record in records
             if killed_at and spec.kill_rank in record.get("named", ())]
    blame_ops = [record["ops_at_end"] - record["ops_at_last_step"] for record in records if "failed" in record]
    rounds = [record["round_ms"] for record in records if record["rounds"]]
    return {
        "start_s_median": _median(started), "start_s_max": max(started, default=None),
        "join_s_median": _median([record["joined"] - record["entered"] for record in records]),
        "ops_at_start_per_rank": _median([record.get("ops_at_first_step", 0) for record in records]),
        "steady_ops_per_s_per_rank": _median(steady),
        "survivors": len(records), "named_by": len(named),
        "named_s_median": _median(named), "named_s_max": max(named, default=None),
        "blame_ops_per_survivor": _median(blame_ops), "blame_ops_max": max(blame_ops, default=None),
        "round_ms_median": _median(rounds),
        "rounds_median": _median([record["rounds"] for record in records]),
        "rank_cpu_s": sum(record["cpu_s"] for record in records), "store_process_cpu_s": store_cpu_s,
        "max_rss_mib_median": _median([record["max_rss_mib"] for record in records]),
    }


# -- reporting -----------------------------------------------------------------------------------------

def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _spread(values: Sequence[float | None], digits: int = 1) -> str:
    """`median (min-max)` of the repetitions' values."""
    present = [value for value in values if value is not None]
    if not present:
        return "-"
    if len(present) == 1:
        return f"{present[0]:.{digits}f}"
    return f"{statistics.median(present):.{digits}f} ({min(present):.{digits}f}-{max(present):.{digits}f})"


def store_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| operation | clients | keys per op | ops/s | keys/s | server CPU per op (us) | per key (us) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {row['kind']} | {row['clients']} | {row['keys']} | {row['ops_per_s']:,.0f} | {row['keys_per_s']:,.0f} "
              f"| {row['server_us_per_op']:.1f} | {row['server_us_per_key']:.2f} |" for row in rows]
    return "\n".join(lines)


def jobs_table(jobs: Sequence[dict[str, Any]]) -> str:
    """One line per (layout, ranks): median (min-max) over the repetitions."""
    lines = ["| layout | ranks | reps | start s (slowest rank) | store ops at start per rank | steady store ops/s per rank "
             "| survivors naming the lost rank | naming s (slowest) | ops per survivor to name (most) | round ms "
             "| rank CPU s | store process CPU s | job memory MiB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key in sorted({(job["layout"], job["ranks"]) for job in jobs}):
        same = [job for job in jobs if (job["layout"], job["ranks"]) == key]
        column = lambda name, digits=1: _spread([job[name] for job in same], digits)  # noqa: E731
        naming = ", ".join(f"{job['named_by']}/{job['survivors']}" for job in same)
        lines.append(f"| {key[0]} | {key[1]} | {len(same)} | {column('start_s_median')} ({column('start_s_max')}) "
                     f"| {column('ops_at_start_per_rank', 0)} | {column('steady_ops_per_s_per_rank', 2)} | {naming} "
                     f"| {column('named_s_median')} ({column('named_s_max')}) | {column('blame_ops_per_survivor', 0)} "
                     f"({column('blame_ops_max', 0)}) "
                     f"| {column('round_ms_median')} | {column('rank_cpu_s', 0)} | {column('store_process_cpu_s')} "
                     f"| {column('job_memory_mib', 0)} |")
    return "\n".join(lines)


PROJECTED_RANKS = (1024, 4096)


def projection(store: Sequence[dict[str, Any]], jobs: Sequence[dict[str, Any]], before_ops_per_peer: float,
               silent_s: float) -> list[dict[str, Any]]:
    """The store's load at `PROJECTED_RANKS` from the measured figures: its CPU per round trip (the
    `read` rows: a check or a get) and per key of a `multi_get`; a rank's steady operations per
    second and the most requests a survivor made to name the lost rank (the largest job measured).
    The look-up is priced for every survivor at once (a flat job whose all-to-all pairs every rank
    with the lost one every step): read one key at a time, `before_ops_per_peer` round trips per
    peer; batched, the requests measured, each reading at most every peer's key; with lookers
    (`shadowgba.job.blame.decided_by_lookers`), `LOOKERS` batched look-ups and, for every other
    survivor, its ticket and two reads per poll (the decision, and whether a looker found nothing)
    while it waits (at most `LOOKERS_PATIENCE_S`). `silent_s`: how long a heartbeat may wait (`HEARTBEAT_SILENT_S`) before
    a live rank reads as silent."""
    from shadowgba.job.blame import DECISION_POLL_S, LOOKERS, LOOKERS_PATIENCE_S

    per_op = next(row["server_us_per_op"] for row in store if row["kind"] == "read") / 1e6
    per_key = next(row["server_us_per_key"] for row in store if row["kind"] == "multi_get") / 1e6
    largest = max(job["ranks"] for job in jobs)
    measured = [job for job in jobs if job["ranks"] == largest]
    steady = statistics.median(job["steady_ops_per_s_per_rank"] for job in measured)
    requests = statistics.median(job["blame_ops_max"] for job in measured)
    waiting_requests = 2 + 2 * LOOKERS_PATIENCE_S / DECISION_POLL_S  # the decision and the ticket, then the polls
    rows = []
    for ranks in PROJECTED_RANKS:
        look_up = requests * per_op + requests * (ranks - 1) * per_key
        before = (ranks - 1) * before_ops_per_peer * (ranks - 1) * per_op
        after = (ranks - 1) * look_up
        lookers = LOOKERS * look_up + (ranks - 1 - LOOKERS) * waiting_requests * per_op
        rows.append({"ranks": ranks, "steady_ops_per_s": ranks * steady, "steady_core_share": ranks * steady * per_op,
                     "lookup_store_s_before": before, "lookup_store_s_after": after, "lookup_store_s_lookers": lookers,
                     "heartbeats_starved_before": before > silent_s, "heartbeats_starved_after": after > silent_s,
                     "heartbeats_starved_lookers": lookers > silent_s})
    return rows


def projection_table(rows: Sequence[dict[str, Any]]) -> str:
    def starved(row: dict[str, Any], which: str) -> str:
        return "yes" if row[f"heartbeats_starved_{which}"] else "no"

    lines = ["| ranks | heartbeats: store ops/s | share of the store's core | every survivor's look-up at once, "
             "store CPU s: one key at a time | batched | two lookers, the others read their decision "
             "| longer than a heartbeat may wait? (one key / batched / lookers) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    lines += [f"| {row['ranks']:,} | {row['steady_ops_per_s']:,.0f} | {row['steady_core_share']:.1%} "
              f"| {row['lookup_store_s_before']:,.0f} | {row['lookup_store_s_after']:,.1f} "
              f"| {row['lookup_store_s_lookers']:,.2f} "
              f"| {starved(row, 'before')} / {starved(row, 'after')} / {starved(row, 'lookers')} |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    store = commands.add_parser("store", help="one TCPStore server's capacity")
    store.add_argument("--clients", type=int, default=8)
    store.add_argument("--keys", type=int, default=1024, help="keys per multi_get (a batched read of the beats)")
    store.add_argument("--seconds", type=float, default=5.0)
    jobs = commands.add_parser("jobs", help="ma jobs of N ranks, one rank killed")
    jobs.add_argument("--ranks", default="16,32,64")
    jobs.add_argument("--layouts", default="flat,2d")
    jobs.add_argument("--reps", type=int, default=1)
    jobs.add_argument("--steps", type=int, default=400, help="steps of a rank no failure stops")
    jobs.add_argument("--step-ms", type=float, default=200.0)
    jobs.add_argument("--kill-rank", type=int, default=5)
    jobs.add_argument("--kill-step", type=int, default=30)
    jobs.add_argument("--timeout-s", type=float, default=30.0, help="sync.timeout_s")
    jobs.add_argument("--deadline-s", type=float, default=300.0, help="a job still running after this is killed")
    project = commands.add_parser("project", help=f"the store's load at {PROJECTED_RANKS} ranks from the JSON of "
                                                  "store and jobs")
    project.add_argument("--store", type=Path, required=True, help="the JSON of `store`")
    project.add_argument("--jobs", type=Path, required=True, help="the JSON of `jobs`")
    project.add_argument("--before-ops-per-peer", type=float, required=True,
                         help="round trips per peer of a look-up that reads one key at a time (measured)")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "bench_control_plane.json")
    args = parser.parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if args.command == "project":
        from shadowgba.job.notices import HEARTBEAT_SILENT_S

        rows = projection(json.loads(args.store.read_text())["store"], json.loads(args.jobs.read_text())["jobs"],
                          args.before_ops_per_peer, HEARTBEAT_SILENT_S)
        print(projection_table(rows), flush=True)
        return
    if args.command == "store":
        rows = measure_store(args.clients, args.keys, args.seconds)
        print(store_table(rows), flush=True)
        args.output.write_text(json.dumps({"store": rows}, indent=1))
        return
    results = []
    for rep in range(args.reps):
        for ranks in (int(text) for text in args.ranks.split(",")):
            for layout in args.layouts.split(","):
                result = run_job(ranks, layout, args)
                results.append({**result, "rep": rep})
                shown = {key: value for key, value in result.items() if key not in ("records", "broken")}
                print(f"rep {rep} {layout} {ranks} ranks: {json.dumps(shown)}", flush=True)
                for rank, why in sorted(result["broken"].items())[:2]:
                    print(f"  rank {rank} did not return as a survivor: {why[-600:]}", flush=True)
                args.output.write_text(json.dumps({"jobs": results}, indent=1, default=str))
    print(jobs_table(results), flush=True)


if __name__ == "__main__":
    main()
