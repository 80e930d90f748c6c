"""Measure the throughput model's inputs on this machine, then check its predictions against the benchmarks.

    python benchmarks/calibrate.py measure [--reps 5] [--ranks 2,4,8] [--presets small,production,example]
    python benchmarks/calibrate.py fit        # refit the model's inputs from the JSON's measured points
    python benchmarks/calibrate.py validate [--scaling runs/bench_scaling.json] [--gba 'runs/bench_gba_*.json']

`measure` writes runs/throughput_calibration.json: every measured point (median of `--reps`
repetitions, wall and CPU seconds from getrusage beside each) and the model's inputs fitted from
them (`throughput_model.Calibration`):
- per-step compute of the harness's model (`dlrm.model.build_model`, TorchRec tables, one torch
  thread, a world of one rank) for each of `PRESETS`, and for `SHARDED_PRESETS` again in worlds of
  2, 4, 8 ranks with the tables TorchRec-sharded over them (the step's all-to-alls included);
- gloo all-reduce time vs bytes (1 KB - 16 MB) and ranks (spawned processes on loopback), fitted by
  least squares to the ring formula (bandwidth, per-hop latency);
- dense-shard ingest per push size and embedding lookups: from runs/bench_ps.json when it exists
  (the parameter server's own benchmark), else from a stand-in measured here (one rank serving over
  `torch.distributed.rpc`: a buffer add per push, `index_select` per lookup) -- the JSON says which;
- memory bandwidth of copying the dense vector, and how much a busy copying thread slows a
  training step (the shadow thread's steal).

`validate` prints predicted vs measured samples/s and the relative error for every size and variant
of bench_scaling's JSON (none, ddp, shadow algorithms at 1-8 trainers, all ranks on this machine's
cores) and every run of bench_gba's JSONs (sync vs GBA under a straggler).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from dlrm.host import cpu_seconds, free_port
from example_job import ROOT
import throughput_model as tm

DEFAULT_OUTPUT = ROOT / "runs" / "throughput_calibration.json"
BENCH_PS = ROOT / "runs" / "bench_ps.json"
PRESETS = ("small", "production", "example")
"""Models whose step is measured: the harness's presets `small` (the benchmarks' throughput model)
and `production` (MLPerf DLRM's dense size), and `example`, the config defaults that bench_gba trains."""


SIZES = [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24]
"""Sizes of the all-reduce and push measurements: 1 KB to 16 MB, every factor of 4."""
LOOKUP_ROWS = [256, 1024, 4096, 16384]
"""Rows per lookup in the stand-in (a small preset's step looks up 4,096)."""
TABLE_ROWS, TABLE_DIM = 100_000, 64
"""The stand-in's embedding table."""
STEPS_PER_REP = 10
"""Training steps timed per repetition of the compute measurement."""
SHADOW_STEAL_PRESET = "small"
"""The preset whose step is timed beside a copying thread (the shadow steal)."""
SHARDED_PRESETS = ("small", "production")
"""Presets whose step is also timed with the tables TorchRec-sharded over 2, 4, 8 ranks (`--ranks`):
the benchmarks that train TorchRec tables (bench_scaling, bench_sync) run these."""


def preset_arguments(preset: str) -> list[str]:
    """train_dlrm.py overrides that build `preset`'s model."""
    from dlrm.config import preset_overrides

    return [] if preset == "example" else preset_overrides(preset)


def timed(operation: Callable[[], Any], reps: int, count: int) -> dict[str, float]:
    """Median over `reps` repetitions of `count` calls of `operation`: wall and CPU seconds per call."""
    walls, cpus = [], []
    operation()
    for _ in range(reps):
        wall, cpu = time.perf_counter(), cpu_seconds()
        for _ in range(count):
            operation()
        walls.append((time.perf_counter() - wall) / count)
        cpus.append((cpu_seconds() - cpu) / count)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "reps": reps,
            "wall_s_min": min(walls), "wall_s_max": max(walls)}


