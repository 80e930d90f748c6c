"""GBA against sync all-reduce and plain async PS training, with one trainer slowed, side by side.

    python benchmarks/bench_gba.py --compute simulated [--seeds 0,1,2,3,4] [--global-samples N] \
        [--presets small,production] [--shards 1,2] [--step-ms 50] [--slow-trainer 3] [--factor 3] \
        [--algos sync,gba,async] [--dotted.key value ...]
    python benchmarks/bench_gba.py --compute real ...

Every run is a `torchrun` job of `benchmarks/train_dlrm.py` with N trainers (`--trainers`, default 4)
and one parameter-server rank per dense shard (`--shards`: `sync.ps.num_servers`; the tables are
row-sharded over the same servers), the tables on the PS (no all-to-all, so nothing but the dense
sync can hold a fast trainer back; `--tables torchrec` shards them with TorchRec instead, `TABLES`),
at each model preset of `--presets` (`example_job.MODEL_PRESETS`),
and one trainer slowed `--factor` times by `ctrkit.straggler`:
- sync: `sync_allreduce.yaml` (dense all-reduce every step, GBASync's sync mode);
- gba: `gba_ps_embeddings.yaml` (global-batch aggregation, staleness decay);
- async: `async_ps.yaml` (every gradient applied on arrival, no decay);
- gba-bf16 and gba-bf16-both (not run unless named in `--algos`): gba with `sync.gba.push_dtype:
  bfloat16`, its pushes at half the bytes, and with `params_dtype: bfloat16` too, the parameters
  sent back at half the bytes.
All of them share the optimizer, learning rates and global batch (N x local batch); the dense
learning rate is the one tuned for sync at each preset (`TUNED_FOR_SYNC`), nothing is tuned per algorithm. The
algorithms run interleaved (for each seed, each preset and each shard count: sync gba async) over one
repetition per seed of `--seeds` in one invocation, because identical runs differ too much on these machines to compare
invocations (docs/benchmarks.md, "The development machines"). A repetition's seed is both
`train.seed` (model initialisation) and `data.synthetic.seed` (the planted teacher and the
streams): held-out AUC varies more from seed to seed than between the algorithms, so quality is
also reported as each run's AUC minus sync's AUC of the same seed (paired).

Compute: `simulated` makes every trainer's compute (batch, forward with the PS lookup, backward)
last `--step-ms` (default: `SIMULATED_STEP_MS` of the preset, above its real work), the slowed one's
`factor` times as long, by padding the model's real work with a sleep (`ctrkit.straggler`), so four trainers and a server fit on two cores
without fighting for CPU and the scheduling effect shows cleanly (the table's "step ms fast / slow"
shows what the steps really took: the padded compute plus the gradient hand-over and optimizer
step, and in sync mode the wait for the slowest); `real` slows the trainer by `factor` times its
measured compute, with every rank competing for the same cores.
With fewer cores than ranks a real step's cost depends on how many ranks compute at once (in sync
mode all of them; in GBA the slow one sleeps while the others compute), so the real-mode ratio is
not bounded by the ideal below.

Stopping rule: every run stops once the dense parameters hold `--global-samples` samples (read from
GBA's global step on each trainer, with no collective), so held-out AUC is compared at *equal
samples applied* to the dense model (sync: every sample; GBA: minus dropped gradients; async: every
pushed gradient). Throughput counts every trainer's computed samples over one wall-clock window
shared by all trainers of a run: from the moment the last trainer finished its warm-up to the moment
the first trainer stopped. "applied samples/s" counts only what reached the dense model (global
steps/s x samples per global step), so gradients GBA drops as too stale do not count there. The ideal GBA / sync ratio for N trainers, one s times slower, is
(N - 1 + 1/s) / (N / s): sync runs at the slow trainer's pace, GBA's fast trainers do not wait.
With several dense shards every shard holds the same global step k and takes every kept push; shard
0 decides each push, so staleness and decayed / dropped counts are shard 0's, pushes are per shard.
Ratios are taken per repetition (same seed, preset and shard count), then summarized: median and
min-max.

Warm start (`--warm-start-samples N`): from scratch, every run compares the algorithms on the
steepest part of the learning curve, where GBA's floor of about one global step of staleness costs
most. With a warm start, sync all-reduce first trains alone (no straggler) for N samples and
checkpoints; then, for each algorithm, a job resumes from that checkpoint (dense parameters and
optimizer, tables and their optimizer, data position) and trains `--global-samples` more under the
straggler: what a team sees when it switches a tuned synchronous job to GBA mid-training, the GBA
paper's scenario. Plain async is left out (its global step counts local batches, so its stopping
rule cannot count the synchronous samples before it). A resumed run is timed from its first step.

Every run also reports its resources: CPU ms per sample of all ranks, servers included, peak
memory per trainer and per server, a trainer's extra memory as a multiple of the dense size.

Prints a Markdown table and writes every run's numbers as JSON (default runs/bench_gba_<compute>.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from bench_summary import (
    PRESET_COLUMN, RESOURCE_COLUMNS, Column, Run, curve_at, markdown_table, merged_histogram, paired,
    ratio_spread, resource_spreads, select, spread, spread_cell, staleness_summary,
)
from example_job import (
    CONFIGS, MODEL_PRESETS, ROOT, SYNTHETIC_HELDOUT, parse_presets, parse_variants, preset_arguments, run_example,
    variant_arguments, variant_base,
)

ALGOS: dict[str, tuple[Path, tuple[str, ...]]] = {
    "sync": (CONFIGS / "sync_allreduce.yaml", ()),
    "gba": (CONFIGS / "gba_ps_embeddings.yaml", ()),
    "async": (CONFIGS / "async_ps.yaml", ()),
    "gba-bf16": (CONFIGS / "gba_ps_embeddings.yaml", ("--sync.gba.push_dtype", "bfloat16")),
    "gba-bf16-both": (CONFIGS / "gba_ps_embeddings.yaml",
                      ("--sync.gba.push_dtype", "bfloat16", "--sync.gba.params_dtype", "bfloat16")),
}
"""Benchmarked algorithms: a config and the overrides that make the variant."""
ALGO_ARGUMENTS = {name: ("--config", str(config), *overrides) for name, (config, overrides) in ALGOS.items()}
"""Each algorithm's harness arguments, for `variant_arguments` (`--algos gba@sync.gba.fresh_wait=0.5`)."""
DEFAULT_ALGOS = ("sync", "gba", "async")
"""What `--algos` runs unless told: GBA against its two baselines."""

