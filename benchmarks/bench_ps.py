"""The parameter server alone: how fast its ranks ingest dense pushes and serve embedding rows.

    python benchmarks/bench_ps.py [--sizes 1KB,100KB,1MB,10MB] [--trainers 2] [--shards 1,2] \
        [--in-flight 1,4] [--push-dtypes float32,bfloat16] [--params-dtypes float32,bfloat16] [--reps 5] \
        [--duration-s 30] [--embeddings] [--threads 1] [--lane-mb 32] \
        [--trees after=.,before=/old/checkout]

No model and no training: every trainer rank pushes one fixed gradient of `--sizes` bytes as float32
(`--push-dtypes`: the same parameters also sent as bfloat16, `sync.gba.push_dtype`, half the bytes;
`--params-dtypes`: the watches' parameters sent back as bfloat16, `sync.gba.params_dtype`)
to the dense shards through `DenseShardClient.push` -- the trainers' real code path, shard 0
deciding each push with GBA's rule and the others following -- with `--in-flight` pushes
outstanding per trainer, as fast as the replies come back, while one watcher thread per trainer
long-polls the shards for each new global step's parameters (`DenseShardClient.watch`), as a GBA
trainer's does: the parameters the server sends are part of its cost. The shards run GBA as configured by
default (Adam, global batch = trainers x 512 samples, staleness decay), so the server's whole cost
per push is measured: receiving and decoding the request, validation, the finiteness check, the
buffer add, the optimizer step once per global batch, and the reply.

Every rank runs torch with `--threads` intra-op threads (default 1: the cores are the ranks'; a
user's trainer runs with torch's default of one per core, where whatever the transport does with
torch ops on large tensors spreads over an OpenMP pool).

Ingest per server rank = gradient bytes received by that rank per second (a push of B bytes over S
shards brings B/S to each), and the same in parameters per second, which compares dtypes. CPU
seconds are read with getrusage in every process at the start and end of each window (steal time
does not inflate them): "server CPU s / GiB" is what one GiB of ingest costs a server rank, the
figure that tells a faster transport from a less loaded machine.

`--floor` adds, per size and in-flight setting, the same calls made bare: the transport sending the
same gradient to a service on each server rank that returns at once (`Probe.floor`), one call per
push and no watcher. That is what the transport alone costs at that size, the floor no server code
can go below; "floor" rows give its pushes/s and CPU beside the real pushes'.

Either layout of the transport is driven through one adapter (`PS`): this tree's two ends
(`start_transport`) or the single `Transport` before them, so that `--trees` compares them.

`--embeddings` adds the embedding side per world: lookups of 4,096 ids (rows/s) and row-gradient
pushes of 4,096 rows (rows/s) against PS-hosted tables of 100K x 64 rows, the same client
(`PSEmbeddingBagCollection`'s service) the trainers use.

Interleaving: for each repetition, for each world (trainers x shards), for each `--trees` entry, one
group of processes is spawned and measures every size, dtype pair and in-flight setting in turn; `--trees`
names checkouts whose `shadowgba` the processes import (e.g. the code before and after an
optimisation: `--trees after=.,before=/tmp/old`; `--trees shm=.,tcp=.+tcp,lend=.+lend`: this checkout
with and without its same-host path or one step of it, `WITHOUT`), so their ratio is measured side by
side. Each
figure is the median over repetitions with its min-max; ratios (of parameters per second) are per
repetition to the first tree's first dtype pair, then the median.
Prints Markdown tables and writes every window's numbers to runs/bench_ps.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_summary import Column, markdown_table, ratios_to  # noqa: E402
from dlrm.host import cpu_seconds, free_port  # noqa: E402

LOCAL_BATCH = 512
"""Samples per push (its weight in the global batch)."""
EMBEDDING_ROWS, EMBEDDING_DIM, EMBEDDING_IDS = 100_000, 64, 4096
"""Embedding side: one table of this many rows x dim per benchmark, and ids per lookup / push."""
GIB = 1 << 30
DENSE_KINDS = ("dense", "floor")
"""Window kinds measured in pushes and GiB/s: real pushes, and the same bytes sent bare (`--floor`)."""
UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "B": 1}


@dataclasses.dataclass(frozen=True)
class World:
    """One group of processes: `trainers` pushing ranks and `shards` server ranks, importing `tree`."""

    trainers: int
    shards: int
    tree: str
    tree_path: str
    without: str = ""
    """A tree `PATH+STEP`: that checkout without one step of its same-host path (`WITHOUT`)."""


def parse_size(text: str) -> int:
    """'1KB' / '10MB' / '4096' -> bytes (a multiple of 4: float32 elements)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(KB|MB|GB|B)?", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1KB, 10MB)")
    size = int(float(match.group(1)) * UNITS[match.group(2) or "B"])
    return max(4, size // 4 * 4)


class Probe:
    """Served on every server rank: its CPU clock, read by trainer 0 around a window, and the floor."""

    def cpu(self) -> float:
        return cpu_seconds()

    def floor(self, gradient: Any) -> int:
        """`--floor`: receives the gradient and returns at once."""
        return 0


class PS:
    """The transport of the tree a world imports, whichever its layout: this one's (`start_transport`,
    the dense shards in `shadowgba.gba`), or the one before (`Transport.start`, the dense shards in
    `shadowgba.ps.dense_server`), so that one invocation compares a change with its parent."""

    def __init__(self, num_servers: int, lane_mb: float | None = None, without: str = "") -> None:
        from shadowgba.job.config import PSConfig

        try:
            from shadowgba.ps.start import start_transport
        except ImportError:  # the tree before the transport's two ends
            from shadowgba.ps.transport import Transport

            start_transport = Transport.start
        lanes = {} if lane_mb is None else {"lane_bytes": PSConfig(lane_mb=lane_mb).lane_bytes}
        if without == "tcp":  # sync.ps.same_host: false
            lanes = {"lane_bytes": 0}
        elif without:
            _drop_step(without)
        self.api: Any = start_transport(num_servers, **lanes)
        self.roles = self.api.roles

    def call(self, server: int, name: str, method: str, *args: Any) -> Any:
        return self.api.call(server, name, method, *args)

    def call_async(self, server: int, name: str, method: str, *args: Any) -> Any:
        return self.api.call_async(server, name, method, *args)

    def call_each(self, name: str, method: str, args_by_server: Sequence[tuple[Any, ...]]) -> list[Any]:
        return self.api.call_each(name, method, args_by_server)

    def serve(self, name: str, service: object) -> None:
        self.api.serve(name, service)

    def stop(self) -> None:
        self.api.stop(trainer_timeout_s=600)

    def serve_dense_shard(self) -> None:
        dense_shards("server").serve_dense_shard(self.api)

    def dense_client(self, numel: int) -> Any:
        return dense_shards("shards").DenseShardClient(numel, self.api)


def dense_shards(side: str) -> Any:
    """The tree's module of the dense shards' `side` (server: `serve_dense_shard`; shards: the client)."""
    try:
        return importlib.import_module(f"shadowgba.gba.{side}")
    except ImportError:  # the tree before they moved into shadowgba.gba
        return importlib.import_module("shadowgba.ps.dense_server")


WITHOUT = ("tcp", "lend", "board", "renice")
"""What a tree `PATH+STEP` leaves out: the whole same-host path (`sync.ps.same_host: false`), or one
of its steps (`shadowgba/ps/same_host.py`), patched out in the benchmark's own processes only: the
server's lent requests (copies instead), its board (parameters through each trainer's lane), or the
gloo loop's lower priority. So that each step is measured against the path with it, side by side."""


def _drop_step(step: str) -> None:
    """Patch one step of the same-host path out of this process's transport (see `WITHOUT`)."""
    from shadowgba.ps import channel, same_host, server_end

    if step == "lend":
        class Copying(channel.Channel):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **{**kwargs, "lend": False})

        server_end.Channel = Copying
    elif step == "board":
        class NoBoard:
            @staticmethod
            def create(nbytes: int | None = None) -> None:
                return None

        server_end.Board = NoBoard
    elif step == "renice":
        same_host.lower_loop_priority = lambda threads: None
    else:
        raise ValueError(f"a tree's +STEP is one of {list(WITHOUT)}, got {step!r}")


