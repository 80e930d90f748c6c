"""Across hosts: the flat variants on 2 simulated hosts whose links have a finite rate.

    python benchmarks/bench_hosts.py [--rates 1gbit,10gbit] [--stragglers even,compute,link] [--reps 5] \
        [--duration-s 30] [--preset production] [--variants none,ddp,pma,ma-shadow,bmuf-shadow,...] \
        [--quality-steps 0] [--quality-seeds 0] [--dotted.key value ...]

Every run is one `benchmarks/train_dlrm.py` job across a fresh `ctrkit.cluster.Cluster` of 2 hosts,
one rank each, started as multi-node torchrun (one agent per host, static rendezvous at host 0).
Both links run at the cell's rate (`--rates`, tc tbf in both directions), so every byte between the
ranks crosses a shaped link: TorchRec's embedding all-to-all in every step (the tables are sharded
table-wise over the two hosts), DDP's gradient all-reduce, PMA's and the shadow rounds' averages.
Variants (`VARIANTS`): `none` (no dense sync), `ddp`, `pma` (torch's PeriodicModelAverager every
`--every` steps), ma / bmuf in the shadow thread (their configs' pacing unless overridden), and ma
with compressed rounds (`ma-shadow-bf16`, `ma-shadow-int8`: `sync.compress`); any of them followed by
`@dotted.key=value` overrides (`example_job.parse_variants`: `ma-shadow@sync.rounds_nice=19`).
Straggler settings (`--stragglers`): `even`; `compute`, trainer 1 `--factor` times slower
(`ctrkit.straggler`, real compute); `link`, host 1's link at 1% of the cell's rate (a network
straggler).

One invocation runs every cell interleaved over `--reps` repetitions (for each repetition, each rate
and straggler setting, every variant in a row), each trainer timing `--duration-s` after its warm-up.
Per variant: samples/s of the job over the window every trainer was timing in, and trainer 0's alone
(the fast host under a straggler); ratios to `none`, `ddp` and `pma` taken per repetition, then
median (min-max); CPU ms per sample of both ranks (getrusage: steal does not inflate it, unlike
samples/s on these VMs); bytes on the wire per sample (both hosts' sent bytes over the whole job,
start-up and evaluation included, over the samples computed); held-out AUC at the end of the
duration-bounded run. `--quality-steps N` adds runs of exactly N steps per trainer at the first rate
without a straggler, one per seed of `--quality-seeds`, for AUC at equal samples seen.

Prints Markdown tables and writes every run as JSON (runs/bench_hosts.json). Needs root (the
simulated hosts); stop anything else running on the cores first.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from bench_2d import parse_list
from bench_summary import Column, Run, difference_spread, markdown_table, ratio_spread, select, spread, spread_cell
from ctrkit.cluster import rate_bits, unavailable_reason
from example_job import (
    CONFIGS, ROOT, SYNTHETIC_HELDOUT, WARMUP_STEPS, parse_variants, preset_arguments, run_across_hosts,
    variant_arguments,
)

VARIANTS: dict[str, list[str]] = {
    "none": ["--config", str(CONFIGS / "none.yaml")],
    "ddp": ["--config", str(CONFIGS / "ddp.yaml")],
    "pma": ["--config", str(CONFIGS / "pma.yaml")],
    "ma-shadow": ["--config", str(CONFIGS / "ma.yaml"), "--sync.mode", "shadow"],
    "bmuf-shadow": ["--config", str(CONFIGS / "bmuf.yaml"), "--sync.mode", "shadow"],
    **{f"ma-shadow-{kind}": ["--config", str(CONFIGS / "ma.yaml"), "--sync.mode", "shadow", "--sync.compress", kind]
       for kind in ("bf16", "int8")},
}
"""The harness arguments of each variant."""
BASELINES = ("none", "ddp", "pma")
"""Every variant's throughput is compared with these, per repetition."""
STRAGGLERS = ("even", "compute", "link")
"""`--stragglers` names (module docstring)."""
LINK_STRAGGLER_SHARE = 100
"""Under the `link` straggler, host 1's link runs at the cell's rate divided by this."""