TABLES = {"ps": ["--model.embeddings", "ps"], "torchrec": ["--model.embeddings", "torchrec"]}
"""`--tables`: where every algorithm's tables live. ps (the default): on the server ranks, with GBA's
rule for the rows too, so that nothing but the dense sync holds a fast trainer back. torchrec:
TorchRec-sharded over the trainers, whose all-to-all pairs every step (no GBA speed-up: a
diagnostic that keeps the rows synchronous and leaves GBA only the dense parameters)."""
ROW_OPTIMIZER = ["--train.embedding_optimizer", "rowwise_adagrad"]
"""The rows' optimizer of every run, the one the PS tables and TorchRec's fused tables share."""

TUNED_FOR_SYNC = {"small": 0.002, "production": 0.001}
"""Sync all-reduce's dense learning rate (Adam) for this job at each preset: the best one with which
sync trains without collapse on every seed, from sweeps of sync alone over 10 seeds (small: docs/gba.md,
"A stable baseline"; 0.008, taken from the 5K-parameter default model, collapsed the 338K-parameter
preset on 1 seed of 10; production: docs/benchmarks.md, "GBA at the production preset"). GBA and plain
async inherit it untuned, which is the GBA paper's protocol: a team switches its tuned synchronous
job to asynchronous training without retuning. Later `--train.dense_lr` arguments override it."""