def _rank_main(rank: int, world: World, port: int, plan: dict[str, Any], results: Any) -> None:
    """One process of a world: a server serving the dense shard (and a table), or a pushing trainer."""
    sys.path.insert(0, world.tree_path)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world.trainers + world.shards))
    import torch

    torch.set_num_threads(plan["threads"])
    ps = PS(world.shards, plan["lane_mb"], world.without)
    roles = ps.roles
    try:
        if roles.is_server:
            ps.serve_dense_shard()
            ps.serve("bench", Probe())
            if plan["embeddings"]:
                ps.serve("embedding", _embedding_shard(roles.server_index, world.shards))
            ps.stop()
            return
        windows = _trainer_windows(ps, world, plan)
        if roles.trainer_index == 0:
            results.put(windows)
        ps.stop()
    except BaseException as error:
        results.put({"error": f"rank {rank}: {error!r}"})
        raise


def _embedding_shard(server_index: int, num_servers: int) -> Any:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    try:
        from shadowgba.ps.embedding_shard import EmbeddingShard, PSEmbeddingConfig
    except ImportError:  # the tree before the embedding shard had a module of its own
        from shadowgba.ps.embedding import EmbeddingShard, PSEmbeddingConfig

    table = EmbeddingBagConfig(name="t0", embedding_dim=EMBEDDING_DIM, num_embeddings=EMBEDDING_ROWS,
                               feature_names=["f0"])
    return EmbeddingShard([table], PSEmbeddingConfig(optimizer="rowwise_adagrad", lr=0.01), server_index, num_servers)