def run_on_hosts(label: str, rate: str, straggler: str, arguments: Sequence[str], output: Path) -> dict[str, Any]:
    """One harness job across 2 hosts at `rate`, one rank each (host 1's link at 1% of it under the
    `link` straggler); its results with the bytes both hosts sent."""
    slow = {1: rate_bits(rate) // LINK_STRAGGLER_SHARE} if straggler == "link" else {}
    return run_across_hosts(label, arguments, output, nproc_per_host=1, rate=rate, slow_links=slow)


def metrics(result: dict[str, Any]) -> dict[str, Any]:
    """What the tables show of one run."""
    config = result["config"]
    batch = config["data"][config["data"]["source"]]["batch_size"]
    cpu = result["resources"]["cpu_s_per_sample"]
    return {
        "samples_per_s": result["samples_per_s_total"],
        "trainer0_samples_per_s": result["steps_in_window_by_trainer"][0] * batch / result["window_s"],
        "window_s": result["window_s"],
        "cpu_ms_per_sample": None if cpu is None else 1e3 * cpu,
        "wire_kb_per_sample": result["wire_bytes_sent"] / 1e3 / result["samples_computed_total"],
        "auc": result["auc"],
        "rounds_per_s": result["sync"].get("rounds_per_s"),
        "sync_gap_steps_mean": result["sync"].get("sync_gap_steps_mean"),
    }


FIGURES = ("samples_per_s", "trainer0_samples_per_s", "window_s", "cpu_ms_per_sample", "wire_kb_per_sample",
           "auc", "rounds_per_s", "sync_gap_steps_mean")
"""The `metrics` summarized as median (min-max) over repetitions."""


def figure(name: str) -> Callable[[Run], float]:
    return lambda run: run["metrics"][name]


def throughput_rows(runs: list[Run], rates: Sequence[str], stragglers: Sequence[str],
                    variants: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for rate in rates:
        for straggler in stragglers:
            cell = select(runs, rate=rate, straggler=straggler)
            for variant in variants:
                mine = select(cell, variant=variant)
                row: dict[str, Any] = {"rate": rate, "straggler": straggler, "variant": variant,
                                       **{name: spread([run["metrics"][name] for run in mine]) for name in FIGURES}}
                for baseline in BASELINES:
                    theirs = select(cell, variant=baseline)
                    row[f"over_{baseline}"] = ratio_spread(mine, theirs, lambda run: run["rep"], figure("samples_per_s"))
                    row[f"trainer0_over_{baseline}"] = ratio_spread(mine, theirs, lambda run: run["rep"],
                                                                    figure("trainer0_samples_per_s"))
                rows.append(row)
    return rows


THROUGHPUT_COLUMNS: list[Column] = [
    ("rate, straggler", lambda row: f"{row['rate']}, {row['straggler']}"),
    ("variant", lambda row: row["variant"]),
    ("samples/s", lambda row: spread_cell(row["samples_per_s"], ",.0f")),
    ("/ none", lambda row: spread_cell(row["over_none"], ".2f")),
    ("/ ddp", lambda row: spread_cell(row["over_ddp"], ".2f")),
    ("/ pma", lambda row: spread_cell(row["over_pma"], ".2f")),
    ("trainer 0 / none", lambda row: spread_cell(row["trainer0_over_none"], ".2f")),
    ("CPU ms/sample", lambda row: spread_cell(row["cpu_ms_per_sample"], ".3f")),
    ("wire KB/sample", lambda row: spread_cell(row["wire_kb_per_sample"], ".1f")),
    ("rounds/s", lambda row: spread_cell(row["rounds_per_s"], ".1f")),
    ("AUC (end of run)", lambda row: spread_cell(row["auc"], ".4f")),
    ("window s", lambda row: spread_cell(row["window_s"], ".1f")),
]


def quality_rows(runs: list[Run], variants: Sequence[str]) -> list[dict[str, Any]]:
    return [{"variant": variant, "auc": spread([run["result"]["auc"] for run in select(runs, variant=variant)]),
             "auc_minus_ddp": difference_spread(select(runs, variant=variant), select(runs, variant="ddp"),
                                                lambda run: run["seed"], lambda run: run["result"]["auc"]),
             "samples": spread([run["result"]["samples_computed_total"] for run in select(runs, variant=variant)])}
            for variant in variants]


QUALITY_COLUMNS: list[Column] = [
    ("variant", lambda row: row["variant"]),
    ("samples seen", lambda row: spread_cell(row["samples"], ",.0f")),
    ("held-out AUC", lambda row: spread_cell(row["auc"], ".4f")),
    ("AUC - ddp's", lambda row: spread_cell(row["auc_minus_ddp"], "+.4f")),
]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1gbit,10gbit", help="comma-separated link rates (tc notation)")
    parser.add_argument("--stragglers", default="even,compute", help=f"comma-separated subset of {list(STRAGGLERS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    parser.add_argument("--preset", default="production", help="model preset (examples/configs/presets/)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the interleaved sequence")
    parser.add_argument("--duration-s", type=float, default=30.0, help="each trainer's timed time after its warm-up")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="steps before a trainer's timed time")
    parser.add_argument("--factor", type=float, default=3.0, help="the compute straggler's slowdown")
    parser.add_argument("--quality-steps", type=int, default=0,
                        help="steps per trainer of the equal-samples quality runs (0: none)")
    parser.add_argument("--quality-seeds", default="0", help="comma-separated seeds of the quality runs")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "bench_hosts.json", help="JSON results")
    args, extra = parser.parse_known_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(reason)
    rates = [rate for rate in args.rates.split(",") if rate]
    for rate in rates:
        rate_bits(rate)  # refuses a malformed rate before any run
    stragglers = parse_list(args.stragglers, STRAGGLERS, "--stragglers")
    variants = parse_variants(args.variants, VARIANTS, "--variants")
    throughput, quality = [], []
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "result.json"
        for rep in range(args.reps):
            for rate in rates:
                for straggler in stragglers:
                    slowed = ["--straggler.trainers", "[1]", "--straggler.factor", str(args.factor)]
                    for variant in variants:
                        label = f"rep {rep} {rate} {straggler} {variant}"
                        result = run_on_hosts(label, rate, straggler, variant_arguments(variant, VARIANTS, [
                            *preset_arguments(args.preset), "--train.duration_s",
                            str(args.duration_s), "--train.warmup_steps", str(args.warmup_steps),
                            *(slowed if straggler == "compute" else []), *extra]), output)
                        run = {"rate": rate, "straggler": straggler, "variant": variant, "rep": rep,
                               "metrics": metrics(result), "result": result}
                        throughput.append(run)
                        print(f"{label}: {run['metrics']['samples_per_s']:,.0f} samples/s over "
                              f"{run['metrics']['window_s']:.1f} s, {run['metrics']['cpu_ms_per_sample']:.3f} CPU "
                              f"ms/sample, {run['metrics']['wire_kb_per_sample']:.1f} KB/sample on the wire",
                              flush=True)
        for seed in (int(seed) for seed in args.quality_seeds.split(",") if args.quality_steps):
            for variant in variants:
                label = f"quality seed {seed} {rates[0]} {variant}"
                result = run_on_hosts(label, rates[0], "even", variant_arguments(variant, VARIANTS, [
                    *preset_arguments(args.preset), "--train.steps", str(args.quality_steps),
                    "--train.seed", str(seed), "--data.synthetic.seed", str(seed), *SYNTHETIC_HELDOUT, *extra]), output)
                quality.append({"variant": variant, "seed": seed, "result": result})
                print(f"{label}: AUC {result['auc']:.4f} after {result['samples_computed_total']:,.0f} samples", flush=True)
    report: dict[str, Any] = {"settings": {key: str(value) for key, value in vars(args).items()} | {
        "overrides": list(extra)}}
    if throughput:
        report["throughput"] = throughput_rows(throughput, rates, stragglers, variants)
        print(markdown_table(THROUGHPUT_COLUMNS, report["throughput"]))
    if quality:
        report["quality"] = quality_rows(quality, variants)
        print(markdown_table(QUALITY_COLUMNS, report["quality"]))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report |= {"throughput_runs": throughput, "quality_runs": quality}
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