def shared_job(preset: str, tables: str) -> list[str]:
    """What every run of every algorithm at `preset` with its tables in `tables` gets before its
    straggler and stopping arguments."""
    return [*TABLES[tables], *ROW_OPTIMIZER, "--train.dense_lr", str(TUNED_FOR_SYNC[preset])]


OVERRUN_WARNING = 0.05
"""Simulated mode warns when more than this share of a fast trainer's steps overran `--step-ms`."""

SIMULATED_STEP_MS = {"small": 50.0, "production": 1500.0}
"""Simulated compute per step of each preset, when `--step-ms` is not given: above what a fast
trainer's real work takes with 4 trainers and the servers on 2 cores (docs/benchmarks.md), so that
the sleep pads every step."""

GLOBAL_SAMPLES = {"small": 1_000_000, "production": 250_000}
"""Samples applied at which every run of a preset stops, when `--global-samples` is not given: a
production step costs about 20 times a small one, so its runs stop earlier to stay within minutes;
quality is compared within a preset only."""


def ideal_ratio(trainers: int, factor: float) -> float:
    """GBA / sync throughput when fast trainers never wait and sync runs at the slow one's pace."""
    return (trainers - 1 + 1 / factor) / (trainers / factor)


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """A synchronous run's checkpoint that every algorithm of one seed, preset and shard count resumes from."""

    directory: Path
    steps: int
    """Its step (sync: one global batch each)."""
    samples: int
    """Samples the dense parameters hold there."""
    result: dict[str, Any]
    """The synchronous run's results (its held-out AUC is where the algorithms start from)."""


def run_label(seed: int, preset: str, shards: int, what: str) -> str:
    """How a job is named in the progress lines and in a failure."""
    return f"seed {seed} {preset} {shards} shard(s) {what}"


def job_arguments(algo: str, seed: int, preset: str, shards: int, args: argparse.Namespace,
                  extra: Sequence[str]) -> list[str]:
    """What every job of `algo` at `preset` on `shards` servers gets, whatever its straggler and stop."""
    return variant_arguments(algo, ALGO_ARGUMENTS, [
        *shared_job(preset, args.tables), "--sync.ps.num_servers", str(shards), *preset_arguments(preset),
        "--train.warmup_steps", str(args.warmup_steps), "--train.seed", str(seed), "--data.synthetic.seed", str(seed),
        *SYNTHETIC_HELDOUT, *extra,
    ])


def run_once(
    algo: str, seed: int, preset: str, shards: int, args: argparse.Namespace, extra: Sequence[str], output: Path,
    warm_start: WarmStart | None = None,
) -> dict[str, Any]:
    """One torchrun job of `algo` at `preset`: N trainers and `shards` servers, the slowed trainer, the
    common stop; with `warm_start`, resumed from its checkpoint and stopped that many samples later."""
    straggler = ["--straggler.trainers", f"[{args.slow_trainer}]", "--straggler.factor", str(args.factor)]
    if args.compute == "simulated":
        straggler += ["--straggler.step_ms", str(args.step_ms or SIMULATED_STEP_MS[preset])]
    samples = args.global_samples or GLOBAL_SAMPLES[preset]
    resume = []
    if warm_start is not None:
        samples += warm_start.samples
        resume = ["--checkpoint-dir", str(warm_start.directory), "--resume"]
    label = run_label(seed, preset, shards, algo)
    result = run_example(label, args.trainers + shards, [
        *job_arguments(algo, seed, preset, shards, args, extra), *straggler, "--train.global_samples", str(samples),
        *resume], output)
    if warm_start is not None and result["checkpoint"]["resumed_from_step"] != warm_start.steps:
        raise SystemExit(f"{label}: resumed from step {result['checkpoint']['resumed_from_step']}, not from the "
                         f"warm start's checkpoint at step {warm_start.steps} in {warm_start.directory}")
    return result