def _step_cost(preset: str, reps: int, rank: int, world_size: int, steal: bool) -> dict[str, Any]:
    """Time one training step of the harness's model for `preset` on this rank of an initialised
    world of `world_size` ranks (TorchRec shards the tables over them, so a step's all-to-alls are in
    the time); with `steal`, also the shadow steal beside it."""
    import torch
    from dlrm.config import ExperimentConfig
    from dlrm.job import join
    from dlrm.model import DENSE_OPTIMIZERS, build_model
    from ctrkit.datasets import open_dataset
    from shadowgba.config import load_config

    config = load_config(ExperimentConfig, None, [*preset_arguments(preset), "--baseline", "none"])
    data = open_dataset(config.data)
    model = build_model(config, data, join(config, data, "gloo"), torch.device("cpu"))
    optimizer = DENSE_OPTIMIZERS[config.train.dense_optimizer](model.dense_params, lr=config.train.dense_lr)
    batches = data.train_batches(rank, world_size)

    def step() -> None:
        loss, _ = model.module(next(batches))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step_cost = timed(step, reps, STEPS_PER_REP)
    synthetic = config.data.synthetic
    return {
        "preset": preset, "ranks": world_size, **step_cost,
        "dense_params": sum(param.numel() for param in model.dense_params), "batch_size": config.data.batch_size,
        "lookup_bytes": synthetic.num_tables * synthetic.ids_per_sample * config.data.batch_size
        * config.model.embedding_dim * 4,
        "shadow_steal": shadow_steal(step, model.dense_params, reps) if steal else None,
    }


def measure_compute(preset: str, reps: int) -> dict[str, Any]:
    """One training step of the harness's model for `preset`, alone in a world of one rank."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        return _step_cost(preset, reps, 0, 1, steal=preset == SHADOW_STEAL_PRESET)
    finally:
        dist.destroy_process_group()


def _world_rank(rank: int, world_size: int, port: int, measure: Callable[..., list[dict[str, Any]]],
                args: tuple[Any, ...], output: str) -> None:
    """One rank of a spawned gloo world (one torch thread) running `measure(rank, world_size, *args)`;
    rank 0 writes the points it returns."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    points = measure(rank, world_size, *args)
    if rank == 0:
        Path(output).write_text(json.dumps(points))
    dist.destroy_process_group()


def measure_in_worlds(measure: Callable[..., list[dict[str, Any]]], ranks: Sequence[int],
                      *args: Any) -> list[dict[str, Any]]:
    """`measure` in a fresh world of spawned processes for each rank count; rank 0's points, in order."""
    import torch.multiprocessing as mp

    points = []
    with tempfile.TemporaryDirectory() as scratch:
        for world_size in ranks:
            output = str(Path(scratch) / f"world_{world_size}.json")
            mp.start_processes(_world_rank, (world_size, free_port(), measure, args, output), nprocs=world_size,
                               start_method="spawn")
            points += json.loads(Path(output).read_text())
    return points


def sharded_step_points(rank: int, world_size: int, presets: Sequence[str], reps: int) -> list[dict[str, Any]]:
    """A training step of each preset with the tables TorchRec-sharded over the world, as
    bench_scaling's jobs have them: its embedding all-to-alls (ids, pooled rows, their gradients)
    are part of each step's cost, and that cost grows with the ranks."""
    return [_step_cost(preset, reps, rank, world_size, steal=False) for preset in presets]


def shadow_steal(step: Callable[[], None], params: Sequence[Any], reps: int) -> dict[str, float]:
    """How much a thread copying the dense vector back to back (the shadow thread's work, one core
    busy) slows `step`: the slowdown per busy core, with the copy bandwidth it reached."""
    import torch

    flat = torch.cat([param.detach().reshape(-1) for param in params])
    copies = [torch.empty_like(flat) for _ in range(2)]
    done = threading.Event()
    copied = [0]

    def copy_loop() -> None:
        while not done.is_set():
            copies[copied[0] % 2].copy_(flat)
            copied[0] += 1

    alone = timed(step, reps, STEPS_PER_REP)
    worker = threading.Thread(target=copy_loop, daemon=True)
    started = time.perf_counter()
    worker.start()
    beside = timed(step, reps, STEPS_PER_REP)
    done.set()
    worker.join()
    elapsed = time.perf_counter() - started
    copy = timed(lambda: copies[0].copy_(flat), reps, 50)
    return {"step_alone_s": alone["wall_s"], "step_beside_copies_s": beside["wall_s"],
            "steal_per_busy_core": max(0.0, beside["wall_s"] / alone["wall_s"] - 1.0),
            "copy_bytes_per_s": flat.numel() * 4 / copy["wall_s"],
            "background_copy_bytes_per_s": copied[0] * flat.numel() * 4 / elapsed}