def _trainer_windows(ps: PS, world: World, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (size, in-flight) window of this world in turn, then the embedding windows."""
    import torch
    import torch.distributed as dist

    from shadowgba.flat_optimizer import FlatOptimizer, LRSchedule, OptimizerSpec
    from shadowgba.gba.config import GBAConfig

    roles = ps.roles
    group = roles.trainer_group
    windows = []
    for size, push_dtype, params_dtype in ((size, push, params) for size in plan["sizes"]
                                           for push in plan["push_dtypes"] for params in plan["params_dtypes"]):
        numel = size // 4
        shards = ps.dense_client(numel)
        if roles.trainer_index == 0:
            spec = OptimizerSpec("Adam", {"lr": 1e-4}, LRSchedule())
            # float32 is every tree's default: a tree from before these settings existed runs it too
            config = GBAConfig(**{key: dtype for key, dtype in (("push_dtype", push_dtype), ("params_dtype", params_dtype))
                                  if dtype != "float32"})
            shards.configure(world.trainers, spec, FlatOptimizer(spec, torch.zeros(numel)).export(), config,
                             world.trainers * LOCAL_BATCH)
        dist.barrier(group=group)  # configured before anyone pushes
        gradient = torch.full((numel,), 1e-3, dtype=getattr(torch, push_dtype))
        for in_flight in plan["in_flight"]:
            dist.barrier(group=group)
            probe = _server_clock(ps) if roles.trainer_index == 0 else None
            pushes, kept, cpu, elapsed = _push_for(shards, roles.trainer_index, gradient, in_flight,
                                                   plan["duration_s"])
            windows += _dense_window(ps, world, "dense", gradient, params_dtype, in_flight, probe,
                                     (pushes, kept, cpu, elapsed))
            if plan["floor"] and params_dtype == plan["params_dtypes"][0]:  # no watcher: one floor per push dtype
                dist.barrier(group=group)
                probe = _server_clock(ps) if roles.trainer_index == 0 else None
                windows += _dense_window(ps, world, "floor", gradient, None, in_flight, probe,
                                         _bare_calls_for(ps, gradient, in_flight, plan["duration_s"]))
    if plan["embeddings"]:
        windows += _embedding_windows(ps, world, plan)
    return windows


def _dense_window(ps: PS, world: World, kind: str, gradient: Any, params_dtype: str | None, in_flight: int,
                  probe: list[float] | None, measured: tuple[int, int, float, float]) -> list[dict[str, Any]]:
    """Every trainer's (pushes, kept, CPU s, seconds) of pushing `gradient` (the watches' parameters
    in `params_dtype`; None: no watcher) summed into trainer 0's record of one window (collective
    over the trainers; the others return nothing)."""
    import torch
    import torch.distributed as dist

    pushes, kept, cpu, elapsed = measured
    totals = torch.tensor([pushes, kept, cpu], dtype=torch.float64)
    dist.all_reduce(totals, group=ps.roles.trainer_group)
    if ps.roles.trainer_index != 0:
        return []
    server_cpu = [end - start for start, end in zip(probe, _server_clock(ps))]
    ingest = totals[0].item() * gradient.numel() * gradient.element_size() / elapsed / world.shards
    return [{
        "kind": kind, "size": gradient.numel() * 4, "push_dtype": str(gradient.dtype).removeprefix("torch."),
        "params_dtype": params_dtype, "in_flight": in_flight, "window_s": elapsed,
        "pushes_per_s": totals[0].item() / elapsed, "kept_fraction": totals[1].item() / max(totals[0].item(), 1),
        "ingest_gib_per_s_per_server": ingest / GIB,
        "params_per_s_per_server": totals[0].item() * gradient.numel() / elapsed / world.shards,
        "server_cpu_s_per_gib": statistics.mean(server_cpu) / max(ingest * elapsed / GIB, 1e-12),
        "server_cpu_share": statistics.mean(server_cpu) / elapsed,
        "trainer_cpu_s_per_push": totals[2].item() / max(totals[0].item(), 1),
    }]


def _server_clock(ps: PS) -> list[float]:
    return [ps.call(server, "bench", "cpu") for server in range(ps.roles.num_servers)]


def _push_for(shards: Any, trainer: int, gradient: Any, in_flight: int, duration_s: float) -> tuple[int, int, float, float]:
    """Push `gradient` from `in_flight` threads for `duration_s` while a watcher long-polls the
    shards for new parameters, as a GBA trainer does: (pushes, kept, CPU s, seconds)."""
    token = [0]
    counts = [0, 0]
    lock = threading.Lock()
    deadline = time.monotonic() + duration_s
    # code before the push replies lost their redundant parameters has no reply_params: it always sent them
    quiet = {"reply_params": False} if "reply_params" in inspect.signature(shards.push).parameters else {}

    def seen(replies: Sequence[Any]) -> None:
        with lock:
            token[0] = max(token[0], min(reply.token for reply in replies))

    def pusher() -> None:
        while time.monotonic() < deadline:
            replies = shards.push(trainer, gradient, token[0], LOCAL_BATCH, 0.01, **quiet)
            with lock:
                counts[0] += 1
                counts[1] += replies[0].weight > 0
            seen(replies)

    def watcher() -> None:
        while time.monotonic() < deadline:
            seen(shards.watch([token[0]] * len(shards.bounds), min(0.25, max(deadline - time.monotonic(), 0.0))))

    cpu, elapsed = _run_threads([pusher] * in_flight + [watcher])
    return counts[0], counts[1], cpu, elapsed


def _run_threads(targets: Sequence[Any]) -> tuple[float, float]:
    """Run each target in a thread of its own until all return: (this process's CPU s, seconds)."""
    cpu, started = cpu_seconds(), time.monotonic()
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return cpu_seconds() - cpu, time.monotonic() - started


def _bare_calls_for(ps: PS, gradient: Any, in_flight: int, duration_s: float) -> tuple[int, int, float, float]:
    """`--floor`: each push's slices sent bare to `Probe.floor` on their shards from `in_flight`
    threads for `duration_s`: (calls, calls, CPU s, seconds)."""
    from shadowgba.flat_optimizer import shard_bounds

    bounds = shard_bounds(gradient.numel(), ps.roles.num_servers)
    counts = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + duration_s

    def caller() -> None:
        while time.monotonic() < deadline:
            calls = [ps.call_async(index, "bench", "floor", gradient[start:end])
                     for index, (start, end) in enumerate(bounds)]
            for call in calls:
                call.wait()
            with lock:
                counts[0] += 1

    cpu, elapsed = _run_threads([caller] * in_flight)
    return counts[0], counts[0], cpu, elapsed


def _embedding_windows(ps: PS, world: World, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Lookups and row-gradient pushes of EMBEDDING_IDS random rows, one call in flight per trainer."""
    import torch
    import torch.distributed as dist

    roles = ps.roles
    generator = torch.Generator().manual_seed(roles.trainer_index)
    windows = []
    for kind in ("lookup", "row_push"):
        dist.barrier(group=roles.trainer_group)
        calls, started, cpu = 0, time.monotonic(), cpu_seconds()
        while time.monotonic() - started < plan["duration_s"]:
            ids = torch.randint(0, EMBEDDING_ROWS, (EMBEDDING_IDS,), generator=generator)
            per_server = [ids[ids % world.shards == server] for server in range(world.shards)]
            if kind == "lookup":
                ps.call_each("embedding", "lookup", [({"t0": part},) for part in per_server])
            else:
                ps.call_each("embedding", "push", [
                    ({"t0": (part, torch.full((part.numel(), EMBEDDING_DIM), 1e-3))}, LOCAL_BATCH) for part in per_server
                ])
            calls += 1
        elapsed = time.monotonic() - started
        totals = torch.tensor([calls, cpu_seconds() - cpu], dtype=torch.float64)
        dist.all_reduce(totals, group=roles.trainer_group)
        if roles.trainer_index == 0:
            windows.append({"kind": kind, "size": EMBEDDING_IDS, "in_flight": 1, "window_s": elapsed,
                            "rows_per_s": totals[0].item() * EMBEDDING_IDS / elapsed,
                            "trainer_cpu_s_per_call": totals[1].item() / max(totals[0].item(), 1)})
    return windows


def run_world(world: World, plan: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """Spawn one world, return trainer 0's windows (or exit naming the failure)."""
    import torch.multiprocessing as mp

    port = free_port()
    context = mp.get_context("spawn")
    results = context.Queue()
    size = world.trainers + world.shards
    processes = [context.Process(target=_rank_main, args=(rank, world, port, plan, results)) for rank in range(size)]
    for process in processes:
        process.start()
    try:
        windows = results.get(timeout=timeout_s)
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    if isinstance(windows, dict):
        raise SystemExit(f"{world} failed: {windows['error']}")
    return windows


def _code(record: dict[str, Any]) -> tuple[str, str | None, str | None]:
    """What a window measured beside its cell: the tree, and the push and params dtypes (None for
    what does not apply: the floor has no watcher, the embedding side neither)."""
    return record["tree"], record.get("push_dtype"), record.get("params_dtype")


def summarize(records: list[dict[str, Any]], trees: Sequence[str], push_dtypes: Sequence[str],
              params_dtypes: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (kind, trainers, shards, size, in-flight) and code (tree; push and params dtypes
    for the dense windows, the push dtype for the floor's): medians and min-max of GiB/s per server
    (rows/s for the embedding side), and the ratio of parameters (rows) per second to the first
    code, per repetition."""
    keys = sorted({(r["kind"], r["trainers"], r["shards"], r["size"], r["in_flight"]) for r in records})
    rows = []
    for kind, trainers, shards, size, in_flight in keys:
        cell = [r for r in records if (r["kind"], r["trainers"], r["shards"], r["size"], r["in_flight"]) ==
                (kind, trainers, shards, size, in_flight)]
        dense = kind in DENSE_KINDS
        metric, compared = ("ingest_gib_per_s_per_server", "params_per_s_per_server") if dense else ("rows_per_s",) * 2
        codes = [(tree, push, params) for tree in trees for push in (push_dtypes if dense else [None])
                 for params in (params_dtypes if kind == "dense" else [None])]
        base = [r for r in cell if _code(r) == codes[0]]
        for tree, push, params in codes:
            mine = [r for r in cell if _code(r) == (tree, push, params)]
            values = [r[metric] for r in mine]
            row = {"kind": kind, "trainers": trainers, "shards": shards, "size": size, "in_flight": in_flight,
                   "tree": tree, "push_dtype": push, "params_dtype": params, "reps": len(mine),
                   "median": statistics.median(values), "min": min(values), "max": max(values)}
            if dense:
                row |= {key: statistics.median(r[key] for r in mine)
                        for key in ("pushes_per_s", "params_per_s_per_server", "server_cpu_s_per_gib",
                                    "server_cpu_share", "kept_fraction", "trainer_cpu_s_per_push")}
            ratios = ratios_to(mine, base, key=lambda r: r["rep"], value=lambda r: r[compared])
            row["ratio"] = statistics.median(ratios) if ratios and (tree, push, params) != codes[0] else None
            rows.append(row)
    return rows


def _size(size: int) -> str:
    for unit in ("GB", "MB", "KB"):
        if size >= UNITS[unit] and size % (UNITS[unit] // 1024 or 1) == 0:
            return f"{size / UNITS[unit]:g} {unit}"
    return f"{size} B"


DENSE_COLUMNS: list[Column] = [
    ("trainers x shards", lambda row: f"{row['trainers']} x {row['shards']}"),
    ("push (as float32)", lambda row: _size(row["size"])),
    ("calls", lambda row: "pushes" if row["kind"] == "dense" else "bare calls (floor)"),
    ("in flight", lambda row: str(row["in_flight"])),
    ("code", lambda row: row["tree"]),
    ("push dtype", lambda row: row["push_dtype"]),
    ("params dtype", lambda row: row["params_dtype"] or "-"),
    ("GiB/s per server (median)", lambda row: f"{row['median']:.3f}"),
    ("min-max", lambda row: f"{row['min']:.3f}-{row['max']:.3f}"),
    ("M params/s per server", lambda row: f"{row['params_per_s_per_server'] / 1e6:.1f}"),
    ("ratio (params/s)", lambda row: "-" if row["ratio"] is None else f"{row['ratio']:.2f}"),
    ("pushes/s (all)", lambda row: f"{row['pushes_per_s']:,.0f}"),
    ("server CPU s / GiB", lambda row: f"{row['server_cpu_s_per_gib']:.2f}"),
    ("server CPU busy", lambda row: f"{row['server_cpu_share']:.0%}"),
    ("server CPU ms / call", lambda row: f"{row['server_cpu_s_per_gib'] * row['median'] / row['pushes_per_s'] * 1e3:.3f}"),
    ("trainer CPU ms / call", lambda row: f"{row['trainer_cpu_s_per_push'] * 1e3:.3f}"),
    ("kept", lambda row: f"{row['kept_fraction']:.0%}" if row["kind"] == "dense" else "-"),
]
ROW_COLUMNS: list[Column] = [
    ("trainers x shards", lambda row: f"{row['trainers']} x {row['shards']}"),
    ("call", lambda row: f"{row['kind']} of {row['size']:,} rows"),
    ("code", lambda row: row["tree"]),
    ("rows/s (median)", lambda row: f"{row['median']:,.0f}"),
    ("min-max", lambda row: f"{row['min']:,.0f}-{row['max']:,.0f}"),
    ("ratio", lambda row: "-" if row["ratio"] is None else f"{row['ratio']:.2f}"),
]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1KB,100KB,1MB,10MB", help="comma-separated push sizes (float32 bytes)")
    parser.add_argument("--trainers", default="2", help="comma-separated trainer counts")
    parser.add_argument("--shards", default="1,2", help="comma-separated dense shard (server rank) counts")
    parser.add_argument("--in-flight", default="1,4", help="comma-separated pushes outstanding per trainer")
    parser.add_argument("--push-dtypes", default="float32",
                        help="comma-separated dtypes the gradients are pushed in (float32, bfloat16)")
    parser.add_argument("--params-dtypes", default="float32",
                        help="comma-separated dtypes the watches' parameters come back in (float32, bfloat16)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the interleaved sequence")
    parser.add_argument("--duration-s", type=float, default=30.0, help="timed window of each measurement")
    parser.add_argument("--embeddings", action="store_true", help="also measure lookups and row pushes")
    parser.add_argument("--floor", action="store_true", help="also send the same bytes bare (the transport's own cost)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads per rank (a user's trainer runs with one per core, torch's default)")
    parser.add_argument("--lane-mb", type=float, default=None,
                        help="sync.ps.lane_mb of the channel transport's trees (default: theirs)")
    parser.add_argument("--trees", default=f"current={ROOT}",
                        help="comma-separated NAME=PATH checkouts to import shadowgba from (first: the baseline); "
                             f"PATH+STEP, STEP one of {list(WITHOUT)}: that checkout without its same-host path "
                             "(tcp: sync.ps.same_host: false) or one step of it")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "bench_ps.json", help="JSON results")
    args = parser.parse_args(argv)
    trees = dict(part.split("=", 1) for part in args.trees.split(","))
    plan = {"sizes": [parse_size(size) for size in args.sizes.split(",")],
            "in_flight": [int(value) for value in args.in_flight.split(",")],
            "push_dtypes": args.push_dtypes.split(","), "params_dtypes": args.params_dtypes.split(","),
            "duration_s": args.duration_s, "embeddings": args.embeddings, "floor": args.floor,
            "threads": args.threads, "lane_mb": args.lane_mb}
    worlds = [(int(t), int(s)) for t in args.trainers.split(",") for s in args.shards.split(",")]
    per_world_s = ((len(plan["params_dtypes"]) + args.floor) * len(plan["sizes"]) * len(plan["push_dtypes"])
                   * len(plan["in_flight"])
                   + 2 * args.embeddings) * (
        args.duration_s + 5) + 120
    records = []
    for rep in range(args.reps):
        for trainers, shards in worlds:
            for name, path in trees.items():
                path, _, without = path.partition("+")
                world = World(trainers, shards, name, str(Path(path).resolve()), without=without)
                for window in run_world(world, plan, per_world_s):
                    records.append({"rep": rep, "trainers": trainers, "shards": shards, "tree": name, **window})
                    shown = (f"{window['ingest_gib_per_s_per_server']:.3f} GiB/s per server, "
                             f"{window['pushes_per_s']:,.0f} pushes/s" if window["kind"] in DENSE_KINDS
                             else f"{window['rows_per_s']:,.0f} rows/s")
                    what = (f"{_size(window['size'])} as {window['push_dtype']}, params {window['params_dtype']}"
                            if window["kind"] in DENSE_KINDS
                            else f"{window['size']:,} rows")
                    print(f"rep {rep} {trainers}x{shards} {name} {window['kind']} {what} "
                          f"in-flight {window['in_flight']}: {shown}", flush=True)
    rows = summarize(records, list(trees), plan["push_dtypes"], plan["params_dtypes"])
    print(markdown_table(DENSE_COLUMNS, [row for row in rows if row["kind"] in DENSE_KINDS]))
    if args.embeddings:
        print(markdown_table(ROW_COLUMNS, [row for row in rows if row["kind"] not in DENSE_KINDS]))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: str(value) for key, value in vars(args).items()} | {"cpu_count": os.cpu_count()}
    args.output.write_text(json.dumps({"settings": settings, "summary": rows, "windows": records}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