def warm_start(seed: int, preset: str, shards: int, args: argparse.Namespace, extra: Sequence[str],
               scratch: Path) -> WarmStart:
    """Train sync all-reduce alone, without the straggler (it only slows sync down), for
    `--warm-start-samples` samples (rounded up to whole global batches), and checkpoint it."""
    from dlrm.config import ExperimentConfig, preset_overrides
    from shadowgba.config import load_config

    config = load_config(ExperimentConfig, ALGOS["sync"][0], [
        *preset_overrides(preset), *shared_job(preset, args.tables), "--sync.ps.num_servers", str(shards), *extra])
    global_batch = args.trainers * config.data.batch_size
    steps = -(-args.warm_start_samples // global_batch)
    directory = scratch / f"warm_start_seed{seed}_{preset}_{shards}"
    result = run_example(run_label(seed, preset, shards, "warm start"), args.trainers + shards, [
        *job_arguments("sync", seed, preset, shards, args, extra), "--train.steps", str(steps),
        "--checkpoint-dir", str(directory), "--checkpoint-every", str(steps), "--checkpoint-keep", "1"],
        scratch / "warm_start.json")
    return WarmStart(directory, steps, steps * global_batch, result)


def run_metrics(run: dict[str, Any], slow_trainer: int) -> dict[str, float]:
    """What the table shows of one run. Dense shards: shard 0 decides every push for all of them, so
    its staleness and decayed / dropped counts are the job's, and every shard takes every kept push
    (pushes are per shard, the queue depth the deepest shard's). Tables: each server decides the
    pushes of its own rows, so their histograms and drops add up."""
    shards = run["gba"]["dense_shards"]
    deciding = shards[0]
    tables = run["gba"]["embedding_shards"]
    steps = run["steps_in_window_by_trainer"]
    fast_trainers = [index for index in range(len(steps)) if index != slow_trainer]
    fast = [steps[index] for index in fast_trainers]
    overruns = run["straggler_overrun_fraction_by_trainer"]
    config = run["config"]
    batch = config["data"][config["data"]["source"]]["batch_size"]
    per_global_step = batch if config["sync"]["gba"]["aggregation"] == "none" else batch * run["trainers"]
    waits = max(run["sync"].get("fresh_waits", 0), 1)  # trainer 0's (`sync.gba.fresh_wait`)
    return {
        "samples_per_s": run["samples_per_s_total"],
        "applied_samples_per_s": run["gba"]["global_steps_per_s"] * per_global_step,
        "step_ms_fast": 1e3 * run["window_s"] / max(statistics.mean(fast), 1),
        "step_ms_slow": 1e3 * run["window_s"] / max(steps[slow_trainer], 1),
        "auc": run["auc"],
        "log_loss": run["log_loss"],
        "dead_units": run.get("dead_unit_share", 0.0),
        **staleness_summary(deciding["staleness_histogram"]),
        "decayed": deciding["decayed"],
        "dropped": deciding["dropped"],
        "pushes_per_shard": statistics.mean(shard["pushes"] for shard in shards),
        "row_staleness_mean": staleness_summary(
            merged_histogram(table["staleness_histogram"] for table in tables))["staleness_mean"],
        "rows_dropped": sum(table["dropped"] for table in tables),
        "queue_dropped": run["sync"]["queue_dropped"],
        "fresh_wait_ms": 1e3 * run["sync"].get("fresh_wait_s", 0.0) / waits,
        "fresh_timeouts": run["sync"].get("fresh_timeouts", 0) / waits,
        "fresh_skipped": run["sync"].get("fresh_skipped", 0) / waits,
        "global_steps_per_s": run["gba"]["global_steps_per_s"],
        "queue_depth": max(shard["queue_depth_max"] for shard in shards),
        "switches": run["gba"]["mode_switches"],
        "overrun_fast": statistics.mean(overruns[index] for index in fast_trainers),
    }


SUMMARY: dict[str, tuple[Callable[[list[float]], float], ...]] = {
    "samples_per_s": (statistics.median, min, max),
    "applied_samples_per_s": (statistics.median,),
    "auc": (statistics.median, min, max),
    "log_loss": (statistics.median,),
    "dead_units": (max,),
    "step_ms_fast": (statistics.median,),
    "step_ms_slow": (statistics.median,),
    "staleness_mean": (statistics.median,),
    "staleness_p90": (max,),
    "staleness_top": (max,),
    "decayed": (statistics.median,),
    "dropped": (statistics.median,),
    "pushes_per_shard": (statistics.median,),
    "row_staleness_mean": (statistics.median,),
    "rows_dropped": (statistics.median,),
    "queue_dropped": (statistics.median,),
    "fresh_wait_ms": (statistics.median,),
    "fresh_timeouts": (statistics.median,),
    "fresh_skipped": (statistics.median,),
    "global_steps_per_s": (statistics.median,),
    "queue_depth": (max,),
    "switches": (max,),
    "overrun_fast": (max,),
}
"""How each run metric is summarized over repetitions; the row key is `<metric>_<function>`."""


def repetition(run: Run) -> int:
    """The repetition (seed) a run belongs to: the runs of one seed, preset and shard count ran side by side."""
    return run["rep"]


def summarize(
    runs: list[Run], presets: Sequence[str], shard_counts: Sequence[int], algos: Sequence[str]
) -> list[dict[str, Any]]:
    """Per preset, shard count and algorithm: each metric summarized over repetitions, the ratios to
    sync taken per repetition (median, min-max), AUC minus sync's per seed, and the resources."""
    rows = []
    for preset in presets:
        for shards in shard_counts:
            group = select(runs, preset=preset, shards=shards)
            sync = select(group, algo="sync")
            for algo in algos:
                mine = select(group, algo=algo)
                row: dict[str, Any] = {"preset": preset, "shards": shards, "algo": algo, "reps": len(mine),
                                       "dense_params": mine[0]["result"]["dense_params"]}
                for key, functions in SUMMARY.items():
                    values = [run["metrics"][key] for run in mine]
                    row.update({f"{key}_{function.__name__}": function(values) for function in functions})
                for key in ("samples_per_s", "applied_samples_per_s"):
                    row[key] = spread([run["metrics"][key] for run in mine])
                    row[f"{key}_ratio_to_sync"] = ratio_spread(
                        mine, sync, repetition, lambda run, key=key: run["metrics"][key])
                row["auc_minus_sync"] = [run["metrics"]["auc"] - base["metrics"]["auc"]
                                         for run, base in paired(mine, sync, repetition)]
                row.update(resource_spreads([run["result"] for run in mine]))
                rows.append(row)
    return rows


COLUMNS: list[Column] = [
    PRESET_COLUMN,
    ("shards", lambda row: str(row["shards"])),
    ("algo", lambda row: row["algo"]),
    ("samples/s (min-max)", lambda row: spread_cell(row["samples_per_s"], ",.0f")),
    ("ratio to sync", lambda row: spread_cell(row["samples_per_s_ratio_to_sync"], ".2f")),
    ("applied samples/s", lambda row: spread_cell(row["applied_samples_per_s"], ",.0f")),
    ("applied ratio to sync", lambda row: spread_cell(row["applied_samples_per_s_ratio_to_sync"], ".2f")),
    ("step ms fast / slow", lambda row: f"{row['step_ms_fast_median']:.0f} / {row['step_ms_slow_median']:.0f}"),
    ("AUC median (min-max)", lambda row: f"{row['auc_median']:.4f} ({row['auc_min']:.4f}-{row['auc_max']:.4f})"),
    ("AUC - sync, per seed", lambda row: " ".join(f"{gap:+.4f}" for gap in row["auc_minus_sync"]) or "-"),
    ("dead units max", lambda row: f"{row['dead_units_max']:.0%}"),
    ("staleness mean / p90 / max",
     lambda row: f"{row['staleness_mean_median']:.2f} / {row['staleness_p90_max']} / {row['staleness_top_max']}"),
    ("row staleness mean / rows dropped",
     lambda row: f"{row['row_staleness_mean_median']:.2f} / {row['rows_dropped_median']:.0f}"),
    ("decayed / dropped / queue-dropped",
     lambda row: f"{row['decayed_median']:.0f} / {row['dropped_median']:.0f} / {row['queue_dropped_median']:.0f}"),
    ("fresh wait ms / timed out / skipped (trainer 0)",
     lambda row: f"{row['fresh_wait_ms_median']:.1f} / {row['fresh_timeouts_median']:.0%} / "
                 f"{row['fresh_skipped_median']:.0%}"),
    ("pushes per shard", lambda row: f"{row['pushes_per_shard_median']:,.0f}"),
    ("global steps/s", lambda row: f"{row['global_steps_per_s_median']:.1f}"),
    ("PS queue depth max", lambda row: str(row["queue_depth_max"])),
    ("switches", lambda row: str(row["switches_max"])),
    *RESOURCE_COLUMNS,
]
"""The table's columns: header and how a summary row fills the cell."""


def curve_rows(runs: list[Run], every: int) -> tuple[list[Column], list[dict[str, Any]]]:
    """The learning curves side by side: per run (algorithm, seed), the held-out AUC at each multiple
    of `every` samples applied (the harness's `train.eval_every_samples` points; the last is the
    final evaluation), and its difference to sync's of the same seed, preset and shard count."""
    marks = sorted({mark for run in runs for mark in curve_at(run, every)})
    rows = []
    for run in runs:
        sync = select(runs, algo="sync", seed=run["seed"], preset=run["preset"], shards=run["shards"])
        base = curve_at(sync[0], every) if sync else {}
        mine = curve_at(run, every)
        rows.append({"run": f"{run['preset']} {run['shards']} shard(s) seed {run['seed']} {run['algo']}",
                     **{mark: (mine.get(mark), base.get(mark)) for mark in marks}})

    def cell(pair: tuple[float | None, float | None]) -> str:
        auc, base = pair
        if auc is None:
            return "-"
        return f"{auc:.4f}" + (f" ({auc - base:+.4f})" if base is not None else "")

    columns: list[Column] = [("run", lambda row: row["run"])] + [
        (f"AUC at {mark:,} (- sync)", lambda row, mark=mark: cell(row.get(mark, (None, None))))
        for mark in marks]
    return columns, rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compute", choices=("simulated", "real"), required=True,
                        help="simulated: fixed per-step sleep; real: the slowed trainer sleeps (factor-1) x its step")
    parser.add_argument("--seeds", default="0,1,2,3,4",
                        help="comma-separated seeds, one repetition of the interleaved sequence each")
    parser.add_argument("--presets", default=",".join(MODEL_PRESETS), help=f"comma-separated subset of {MODEL_PRESETS}")
    parser.add_argument("--shards", default="1,2", help="comma-separated dense shard counts (one server rank each)")
    parser.add_argument("--trainers", type=int, default=4, help="trainer ranks (the server ranks are added)")
    parser.add_argument("--slow-trainer", type=int, default=3, help="index of the slowed trainer")
    parser.add_argument("--factor", type=float, default=3.0, help="slowdown of the slowed trainer")
    parser.add_argument("--step-ms", type=float,
                        help=f"simulated compute per step (default per preset: {SIMULATED_STEP_MS})")
    parser.add_argument("--global-samples", type=int,
                        help=f"every run stops at this many samples applied (default per preset: {GLOBAL_SAMPLES})")
    parser.add_argument("--warmup-steps", type=int, default=20, help="steps before the timed window")
    parser.add_argument("--algos", default=",".join(DEFAULT_ALGOS),
                        help=f"comma-separated subset of {list(ALGOS)}, each optionally followed by "
                             "@dotted.key=value overrides (gba@sync.gba.fresh_wait=0.5)")
    parser.add_argument("--tables", choices=sorted(TABLES), default="ps",
                        help="where every run's tables live: ps (default), or torchrec (rows synchronous, "
                             "GBA on the dense parameters only; every step paired, so no speed-up)")
    parser.add_argument("--curve-every", type=int, default=0,
                        help="also evaluate held-out AUC every this many samples applied and print the curves "
                             "side by side (train.eval_every_samples); 0: the final evaluation only")
    parser.add_argument("--output", type=Path, help="JSON results (default runs/bench_gba_<compute>.json)")
    parser.add_argument("--warm-start-samples", type=int, default=0,
                        help="train sync alone this many samples first, then continue every algorithm from its "
                             "checkpoint for --global-samples more (0: every run starts from scratch)")
    args, extra = parser.parse_known_args(argv)
    algos = parse_variants(args.algos, ALGOS, "--algos")
    if "sync" not in algos:
        parser.error("--algos must include sync: every ratio and AUC difference is taken against it")
    if args.warm_start_samples and any(variant_base(algo) == "async" for algo in algos):
        parser.error("--warm-start-samples: plain async counts a local batch per global step, sync's checkpoint a "
                     "global batch, so its stopping rule would not count the warm start's samples; leave it out")
    presets = parse_presets(args.presets)
    if args.curve_every:
        extra = [*extra, "--train.eval_every_samples", str(args.curve_every)]
    shard_counts = [int(count) for count in args.shards.split(",")]
    output = args.output or ROOT / "runs" / f"bench_gba_{args.compute}.json"
    runs, warm_starts = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for rep, seed in enumerate(int(seed) for seed in args.seeds.split(",")):
            for preset in presets:
                for shards in shard_counts:
                    start = warm_start(seed, preset, shards, args, extra, Path(scratch)) if args.warm_start_samples else None
                    if start is not None:
                        warm_starts.append({"seed": seed, "preset": preset, "shards": shards, "steps": start.steps,
                                            "samples": start.samples, "auc": start.result["auc"], "result": start.result})
                        print(f"{run_label(seed, preset, shards, 'warm start')}: {start.samples:,} samples, "
                              f"AUC {start.result['auc']:.4f}", flush=True)
                    for algo in algos:
                        result = run_once(algo, seed, preset, shards, args, extra, Path(scratch) / "result.json", start)
                        metrics = run_metrics(result, args.slow_trainer)
                        runs.append({"algo": algo, "rep": rep, "seed": seed, "preset": preset, "shards": shards,
                                     "metrics": metrics, "result": result})
                        print(f"{run_label(seed, preset, shards, algo)}: {metrics['samples_per_s']:,.0f} "
                              f"samples/s over {result['window_s']:.1f} s, AUC {metrics['auc']:.4f}", flush=True)
                    if start is not None:
                        shutil.rmtree(start.directory)  # a production checkpoint holds 1.3 GB of tables
    ideal = ideal_ratio(args.trainers, args.factor)
    rows = summarize(runs, presets, shard_counts, algos)
    print(markdown_table(COLUMNS, rows))
    print(f"ideal ratio to sync: {ideal:.2f} ({args.trainers} trainers, one {args.factor:g}x slower)")
    if args.curve_every:
        print(markdown_table(*curve_rows(runs, args.curve_every)))
    for preset in presets:
        for shards in shard_counts:
            starts = [start for start in warm_starts if start["preset"] == preset and start["shards"] == shards]
            if starts:
                aucs = " ".join(f"{start['auc']:.4f}" for start in starts)
                print(f"warm start, {preset}, {shards} shard(s): sync alone for {starts[0]['samples']:,} samples, "
                      f"AUC there per seed {aucs}")
    overrun = max(row["overrun_fast_max"] for row in rows)
    if args.compute == "simulated" and overrun > OVERRUN_WARNING:
        print(f"WARNING: the fast trainers' real work overran the simulated step in up to {overrun:.0%} of their "
              f"steps, so they ran slower than simulated and the ratios to sync understate the scheduling "
              f"effect; rerun with a larger --step-ms")
    output.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: str(value) for key, value in vars(args).items()} | {
        "overrides": {preset: [*shared_job(preset, args.tables), *extra] for preset in presets}}
    report = {"settings": settings, "ideal_ratio": ideal, "summary": rows, "runs": runs, "warm_starts": warm_starts}
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
