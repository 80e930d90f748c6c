"""Throughput of every sync mode against local training, DDP and torch's PMA, at both presets, side by side.

    python benchmarks/bench_sync.py [--reps 5] [--duration-s 30] [--presets small,production] \
        [--modes none,ddp,bmuf-shadow,ma-shadow@sync.rounds_nice=19] [--dotted.key value ...]

Identical runs differ too much on these machines to compare invocations
(docs/benchmarks.md, "The development machines"), so one invocation runs every mode as a `torchrun`
job of `benchmarks/train_dlrm.py`, interleaved over several repetitions (for each repetition, for
each preset, every mode in a row), each with a fixed timed window after warm-up. Each mode's ratios
to `none`, `ddp` and torch's `PeriodicModelAverager` (`pma`; those of them run) are taken per
repetition, against the run of the same preset and repetition, which cancels slow drifts of the
machine, and then summarized: median, min-max. The presets are
`example_job.MODEL_PRESETS` (small: a 338K-parameter dense net; production: MLPerf DLRM's 2.4M);
further `--dotted.key value` arguments override every run's config, and a mode followed by
`@dotted.key=value` overrides (`example_job.parse_variants`) runs that mode with them, beside it as it is. Every figure is shown as its
median over repetitions with the min-max beside it, resources included (CPU ms per sample of all
ranks, peak memory, a trainer's extra memory as a multiple of the dense size; `bench_summary`).
Prints a Markdown table and writes every run's numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any, Sequence

from bench_summary import (
    EXTRA_OVER_NONE_COLUMN, PRESET_COLUMN, RESOURCE_COLUMNS, Column, Run, difference_spread, extra_x_dense,
    markdown_table, ratio_spread, resource_spreads, select, spread, spread_cell,
)
from example_job import (
    CONFIGS, MODEL_PRESETS, ROOT, WARMUP_STEPS, parse_presets, parse_variants, preset_arguments, run_example,
    variant_arguments,
)

MODES: dict[str, list[str]] = {
    "none": ["--config", str(CONFIGS / "none.yaml")],
    "ddp": ["--config", str(CONFIGS / "ddp.yaml")],
    "pma": ["--config", str(CONFIGS / "pma.yaml")],
    **{
        f"{algo}-{mode}": ["--config", str(CONFIGS / f"{algo}.yaml"), "--sync.mode", mode]
        for algo in ("ma", "easgd", "bmuf")
        for mode in ("shadow", "foreground")
    },
}
"""Benchmarked modes and the train_dlrm.py arguments that select them."""

def run_once(preset: str, mode: str, args: argparse.Namespace, extra: Sequence[str], output: Path) -> dict[str, Any]:
    """One torchrun job of the example in `mode` at model `preset`."""
    arguments = variant_arguments(mode, MODES, [
        *preset_arguments(preset),
        "--train.duration_s", str(args.duration_s), "--train.warmup_steps", str(args.warmup_steps), *extra,
    ])
    return run_example(f"{preset} {mode}", args.nproc, arguments, output)


def samples_per_s(run: Run) -> float:
    """All trainers' samples per second over the common timed window."""
    return run["samples_per_s_total"]


def repetition(run: Run) -> int:
    """The repetition a run belongs to: the runs of one repetition and preset ran side by side."""
    return run["rep"]


def summarize(runs: list[Run], presets: Sequence[str], modes: Sequence[str]) -> list[dict[str, Any]]:
    """Per preset and mode: samples/s, ratios to none and ddp (per repetition), AUC, sync rounds/s and
    the resources, each as median and min-max over repetitions."""
    rows = []
    for preset in presets:
        mine = select(runs, preset=preset)
        baselines = {base: select(mine, mode=base) for base in ("none", "ddp", "pma") if select(mine, mode=base)}
        for mode in modes:
            cells = select(mine, mode=mode)
            rows.append({
                "preset": preset, "mode": mode, "reps": len(cells),
                "dense_params": cells[0]["dense_params"],
                "samples_per_s": spread([samples_per_s(run) for run in cells]),
                **{f"ratio_to_{base}": ratio_spread(cells, runs_of, repetition, samples_per_s)
                   for base, runs_of in baselines.items()},
                "auc": spread([run["auc"] for run in cells]),
                "sync_rounds_per_s": spread([run["sync"].get("rounds_per_s", 0.0) for run in cells]),
                **resource_spreads(cells),
                "extra_x_dense_over_none": difference_spread(cells, baselines["none"], repetition, extra_x_dense),
            })
    return rows


COLUMNS: list[Column] = [
    PRESET_COLUMN,
    ("mode", lambda row: row["mode"]),
    ("samples/s (min-max)", lambda row: spread_cell(row["samples_per_s"], ",.0f")),
    ("ratio to none", lambda row: spread_cell(row["ratio_to_none"], ".3f")),
    ("ratio to ddp", lambda row: spread_cell(row["ratio_to_ddp"], ".3f") if "ratio_to_ddp" in row else "-"),
    ("ratio to pma", lambda row: spread_cell(row["ratio_to_pma"], ".3f") if "ratio_to_pma" in row else "-"),
    ("AUC", lambda row: spread_cell(row["auc"], ".4f")),
    ("sync rounds/s", lambda row: spread_cell(row["sync_rounds_per_s"], ".1f")),
    *RESOURCE_COLUMNS,
    EXTRA_OVER_NONE_COLUMN,
    ("reps", lambda row: str(row["reps"])),
]
"""The table's columns: header and how a summary row fills the cell (median, min-max beside it)."""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the interleaved sequence")
    parser.add_argument("--duration-s", type=float, default=30.0, help="timed window of each run")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="steps before the timed window")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--presets", default=",".join(MODEL_PRESETS), help=f"comma-separated subset of {MODEL_PRESETS}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {list(MODES)}")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "bench_sync.json", help="JSON results")
    args, extra = parser.parse_known_args(argv)
    presets = parse_presets(args.presets)
    modes = parse_variants(args.modes, MODES, "--modes")
    if "none" not in modes:
        parser.error(f"--modes must include none; got {modes}")
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for rep in range(args.reps):
            for preset in presets:
                for mode in modes:
                    result = run_once(preset, mode, args, extra, Path(scratch) / "result.json")
                    runs.append({"preset": preset, "mode": mode, "rep": rep, **result})
                    print(f"rep {rep} {preset} {mode}: {result['samples_per_s_total']:,.0f} samples/s, "
                          f"AUC {result['auc']:.4f}, "
                          f"{1e3 * (result['resources']['cpu_s_per_sample'] or 0):.3f} CPU ms/sample", flush=True)
    rows = summarize(runs, presets, modes)
    print(markdown_table(COLUMNS, rows))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: str(value) for key, value in vars(args).items()} | {"overrides": list(extra)}
    args.output.write_text(json.dumps({"settings": settings, "summary": rows, "runs": runs}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
