"""Run a function on N gloo ranks in fresh processes, with a hard deadline so a hang fails fast.

Each rank runs `fn(rank, world_size, *args)` after `init_process_group("gloo")` and sends back its
return value (serialised with torch.save) or its formatted traceback. `run_ranks` returns the per-rank results in rank order,
or raises with every failing rank's traceback; ranks still alive at the deadline are killed and
reported as hung. Processes are spawned (not forked) so no torch thread pool is inherited.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results: Any) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        encoded = io.BytesIO()
        torch.save(value, encoded)  # bytes, not shared-memory tensors that die with this process
        results.put((rank, True, encoded.getvalue()))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 90.0) -> list[Any]:
    """Run `fn` on `world_size` ranks; return their results or raise with the failures."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_entry, args=(fn, rank, world_size, port, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in processes) and results.empty():
                    break
                continue
            outcomes[rank] = (ok, value)
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    failures = [f"rank {rank}:\n{value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok]
    missing = [rank for rank in range(world_size) if rank not in outcomes]
    if missing:
        failures.append(f"ranks {missing} hung or died without a result (deadline {timeout_s}s)")
    if failures:
        raise AssertionError("\n".join(failures))
    return [torch.load(io.BytesIO(outcomes[rank][1]), weights_only=False) for rank in range(world_size)]


def _run_jobs(rank: int, world_size: int, jobs: list[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    return [fn(rank, world_size, *args) for fn, args in jobs]


def run_shared(world_size: int, jobs: dict[str, tuple[Callable[..., Any], tuple]], timeout_s: float = 90.0) -> dict[str, list[Any]]:
    """Run several independent jobs one after another in ONE spawned group of `world_size` ranks
    (process start-up is most of a small job's cost); returns each job's per-rank results by name.
    Every rank runs the jobs in the same order, so their collectives pair up job by job."""
    per_rank = run_ranks(_run_jobs, world_size, list(jobs.values()), timeout_s=timeout_s)
    return {name: [results[index] for results in per_rank] for index, name in enumerate(jobs)}