def allreduce_points(rank: int, world_size: int, reps: int) -> list[dict[str, Any]]:
    """All-reduce time vs bytes (`SIZES`) in this world."""
    import torch
    import torch.distributed as dist

    points = []
    for nbytes in SIZES:
        tensor = torch.ones(nbytes // 4)
        count = max(1, (1 << 22) // nbytes)
        dist.barrier()
        cost = timed(lambda: dist.all_reduce(tensor), reps, min(count, 50))
        points.append({"ranks": world_size, "bytes": nbytes, **cost})
    return points


_BUFFERS: dict[int, Any] = {}
_TABLE: list[Any] = []


def _ingest(gradient: Any) -> None:
    """Stand-in server: add a pushed gradient into a buffer of its size."""
    import torch

    _BUFFERS.setdefault(gradient.numel(), torch.zeros_like(gradient)).add_(gradient)


def _lookup(ids: Any) -> Any:
    """Stand-in server: the rows of `ids`."""
    import torch

    if not _TABLE:
        _TABLE.append(torch.randn(TABLE_ROWS, TABLE_DIM))
    return _TABLE[0].index_select(0, ids)


def _stand_in_rank(rank: int, port: int, reps: int, output: str) -> None:
    """Rank 1 serves; rank 0 pushes gradients and looks up rows with one call in flight."""
    import torch
    from torch.distributed import rpc

    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", _transports=["uv"])
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        pushes = []
        for nbytes in SIZES:
            gradient = torch.ones(nbytes // 4)
            cost = timed(lambda: rpc.rpc_sync("rank1", _ingest, args=(gradient,)), reps, min(max(1, (1 << 23) // nbytes), 50))
            pushes.append({"bytes": nbytes, **cost})
        lookups = []
        for rows in LOOKUP_ROWS:
            ids = torch.randint(0, TABLE_ROWS, (rows,))
            cost = timed(lambda: rpc.rpc_sync("rank1", _lookup, args=(ids,)), reps, 20)
            lookups.append({"rows": rows, "bytes": rows * TABLE_DIM * 4, **cost})
        Path(output).write_text(json.dumps({"pushes": pushes, "lookups": lookups}))
    rpc.shutdown()


def server_row_cost(reps: int) -> dict[str, float]:
    """A server's work for a lookup of 4,096 rows and their gradient (in-process): its CPU seconds are
    `server_s`, the cost on a core of the server's own (the wall time also counts waiting for one)."""
    import torch

    table = torch.randn(TABLE_ROWS, TABLE_DIM)
    ids = torch.randint(0, TABLE_ROWS, (4096,))
    gradient = torch.full((4096, TABLE_DIM), 1e-3)
    cost = timed(lambda: table.index_add_(0, ids, gradient, alpha=-0.1).index_select(0, ids), reps, 50)
    return {**cost, "bytes": ids.numel() * TABLE_DIM * 4, "server_s": cost["cpu_s"]}


def measure_stand_in(reps: int) -> dict[str, Any]:
    """The parameter-server stand-in: pushes and lookups over rpc, plus the server's cost per row."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as scratch:
        output = str(Path(scratch) / "ps.json")
        mp.start_processes(_stand_in_rank, (free_port(), reps, output), nprocs=2, start_method="spawn")
        measured = json.loads(Path(output).read_text())
    return {"source": "stand-in", **measured, "server_rows": server_row_cost(reps)}


def from_bench_ps(raw: dict[str, Any]) -> dict[str, Any] | None:
    """bench_ps.json's one-shard rows (first tree, float32 both ways; most trainers and pushes in
    flight, where the server is busiest) in the stand-in's shape: per-push time at each size, the
    lookup's per-call wait and the server's time per row byte; None if it has no one-shard dense row."""
    from bench_ps import EMBEDDING_DIM

    rows = [row for row in raw["summary"] if row["shards"] == 1]
    dense = [row for row in rows if row["kind"] == "dense" and row.get("push_dtype", "float32") == "float32"
             and row.get("params_dtype", "float32") == "float32"]
    if not dense:
        return None
    dense = [row for row in dense if row["tree"] == dense[0]["tree"]]
    busiest = max((row["trainers"], row["in_flight"]) for row in dense)
    measured: dict[str, Any] = {"source": "bench_ps.json", "trainers_in_flight": busiest, "pushes": [
        {"bytes": row["size"], "wall_s": 1.0 / row["pushes_per_s"], "reps": row["reps"]}
        for row in dense if (row["trainers"], row["in_flight"]) == busiest]}
    rates = {kind: max((row for row in rows if row["kind"] == kind and row["tree"] == dense[0]["tree"]),
                       key=lambda row: row["trainers"], default=None) for kind in ("lookup", "row_push")}
    if rates["lookup"] and rates["row_push"]:
        lookup, row_bytes = rates["lookup"], EMBEDDING_DIM * 4
        measured["lookups"] = [{"rows": lookup["size"], "bytes": lookup["size"] * row_bytes, "reps": lookup["reps"],
                                "wall_s": lookup["trainers"] * lookup["size"] / lookup["median"]}]
        measured["server_rows"] = {"bytes": row_bytes, "reps": lookup["reps"],
                                   "server_s": sum(1.0 / rates[kind]["median"] for kind in rates)}
    return measured


def least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Coefficients c minimising sum (row . c - target)^2, by the normal equations (a few unknowns);
    each clipped at zero, as every cost here is. A column the points never exercise (all zero, e.g.
    the scheduling wait when no run had more ranks than cores) gets 0."""
    used = [index for index in range(len(rows[0])) if any(row[index] for row in rows)]
    size = len(used)
    matrix = [[sum(row[i] * row[j] for row in rows) for j in used]
              + [sum(row[i] * target for row, target in zip(rows, targets))] for i in used]
    for column in range(size):  # Gauss-Jordan with partial pivoting
        pivot = max(range(column, size), key=lambda index: abs(matrix[index][column]))
        matrix[column], matrix[pivot] = matrix[pivot], matrix[column]
        for other in range(size):
            if other != column:
                factor = matrix[other][column] / matrix[column][column]
                matrix[other] = [a - factor * b for a, b in zip(matrix[other], matrix[column])]
    solution = dict(zip(used, (max(matrix[index][size] / matrix[index][index], 0.0) for index in range(size))))
    return [solution.get(index, 0.0) for index in range(len(rows[0]))]


def fit_linear_cost(points: Sequence[dict[str, Any]]) -> tm.LinearCost:
    """`fixed + per byte x bytes` through the points' wall times, each point's error relative to its
    time; a single point gives a line through the origin."""
    if len({point["bytes"] for point in points}) < 2:
        return tm.LinearCost(0.0, points[0]["wall_s"] / points[0]["bytes"])
    fixed, per_byte = least_squares([(1 / p["wall_s"], p["bytes"] / p["wall_s"]) for p in points], [1.0] * len(points))
    return tm.LinearCost(fixed, per_byte)


def fit_allreduce(points: Sequence[dict[str, Any]], cores: int) -> tm.AllReduce:
    """Bandwidth, per-hop latency and per-hop scheduling wait of `AllReduce`, least squares over every
    (bytes, ranks) point with each point's error relative to its time."""
    rows = []
    for point in points:
        crowding, hops = max(1.0, point["ranks"] / cores), 2 * (point["ranks"] - 1)
        rows.append((hops / point["ranks"] * point["bytes"] / point["wall_s"], hops / point["wall_s"],
                     hops * (crowding - 1.0) / point["wall_s"]))
    inverse_bandwidth, latency, switch = least_squares(rows, [1.0] * len(rows))
    return tm.AllReduce(1.0 / max(inverse_bandwidth, 1e-15), latency, switch)


def fitted(measured: dict[str, Any], cores: int) -> dict[str, Any]:
    """The model's inputs (Calibration's "model" section) from the measured points. A step's compute
    is its CPU seconds: what it costs a core of its own. Its wall time includes waiting for a core
    whenever anything else runs; on a quiet machine the two agree (one torch thread)."""
    compute = {point["preset"]: point for point in measured["compute"]}
    sharded: dict[str, dict[str, float]] = {}
    for point in measured.get("sharded_compute", []):
        sharded.setdefault(point["preset"], {})[str(point["ranks"])] = point["cpu_s"]
    steal = compute[SHADOW_STEAL_PRESET]["shadow_steal"]
    ps = measured["ps"]
    return {
        "presets": {name: {"compute_s": point["cpu_s"], "dense_params": point["dense_params"],
                           "batch_size": point["batch_size"], "lookup_bytes": point["lookup_bytes"],
                           "sharded_compute_s": sharded.get(name, {})}
                    for name, point in compute.items()},
        "allreduce": dataclasses.asdict(fit_allreduce(measured["allreduce"], cores)),
        "shard_push": dataclasses.asdict(fit_linear_cost(ps["pushes"])),
        "lookup": dataclasses.asdict(fit_linear_cost(ps["lookups"])),
        "server_row_byte_s": ps["server_rows"]["server_s"] / ps["server_rows"]["bytes"],
        "copy_bytes_per_s": steal["copy_bytes_per_s"],
        "shadow_steal": steal["steal_per_busy_core"],
        "cores": cores,
    }


def measure(args: argparse.Namespace) -> None:
    """Measure every input, fit the model's, write the JSON, print the fit's error per all-reduce point."""
    import torch.multiprocessing as mp

    started, cores = time.perf_counter(), os.cpu_count() or 1
    context = mp.get_context("spawn")
    with context.Pool(1) as pool:  # each preset in a fresh process: its tables' memory is given back
        compute = [pool.apply(measure_compute, (name, args.reps)) for name in args.presets.split(",")]
    for point in compute:
        print(f"compute {point['preset']}: {point['wall_s'] * 1e3:.1f} ms/step wall, {point['cpu_s'] * 1e3:.1f} ms CPU, "
              f"{point['dense_params']:,} dense params", flush=True)
    ranks = [int(n) for n in args.ranks.split(",")]
    sharded = measure_in_worlds(sharded_step_points, ranks,
                                [name for name in args.presets.split(",") if name in SHARDED_PRESETS], args.reps)
    for point in sharded:
        print(f"compute {point['preset']}, tables sharded over {point['ranks']} ranks: {point['wall_s'] * 1e3:.1f} ms/step "
              f"wall, {point['cpu_s'] * 1e3:.1f} ms CPU", flush=True)
    allreduce = measure_in_worlds(allreduce_points, ranks, args.reps)
    bench_ps = from_bench_ps(json.loads(BENCH_PS.read_text())) if BENCH_PS.exists() else None
    if bench_ps is None or "lookups" not in bench_ps:
        stand_in = measure_stand_in(args.reps)
        ps = stand_in if bench_ps is None else {**stand_in, **bench_ps, "source": "bench_ps.json, stand-in lookups"}
    else:
        ps = bench_ps
    measured = {"compute": compute, "sharded_compute": sharded, "allreduce": allreduce, "ps": ps}
    report = {"provisional": not args.quiet_machine, "cores": cores, "load_average": os.getloadavg(),
              "wall_s": time.perf_counter() - started, "measured": measured, "model": fitted(measured, cores)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    ring = tm.AllReduce(**report["model"]["allreduce"])
    print(f"all-reduce fit: {ring.bandwidth_bytes_per_s / 2**30:.3f} GiB/s, {ring.latency_s * 1e6:.1f} us per hop, "
          f"{ring.switch_s * 1e6:.1f} us per hop and rank beyond a core")
    for point in allreduce:
        predicted = ring.time_s(point["bytes"], point["ranks"], max(1.0, point["ranks"] / cores))
        print(f"  {point['ranks']} ranks {point['bytes']:>9,} B: measured {point['wall_s'] * 1e3:8.3f} ms "
              f"(CPU {point['cpu_s'] * 1e3:7.3f} ms), fit {predicted * 1e3:8.3f} ms, "
              f"error {predicted / point['wall_s'] - 1:+.0%}")
    print(f"PS ingest and lookups from: {ps['source']}; wrote {args.output} in {report['wall_s']:.0f} s")


PREDICTED_AS = {"none": "none", "ddp": "sync", "sync": "sync", "gba": "gba", "async": "gba"}
"""bench_scaling's variants and bench_gba's algos as the model's algorithms (shadow variants:
"shadow"). Plain async costs what GBA does: its trainers never wait and every step pushes each
shard its slice; only what the servers do with a push differs (apply it, or aggregate it)."""


def preset_of(run: dict[str, Any], calibration: tm.Calibration) -> tm.Preset:
    """The calibrated preset a benchmark run trained (known by its dense parameter count)."""
    presets = {preset.dense_params: preset for preset in calibration.presets.values()}
    if run["dense_params"] not in presets:
        raise SystemExit(f"no calibrated preset has {run['dense_params']:,} dense parameters; measure it first")
    return presets[run["dense_params"]]


def cores_got(run: dict[str, Any]) -> float | None:
    """Cores a run's ranks actually had: their CPU seconds in the timed window over its length (on a
    machine shared with other work, less than it has); None for a run without the harness's resources."""
    resources = run.get("resources")
    return resources["cpu_s_in_window"] / run["window_s"] if resources else None


def point(source: str, variant: str, run: dict[str, Any], rep: int, job: tm.Job, algorithm: str,
          measured: float, cpu_bound: bool = True) -> dict[str, Any]:
    """One validation point: the job as run on this machine's cores, and on the cores it got (only
    for `cpu_bound` jobs: ranks that sleep, through simulated compute or as a slowed trainer, leave
    cores idle that they could have had, and in sync mode every rank waits for the sleeper)."""
    got = cores_got(run) if cpu_bound else None
    at_got = dataclasses.replace(job, hosts=dataclasses.replace(job.hosts, cores=got)) if got else None
    return {"source": source, "variant": variant, "trainers": run["trainers"], "rep": rep, "job": job,
            "job_at_cores_got": at_got, "cores_got": got, "algorithm": algorithm, "measured": measured}


def scaling_points(raw: dict[str, Any], calibration: tm.Calibration) -> list[dict[str, Any]]:
    """bench_scaling's runs as validation points: every rank on this machine's cores."""
    return [
        point("bench_scaling", run["variant"], run, run["rep"],
              tm.Job(preset_of(run, calibration), run["trainers"], tm.Hosts(calibration.cores, run["trainers"]),
                     interval_s=run["config"]["sync"]["interval_ms"] / 1e3,
                     round_share=run["config"]["sync"].get("max_round_share", 1.0),
                     torchrec_tables=run["config"]["model"]["embeddings"] != "ps"),
              PREDICTED_AS.get(run["variant"], "shadow"), run["samples_per_s_total"])
        for run in raw["runs"]
    ]


def gba_points(raw: dict[str, Any], calibration: tm.Calibration) -> list[dict[str, Any]]:
    """bench_gba's runs as validation points: its trainers and servers on this machine's cores,
    simulated compute lasting `straggler.step_ms` (of which the preset's real compute keeps a core
    busy), or the preset's real compute."""
    points = []
    for run in raw["runs"]:
        result = run["result"]
        preset = preset_of(result, calibration)
        straggler, servers = result["config"]["straggler"], result["servers"]
        step_s = straggler["step_ms"] / 1e3 or preset.compute_s
        hosts = tm.Hosts(calibration.cores, result["trainers"] + servers, min(1.0, preset.compute_s / step_s))
        job = tm.Job(dataclasses.replace(preset, compute_s=step_s), result["trainers"], hosts,
                     tm.Stragglers(straggler["factor"], count=len(straggler["trainers"])), shards=servers, ps_tables=True)
        points.append(point("bench_gba", f"{run['algo']} {servers} shard(s)", result, run["rep"], job,
                            PREDICTED_AS[run["algo"]], run["metrics"]["samples_per_s"],
                            cpu_bound=not straggler["step_ms"] and (not straggler["trainers"] or straggler["factor"] == 1)))
    return points


def refit(args: argparse.Namespace) -> None:
    """Rewrite the calibration's model section from its measured points (after a change of the fits)."""
    report = json.loads(args.calibration.read_text())
    report["model"] = fitted(report["measured"], report["cores"])
    args.calibration.write_text(json.dumps(report, indent=2) + "\n")
    print(f"refitted {args.calibration}")


def validate(args: argparse.Namespace) -> None:
    """Predicted vs measured samples/s, relative error per point, median absolute error per source."""
    calibration = tm.Calibration.load(args.calibration)
    points = scaling_points(json.loads(args.scaling.read_text()), calibration) if args.scaling.exists() else []
    gba_files = sorted(glob.glob(args.gba))
    for path in gba_files:
        points += gba_points(json.loads(Path(path).read_text()), calibration)
    print(f"calibration {args.calibration} ({'provisional' if calibration.provisional else 'quiet machine'}); "
          f"{args.scaling if args.scaling.exists() else 'no bench_scaling JSON'}; "
          f"{', '.join(gba_files) or 'no bench_gba JSON'}")
    print("| source | variant | trainers | rep | measured samples/s | predicted | error | cores got | "
          "predicted at the cores got | error |\n|" + " --- |" * 2 + " ---: |" * 8)
    errors: dict[str, list[float]] = {}
    for entry in points:
        cells = [entry["source"], entry["variant"], str(entry["trainers"]), str(entry["rep"]), f"{entry['measured']:,.0f}"]
        for label, job in (("this machine's cores", entry["job"]), ("the cores each run got", entry["job_at_cores_got"])):
            if label != "this machine's cores":
                cells.append(f"{entry['cores_got']:.2f}" if job else "-")
            if job is None:
                cells += ["-", "-"]
                continue
            predicted = tm.predict(entry["algorithm"], job, calibration).samples_per_s
            errors.setdefault(f"{entry['source']} at {label}", []).append(abs(predicted / entry["measured"] - 1.0))
            cells += [f"{predicted:,.0f}", f"{predicted / entry['measured'] - 1.0:+.0%}"]
        print("| " + " | ".join(cells) + " |")
    for label, values in errors.items():
        print(f"{label}: median |error| {statistics.median(values):.0%}, max {max(values):.0%} over {len(values)} points")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    measuring = commands.add_parser("measure", help="measure the inputs, write the calibration JSON")
    measuring.add_argument("--reps", type=int, default=5, help="repetitions per point (the median is kept)")
    measuring.add_argument("--ranks", default="2,4,8", help="rank counts of the all-reduce and sharded-step measurements")
    measuring.add_argument("--presets", default=",".join(PRESETS), help=f"subset of {list(PRESETS)}")
    measuring.add_argument("--quiet-machine", action="store_true", help="nothing else ran: not provisional")
    measuring.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    refitting = commands.add_parser("fit", help="refit the model's inputs from the measured points")
    refitting.add_argument("--calibration", type=Path, default=DEFAULT_OUTPUT)
    validating = commands.add_parser("validate", help="predicted vs measured samples/s")
    validating.add_argument("--calibration", type=Path, default=DEFAULT_OUTPUT)
    validating.add_argument("--scaling", type=Path, default=ROOT / "runs" / "bench_scaling.json")
    validating.add_argument("--gba", default=str(ROOT / "runs" / "bench_gba_*.json"), help="glob of bench_gba JSONs")
    args = parser.parse_args(argv)
    if args.command == "measure":
        if "small" not in args.presets.split(","):
            parser.error("--presets must include small (the shadow steal is measured on it)")
        measure(args)
    else:
        {"fit": refit, "validate": validate}[args.command](args)


if __name__ == "__main__":
    main()
