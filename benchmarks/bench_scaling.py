"""Scaling: samples/s vs number of trainers (1, 2, 4, 8) for none, ddp and the shadow algorithms.

    python benchmarks/bench_scaling.py [--trainers 1,2,4,8] [--variants none,ddp,ma-shadow,...] \
        [--reps 2] [--duration-s 10]

Every run is a `torchrun` job of `benchmarks/train_dlrm.py` on N ranks with the small model preset
(`--preset small`: 8 tables of 100K x 64, a 338K-parameter dense net), timed for a fixed
window after warm-up. Runs are interleaved (every variant at every size, then the next repetition),
and each variant's ratio to `none` is the median of its ratios to the `none` run of the same size
and repetition. Writes JSON, a Markdown table and a PNG plot (runs/plots/scaling.png).

What a small machine can show: with more ranks than cores the ranks time-share the CPU, so total
samples/s cannot grow with trainers there (it falls, from scheduling and the all-to-all of more
ranks); what stays meaningful is each algorithm's sync overhead relative to none at each size. Real
scaling needs a core (or accelerator) per trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Sequence

from bench_matrix import VARIANTS
from bench_summary import Column, Run, markdown_table, median_or_none, optional, plotting, ratios_to, select
from example_job import ROOT, WARMUP_STEPS, preset_arguments, run_example

DEFAULT_VARIANTS = ("none", "ddp", "ma-shadow", "easgd-shadow", "bmuf-shadow")
STARTUP_S = 10.0
"""Measured cost of a run besides its timed window, plus PER_RANK_S for each rank (2 quiet cores)."""
PER_RANK_S = 3.0


def note() -> str:
    """What this machine's curve can and cannot show."""
    cores = os.cpu_count() or 1
    return (f"This machine has {cores} CPU cores. With more ranks than cores the ranks time-share the CPU, so "
            "total samples/s cannot grow with trainers here; what the curve shows is each algorithm's sync "
            "overhead relative to none at each size (the ratio column), not how far it would scale with a core "
            "or accelerator per trainer.")


def run_once(variant: str, trainers: int, args: argparse.Namespace, output: Path) -> dict[str, Any]:
    """One timed run of `variant` on `trainers` ranks."""
    arguments = [
        *VARIANTS[variant].arguments(), *preset_arguments("small"),
        "--train.duration_s", str(args.duration_s), "--train.warmup_steps", str(args.warmup_steps),
    ]
    return run_example(f"{variant} on {trainers} trainers", trainers, arguments, output)


def summarize(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per size and variant: median samples/s (total and per trainer), median per-repetition ratio to none."""
    rows = []
    for trainers in sorted({run["trainers"] for run in runs}):
        mine = select(runs, trainers=trainers)
        none = select(mine, variant="none")
        for variant in dict.fromkeys(run["variant"] for run in mine):
            cells = select(mine, variant=variant)
            speeds = [run["samples_per_s_total"] for run in cells]
            ratios = ratios_to(cells, none, key=lambda run: run["rep"], value=lambda run: run["samples_per_s_total"])
            rows.append({
                "trainers": trainers, "variant": variant, "reps": len(cells),
                "samples_per_s_median": statistics.median(speeds),
                "samples_per_s_per_trainer": statistics.median(speeds) / trainers,
                "ratio_to_none_median": median_or_none(ratios),
            })
    return rows


COLUMNS: list[Column] = [
    ("trainers", lambda row: str(row["trainers"])),
    ("algorithm", lambda row: row["variant"]),
    ("samples/s (median)", lambda row: f"{row['samples_per_s_median']:,.0f}"),
    ("per trainer", lambda row: f"{row['samples_per_s_per_trainer']:,.0f}"),
    ("ratio to none", lambda row: optional(row["ratio_to_none_median"], ".3f")),
    ("reps", lambda row: str(row["reps"])),
]
"""The table's columns: header and how a summary row fills the cell."""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", default="1,2,4,8", help="comma-separated trainer counts")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of the interleaved sequence")
    parser.add_argument("--duration-s", type=float, default=10.0, help="timed window of each run")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="steps before the timed window")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "bench_scaling.json", help="JSON results")
    parser.add_argument("--plots", type=Path, default=ROOT / "runs" / "plots", help="folder for scaling.png")
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.trainers.split(",")]
    variants = args.variants.split(",")
    if sorted(set(variants) - set(VARIANTS)) or "none" not in variants or any(VARIANTS[name].servers for name in variants):
        parser.error(f"--variants must include none and name only variants without servers of {list(VARIANTS)}")
    count = args.reps * len(variants) * len(sizes)
    estimate = args.reps * len(variants) * sum(STARTUP_S + PER_RANK_S * size + args.duration_s for size in sizes)
    print(f"{count} runs, about {estimate / 60:.0f} min on 2 quiet cores. {note()}", flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for rep in range(args.reps):
            for size in sizes:
                for variant in variants:
                    result = run_once(variant, size, args, Path(scratch) / "result.json")
                    runs.append({"variant": variant, "rep": rep, **result})
                    print(f"rep {rep} {size} trainers {variant}: {result['samples_per_s_total']:,.0f} samples/s", flush=True)
    rows = summarize(runs)
    table = markdown_table(COLUMNS, rows)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"settings": vars(args) | {"output": str(args.output), "plots": str(args.plots)},
                                       "summary": rows, "runs": runs}, indent=2) + "\n")
    plots_module = plotting()
    plot = plots_module.scaling_plot(rows, args.plots / "scaling.png") if plots_module else None
    link = [f"![scaling]({os.path.relpath(plot, args.output.parent)})"] if plot else []
    report = "\n\n".join(["# Samples/s vs trainers", table, note(), *link])
    args.output.with_suffix(".md").write_text(report + "\n")
    print(report)
    print(f"wrote {args.output} and {args.output.with_suffix('.md')}")


if __name__ == "__main__":
    main()
