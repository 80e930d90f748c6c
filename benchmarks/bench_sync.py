"""Throughput of every sync mode against local training, measured the way these machines demand.

    python benchmarks/bench_sync.py [--reps 3] [--duration-s 20] [--modes none,ddp,bmuf] [--model.x y ...]

Identical runs differ too much on these machines to compare invocations
(docs/benchmarks.md, "The development machines"), so one invocation runs every mode as a `torchrun` job of `benchmarks/train_dlrm.py`, interleaved (A B C ... A B C ...) over several
repetitions, each with a fixed timed window after warm-up. Each mode's ratio is the median of its
per-repetition ratios to the `none` run of the same repetition, which cancels slow drifts of the
machine. The model is throughput-sized (`example_job.THROUGHPUT_MODEL`: 8 tables of 100K x 64, a
338K-parameter dense net); further `--dotted.key value` arguments override every run's config. Prints a Markdown table
and writes every run's numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, Sequence

from bench_summary import Column, markdown_table, ratios_to
from example_job import CONFIGS, ROOT, THROUGHPUT_MODEL, run_example

MODES: dict[str, list[str]] = {
    "none": ["--config", str(CONFIGS / "none.yaml")],
    "ddp": ["--config", str(CONFIGS / "ddp.yaml")],
    **{
        f"{algo}-{mode}": ["--config", str(CONFIGS / f"{algo}.yaml"), "--sync.mode", mode]
        for algo in ("ma", "easgd", "bmuf")
        for mode in ("shadow", "foreground")
    },
}
"""Benchmarked modes and the train_dlrm.py arguments that select them."""

def run_once(mode: str, args: argparse.Namespace, extra: Sequence[str], output: Path) -> dict[str, Any]:
    """One torchrun job of the example in `mode`."""
    arguments = [
        *MODES[mode], *THROUGHPUT_MODEL,
        "--train.duration_s", str(args.duration_s), "--train.warmup_steps", str(args.warmup_steps), *extra,
    ]
    return run_example(mode, args.nproc, arguments, output)


def summarize(runs: list[dict[str, Any]], modes: Sequence[str]) -> list[dict[str, Any]]:
    """Per mode: median, min and max samples/s, median per-repetition ratio to none, median AUC."""
    baseline = [run for run in runs if run["mode"] == "none"]
    rows = []
    for mode in modes:
        mine = [run for run in runs if run["mode"] == mode]
        speeds = [run["samples_per_s_total"] for run in mine]
        rows.append({
            "mode": mode,
            "samples_per_s_median": statistics.median(speeds),
            "samples_per_s_min": min(speeds),
            "samples_per_s_max": max(speeds),
            "ratio_to_none_median": statistics.median(
                ratios_to(mine, baseline, key=lambda run: run["rep"], value=lambda run: run["samples_per_s_total"])
            ),
            "auc_median": statistics.median(run["auc"] for run in mine),
            "sync_rounds_per_s_median": statistics.median(run["sync"].get("rounds_per_s", 0.0) for run in mine),
        })
    return rows


COLUMNS: list[Column] = [
    ("mode", lambda row: row["mode"]),
    ("samples/s (median)", lambda row: f"{row['samples_per_s_median']:,.0f}"),
    ("min-max", lambda row: f"{row['samples_per_s_min']:,.0f}-{row['samples_per_s_max']:,.0f}"),
    ("ratio to none", lambda row: f"{row['ratio_to_none_median']:.3f}"),
    ("AUC", lambda row: f"{row['auc_median']:.4f}"),
    ("sync rounds/s", lambda row: f"{row['sync_rounds_per_s_median']:.1f}"),
]
"""The table's columns: header and how a summary row fills the cell."""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the interleaved sequence")
    parser.add_argument("--duration-s", type=float, default=20.0, help="timed window of each run")
    parser.add_argument("--warmup-steps", type=int, default=50, help="steps before the timed window")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {list(MODES)}")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "bench_sync.json", help="JSON results")
    args, extra = parser.parse_known_args(argv)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown or "none" not in modes:
        parser.error(f"--modes must include none and name only {list(MODES)}; got {modes}")
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for rep in range(args.reps):
            for mode in modes:
                result = run_once(mode, args, extra, Path(scratch) / f"{mode}-{rep}.json")
                runs.append({"mode": mode, "rep": rep, **result})
                print(f"rep {rep} {mode}: {result['samples_per_s_total']:,.0f} samples/s, "
                      f"AUC {result['auc']:.4f}", flush=True)
    rows = summarize(runs, modes)
    print(markdown_table(COLUMNS, rows))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: str(value) for key, value in vars(args).items()} | {"overrides": [*THROUGHPUT_MODEL, *extra]}
    args.output.write_text(json.dumps({"settings": settings, "summary": rows, "runs": runs}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
