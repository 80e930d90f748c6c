"""Replica groups under a straggler: shadowgba's 2D layout against TorchRec's 2D recipe, flat DDP and no sync.

    python benchmarks/bench_2d.py [--compute simulated,real] [--stragglers straggler,even] [--reps 5] \
        [--duration-s 40] [--presets small] [--variants ma-shadow,bmuf-shadow,torchrec_2d,ddp,...] \
        [--every 10] [--interval-steps 2] [--interval-ms 20] [--step-ms MS] [--quality simulated:straggler] \
        [--quality-steps 3000] [--quality-stop samples|steps] \
        [--quality-seeds 0,1,2] [--quality-step-ms 30] [--quality-preset production] [--hosts-rate 1gbit] \
        [--dotted.key value ...]

Every run is a `torchrun` job of `benchmarks/train_dlrm.py` on 4 trainers (`--nproc`), TorchRec tables
(FBGEMM's fused kernels), in the 2D layout of 2 replica groups x 2 ranks (`--group-size`:
`sync.sharding_group_size`, groups of consecutive ranks) unless the variant is flat (`VARIANTS`):
- ma-shadow, ma-foreground, bmuf-shadow, bmuf-foreground: shadowgba 2D; every rank's table shards
  and the dense parameters are averaged with their replicas in the other group, in the background
  (shadow: paced by what the rounds cost, the library's default, or a round every `--interval-steps`
  steps of the fastest rank and at most one per `--interval-ms` where given) or every `--every` steps
  in the step (foreground);
- torchrec_2d: TorchRec's 2D recipe (`dlrm.torchrec_2d`): dense DDP over every trainer, the table
  replicas averaged every `--every` steps in the step, as `DMPCollection.sync()` does;
- ddp: flat model parallelism, the tables sharded over all 4 ranks, dense DDP (TorchRec's default);
- none-2d: the 2D layout with no sync across the groups (the ceiling: nothing but a group's own
  all-to-all paces it).
Any variant followed by `@dotted.key=value` overrides (`example_job.parse_variants`) runs with them,
beside the variant as it is (`ma-shadow@data.synthetic.zipf_exponent=1.3`).
Straggler settings (`--stragglers`): `straggler` slows trainer `--slow-trainer` (1: in group 0 with
trainer 0) `--factor` times (`ctrkit.straggler`), `even` slows nobody. Compute (`--compute`):
`simulated` pads every trainer's compute to `--step-ms` (default `SIMULATED_STEP_MS` of the preset),
the slowed one's to `factor` times that, so 4 ranks on 2 cores do not fight over CPU; `real` slows
the trainer by `factor` times its measured compute, with every rank on the same cores.

Across hosts (`--hosts-rate 1gbit`): every job runs on 2 simulated hosts (`ctrkit.cluster`), half the
ranks each, so that each replica group's all-to-all stays on its host and the rounds between the
groups cross a link shaped to that rate; the table adds the bytes every host sent per sample.

Throughput: identical runs differ too much on these machines to compare invocations
(docs/benchmarks.md, "The development machines"), so one invocation runs every cell interleaved over
`--reps` repetitions (for each repetition, each preset, each compute mode and each straggler
setting, every variant in a row), each trainer timing `--duration-s` after its own warm-up. The
figures are taken over the window every trainer was timing in (from the last warm-up end to the
first trainer's last step): with a straggler, the slow group's warm-up ends later, so the window
is shorter than `--duration-s` (the table's "window s"). Each variant's ratios to torchrec_2d and to
ddp are taken per repetition, against the run of the same cell and repetition, and then
summarized: median, min-max. The ideal ratio of a 2D variant to a paced baseline under the
straggler is the fast group at full speed and the slow one at its own pace against every group at
the slow pace (printed). Per variant also: the fast group's steps over the slow group's in the
window (decoupled groups: `factor`), the sync's rounds per second, table rounds and cycles and how many
steps a fragment had gone unaveraged when it was refreshed, mean and max over the run (trainer 0's
`sync` metrics, so steps of the slow group; 2D shadowgba variants only), the longest table cycle
finished while training in steps of the fastest rank (its bound: docs/two_d.md), every run's resources (CPU ms per
sample of all ranks, peak memory, a trainer's extra memory, `bench_summary`), and a trainer's extra
memory in MiB, alone and over none-2d's of the same repetition (the same table layout and the same
end-of-run checks, so what the sync holds beyond them; ddp's tables are sharded over 4 ranks, not
2, so its difference is not the sync's alone).
Simulated compute is only as good as its padding: the table shows the share of the fast group's
steps whose real work overran `--step-ms`, and a warning names the cells where that exceeds
`bench_gba.OVERRUN_WARNING` and the fast group never waits for the slow one inside its steps (in
the paced variants its steps overrun by waiting, not by working).

Quality (`--quality COMPUTE:STRAGGLER,...`; empty: none): held-out AUC at equal samples seen. Every
variant trains `--quality-steps` x trainers x batch samples from `train.seed` = the synthetic
data's seed = each of `--quality-seeds` (one repetition each), on the harness's default model
(ExperimentConfig defaults, whose steps are cheap enough for a long run) or `--quality-preset`'s,
then scores the held-out set (`example_job.SYNTHETIC_HELDOUT`). The default length, 3000 steps of 4 x 512, is the 6.1M
samples at which bench_matrix's quality preset saw ddp's held-out AUC flatten on 2 trainers (6000
steps of 2 x 512); on 4 trainers ddp takes half as many optimizer steps for them.
`--quality-stop` says how the samples are shared out:
- `samples` (default): the job stops once all trainers together have computed them
  (`train.job_samples`), as from a reader the trainers share. A decoupled fast group takes about
  `factor` times the slow group's share and every group ends at about the same time: the job whose
  samples/s the throughput table measures (a fast group that only got its equal share would finish
  early and idle, and the job would gain nothing from running it at full speed).
- `steps`: every trainer takes `--quality-steps` steps (its own equal share, as from a reader
  sharded per rank); a decoupled fast group finishes first and then, closed, keeps averaging its
  last weights with the slow group until that one closes too.
AUC minus torchrec_2d's and minus ddp's are paired by seed. Simulated quality runs pad the default
model's compute to `--quality-step-ms`; the table shows the fast group's overrun of it and the fast
group's steps over the slow group's.

Prints Markdown tables and writes the settings, summaries and every run as JSON (runs/bench_2d.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from bench_gba import OVERRUN_WARNING, ideal_ratio
from bench_summary import (
    PRESET_COLUMN, RESOURCE_COLUMNS, Column, Run, Spread, difference_spread, markdown_table, optional, paired,
    ratios_to, resource_spreads, select, spread, spread_cell,
)
from dlrm.config import ExperimentConfig
from example_job import (
    CONFIGS, MODEL_PRESETS, ROOT, SYNTHETIC_HELDOUT, WARMUP_STEPS, parse_presets, parse_variants, preset_arguments,
    run_across_hosts, run_example, variant_arguments, variant_base,
)
from shadowgba.config import load_config


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the job: its config, its overrides, its layout."""

    config: str
    """File under examples/configs."""
    overrides: tuple[str, ...] = ()
    """train_dlrm.py arguments after the config."""
    flat: bool = False
    """Tables sharded over every trainer (sync.sharding_group_size 0) instead of within a replica group."""
    decoupled: bool = False
    """The replica groups never wait for each other inside a step (shadow rounds, or no sync at all):
    a fast group's real work alone can overrun simulated compute, and its steps are not paired with
    the slow group's."""

    def arguments(self, group_size: int, every: int) -> list[str]:
        """The train_dlrm.py arguments that select this variant with replica groups of `group_size`
        and foreground rounds (TorchRec's sync interval) every `every` steps."""
        return ["--config", str(CONFIGS / self.config), *self.overrides,
                "--sync.sharding_group_size", str(0 if self.flat else group_size),
                "--sync.foreground_every", str(every)]


VARIANTS: dict[str, Variant] = {
    **{f"{algo}-{mode}": Variant(f"{algo}.yaml", ("--sync.mode", mode), decoupled=mode == "shadow")
       for algo in ("ma", "bmuf") for mode in ("shadow", "foreground")},
    "torchrec_2d": Variant("torchrec_2d.yaml"),
    "ddp": Variant("ddp.yaml", flat=True),
    "none-2d": Variant("none.yaml", decoupled=True),
}
"""Benchmarked variants (see the module docstring)."""
BASELINES = ("torchrec_2d", "ddp")
"""Every variant's throughput and AUC are compared with these, per repetition."""
NO_SYNC = "none-2d"
"""The variant whose extra memory a 2D variant's is taken over (same tables per rank, no sync)."""

STRAGGLERS = {"straggler": True, "even": False}
"""`--stragglers` names: whether trainer `--slow-trainer` is slowed."""
COMPUTE = ("simulated", "real")
"""`--compute` modes (module docstring)."""

SIMULATED_STEP_MS = {"small": 200.0}
"""Simulated compute per step of each preset when `--step-ms` is not given: above the 125-130 ms a
2D step of the small preset took with all 4 ranks computing on 2 cores shared with other jobs; the
shadow variants' table rounds take CPU of their own, so check the overrun column. Other presets need
`--step-ms`."""


QUALITY_STOP_CHECK_EVERY = 5
"""Steps between two counts of a sample-stopped quality run: each group overshoots the total by at
most this many of its steps (0.25% of 2000 steps' samples per group)."""


def parse_list(text: str, allowed: Sequence[str], option: str) -> list[str]:
    """A comma-separated option as a list, refused (SystemExit) when empty or naming anything else."""
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise SystemExit(f"{option} must name only {list(allowed)}; got {names}")
    return names


def parse_quality_cells(text: str) -> list[tuple[str, str]]:
    """`--quality simulated:straggler,real:even` as (compute, straggler) pairs; empty: none."""
    cells = []
    for cell in filter(None, text.split(",")):
        compute, _, straggler = cell.partition(":")
        if compute not in COMPUTE or straggler not in STRAGGLERS:
            raise SystemExit(f"--quality: each cell is COMPUTE:STRAGGLER with COMPUTE in {list(COMPUTE)} and "
                             f"STRAGGLER in {list(STRAGGLERS)}; got {cell!r}")
        cells.append((compute, straggler))
    return cells


def straggler_arguments(compute: str, straggler: str, step_ms: float, args: argparse.Namespace) -> list[str]:
    """The straggler section of a run in `compute` mode under straggler setting `straggler`."""
    slowed = ["--straggler.trainers", f"[{args.slow_trainer}]", "--straggler.factor", str(args.factor)]
    return [*(slowed if STRAGGLERS[straggler] else []),
            *(["--straggler.step_ms", str(step_ms)] if compute == "simulated" else [])]


def group_trainers(trainers: int, slow_trainer: int, group_size: int) -> tuple[list[int], list[int]]:
    """Trainer indices in the slowed trainer's replica group and in the other groups (the fast ones);
    for a flat variant the same split names the ranks that would form those groups."""
    slow = [index for index in range(trainers) if index // group_size == slow_trainer // group_size]
    return slow, [index for index in range(trainers) if index not in slow]


def fast_group_overrun(result: dict[str, Any], slow_trainer: int, group_size: int) -> float:
    """The share of its steps whose real work overran simulated compute, averaged over the trainers
    outside `slow_trainer`'s replica group of `group_size`."""
    overruns = result["straggler_overrun_fraction_by_trainer"]
    _, fast = group_trainers(len(overruns), slow_trainer, group_size)
    return statistics.mean(overruns[index] for index in fast)


def group_step_ratio(steps: Sequence[int], slow_trainer: int, group_size: int) -> float:
    """The fast groups' mean step count over the slow group's, from per-trainer `steps`."""
    slow, fast = group_trainers(len(steps), slow_trainer, group_size)
    return statistics.mean(steps[index] for index in fast) / max(statistics.mean(steps[index] for index in slow), 1)


def pacing_arguments(args: argparse.Namespace) -> list[str]:
    """The shadow variants' round pacing where `--interval-steps` / `--interval-ms` set it (ignored by
    foreground rounds and the baselines); none given: the library's own pacing by cost."""
    pacing = [("--sync.interval_steps", args.interval_steps), ("--sync.interval_ms", args.interval_ms)]
    return [item for flag, value in pacing if value is not None for item in (flag, str(value))]


def quality_length(args: argparse.Namespace, overrides: Sequence[str] = ()) -> list[str]:
    """The arguments that end a quality run at `--quality-steps` x trainers x batch samples
    (`--quality-stop samples`) or at `--quality-steps` steps of every trainer; the batch is the
    default model's unless `overrides` (the arguments passed on to the runs) set a `--data.*` key."""
    if args.quality_stop == "steps":
        return ["--train.steps", str(args.quality_steps)]
    pairs = zip(overrides[::2], overrides[1::2])
    data = [part for key, value in pairs if key.startswith("--data.") for part in (key, value)]
    batch_size = load_config(ExperimentConfig, None, data).data.batch_size
    return ["--train.job_samples", str(args.quality_steps * args.nproc * batch_size),
            "--train.stop_check_every", str(QUALITY_STOP_CHECK_EVERY)]


def throughput_metrics(result: dict[str, Any], slow_trainer: int, group_size: int) -> dict[str, Any]:
    """What the throughput table shows of one run, whose trainer `slow_trainer` may be slowed, with
    replica groups of `group_size` trainers."""
    config = result["config"]
    batch = config["data"][config["data"]["source"]]["batch_size"]
    sync = result["sync"]
    return {
        "samples_per_s": result["samples_per_s_total"],
        "window_s": result["window_s"],
        "group_step_ratio": group_step_ratio(result["steps_in_window_by_trainer"], slow_trainer, group_size),
        "overrun_fast_group": fast_group_overrun(result, slow_trainer, group_size),
        "sync_rounds_per_s": sync.get("rounds_per_s"),
        "dense_gap_max_any_trainer": max(result.get("sync_gap_steps_max_between_rounds_by_trainer") or [0]) or None,
        **{key: sync.get(key) for key in ("rounds_per_step", "sync_gap_steps_max", "sync_gap_steps_max_between_rounds",
                                          "table_groups_stopped",
                                          "table_rounds", "table_cycles", "fragment_refresh_age_steps_mean",
                                          "fragment_refresh_age_steps_max", "table_cycle_steps_max",
                                          "table_cycle_steps_last", "table_cycle_bound_steps_last",
                                          "table_cycles_timed", "table_cycles_over_bound",
                                          "table_cycle_overrun_steps_max")},
        "extra_mib": result["resources"]["trainer_extra_rss_mib_max"],
        "stopped_together": result["samples_computed_total"] == result["trainers"] * result["steps"] * batch,
        "wire_kb_per_sample": (result["wire_bytes_sent"] / 1e3 / result["samples_computed_total"]
                               if "wire_bytes_sent" in result else None),
    }


THROUGHPUT_FIGURES = ("samples_per_s", "window_s", "group_step_ratio", "overrun_fast_group", "sync_rounds_per_s",
                      "rounds_per_step", "sync_gap_steps_max", "sync_gap_steps_max_between_rounds",
                      "dense_gap_max_any_trainer",
                      "table_groups_stopped",
                      "table_rounds", "table_cycles", "fragment_refresh_age_steps_mean",
                      "fragment_refresh_age_steps_max", "table_cycle_steps_max", "table_cycle_steps_last",
                      "table_cycle_bound_steps_last", "table_cycles_timed", "table_cycles_over_bound",
                      "table_cycle_overrun_steps_max", "extra_mib",
                      "wire_kb_per_sample")
"""The `throughput_metrics` summarized as median and min-max over repetitions."""


def repetition(run: Run) -> int:
    """The repetition a run belongs to: the runs of one repetition and cell ran side by side."""
    return run["rep"]


def metric(key: str) -> Callable[[Run], float]:
    """How to read `key` of a run's metrics."""
    return lambda run: run["metrics"][key]


def throughput_rows(
    runs: list[Run], cells: Sequence[tuple[str, str, str]], variants: Sequence[str]
) -> list[dict[str, Any]]:
    """Per (preset, compute, straggler) cell and variant: every figure's spread over repetitions, the
    ratios to each baseline per repetition (listed, and their spread), the extra memory over none-2d's
    per repetition, and the resources."""
    rows = []
    for preset, compute, straggler in cells:
        mine = select(runs, preset=preset, compute=compute, straggler=straggler)
        for variant in variants:
            cell = select(mine, variant=variant)
            row: dict[str, Any] = {
                "preset": preset, "compute": compute, "straggler": straggler, "variant": variant, "reps": len(cell),
                "dense_params": cell[0]["result"]["dense_params"],
                "decoupled": VARIANTS[variant_base(variant)].decoupled,
                **{key: spread([run["metrics"][key] for run in cell]) for key in THROUGHPUT_FIGURES},
                "stopped_together": sum(run["metrics"]["stopped_together"] for run in cell),
                "extra_mib_over_none_2d": difference_spread(cell, select(mine, variant=NO_SYNC), repetition,
                                                            metric("extra_mib")),
                **resource_spreads([run["result"] for run in cell]),
            }
            for base in BASELINES:
                ratios = ratios_to(cell, select(mine, variant=base), repetition, metric("samples_per_s"))
                row[f"ratios_to_{base}"] = ratios
                row[f"ratio_to_{base}"] = spread(ratios)
            rows.append(row)
    return rows


def median(figure: Spread | None) -> float | None:
    """A spread's median, or None where the figure does not apply."""
    return None if figure is None else figure[0]


THROUGHPUT_COLUMNS: list[Column] = [
    ("compute / straggler", lambda row: f"{row['compute']} / {row['straggler']}"),
    PRESET_COLUMN,
    ("variant", lambda row: row["variant"]),
    ("samples/s (min-max)", lambda row: spread_cell(row["samples_per_s"], ",.0f")),
    *[(f"ratio to {base}", lambda row, base=base: spread_cell(row[f"ratio_to_{base}"], ".2f")) for base in BASELINES],
    ("window s", lambda row: spread_cell(row["window_s"], ".1f")),
    ("steps fast / slow group", lambda row: spread_cell(row["group_step_ratio"], ".2f")),
    ("fast group overrun", lambda row: spread_cell(row["overrun_fast_group"], ".0%")),
    ("sync rounds/s", lambda row: spread_cell(row["sync_rounds_per_s"], ".2f")),
    ("dense rounds per step / longest gap, from the start / between rounds (steps), trainer 0",
     lambda row: f"{optional(median(row['rounds_per_step']), '.3f')} / "
                 f"{optional(median(row['sync_gap_steps_max']), '.0f')} / "
                 f"{optional(median(row['sync_gap_steps_max_between_rounds']), '.0f')}"),
    ("longest gap between dense rounds, any trainer (its own steps)",
     lambda row: optional(median(row["dense_gap_max_any_trainer"]), ".0f")),
    ("table groups cut short", lambda row: optional(median(row["table_groups_stopped"]), ".0f")),
    ("table rounds / cycles", lambda row: f"{optional(median(row['table_rounds']), '.0f')} / "
                                          f"{optional(median(row['table_cycles']), '.0f')}"),
    ("fragment age at refresh, mean / max (steps)",
     lambda row: f"{optional(median(row['fragment_refresh_age_steps_mean']), '.1f')} / "
                 f"{optional(median(row['fragment_refresh_age_steps_max']), '.0f')}"),
    ("longest table cycle (steps of the fastest rank)",
     lambda row: optional(median(row["table_cycle_steps_max"]), ".0f")),
    ("last table cycle / its bound (steps)",
     lambda row: f"{optional(median(row['table_cycle_steps_last']), '.0f')} / "
                 f"{optional(median(row['table_cycle_bound_steps_last']), '.0f')}"),
    ("table cycles over their bound / held to one (most steps over)",
     lambda row: f"{optional(median(row['table_cycles_over_bound']), '.0f')} / "
                 f"{optional(median(row['table_cycles_timed']), '.0f')} "
                 f"({optional(median(row['table_cycle_overrun_steps_max']), '.0f')})"),
    *RESOURCE_COLUMNS,
    ("extra MiB per trainer", lambda row: spread_cell(row["extra_mib"], ",.0f")),
    ("wire KB/sample", lambda row: spread_cell(row["wire_kb_per_sample"], ".1f")),
    (f"extra MiB over {NO_SYNC}", lambda row: spread_cell(row["extra_mib_over_none_2d"], ",.0f")),
    ("reps", lambda row: str(row["reps"])),
]
"""The throughput table's columns: header and how a summary row fills the cell (median, min-max beside it)."""


def quality_rows(runs: list[Run], cells: Sequence[tuple[str, str]], variants: Sequence[str]) -> list[dict[str, Any]]:
    """Per (compute, straggler) cell and variant: held-out AUC and log loss over the seeds, the AUC
    minus each baseline's of the same seed, the samples seen, the fast group's overrun of simulated
    compute and the run's wall time."""
    rows = []
    for compute, straggler in cells:
        mine = select(runs, compute=compute, straggler=straggler)
        for variant in variants:
            cell = select(mine, variant=variant)
            row: dict[str, Any] = {
                "compute": compute, "straggler": straggler, "variant": variant, "reps": len(cell),
                "samples_seen": spread([run["result"]["samples_computed_total"] for run in cell]),
                "auc": spread([run["result"]["auc"] for run in cell]),
                "log_loss": spread([run["result"]["log_loss"] for run in cell]),
                "overrun_fast_group": spread([run["overrun_fast_group"] for run in cell]),
                "group_step_ratio": spread([run["group_step_ratio"] for run in cell]),
                "wall_s": spread([run["result"]["wall_s"] for run in cell]),
            }
            for base in BASELINES:
                row[f"auc_minus_{base}"] = [run["result"]["auc"] - reference["result"]["auc"]
                                            for run, reference in paired(cell, select(mine, variant=base), repetition)]
            rows.append(row)
    return rows


QUALITY_COLUMNS: list[Column] = [
    ("compute / straggler", lambda row: f"{row['compute']} / {row['straggler']}"),
    ("variant", lambda row: row["variant"]),
    ("samples seen", lambda row: spread_cell(row["samples_seen"], ",.0f")),
    ("AUC (min-max)", lambda row: spread_cell(row["auc"], ".4f")),
    *[(f"AUC - {base}, per seed", lambda row, base=base: " ".join(
        f"{gap:+.4f}" for gap in row[f"auc_minus_{base}"]) or "-") for base in BASELINES],
    ("log loss", lambda row: spread_cell(row["log_loss"], ".4f")),
    ("fast group overrun", lambda row: spread_cell(row["overrun_fast_group"], ".0%")),
    ("steps fast / slow group", lambda row: spread_cell(row["group_step_ratio"], ".2f")),
    ("run wall s", lambda row: spread_cell(row["wall_s"], ".0f")),
    ("seeds", lambda row: str(row["reps"])),
]
"""The quality table's columns."""


def warnings(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What makes a throughput cell untrustworthy: simulated compute that did not hold where the fast
    group never waits inside a step (a paced group's steps overrun by waiting), and decoupled runs in
    which every trainer stopped at trainer 0's step (something paired the groups' steps)."""
    lines = []
    overrun = [row for row in rows if row["compute"] == "simulated" and (row["decoupled"] or row["straggler"] == "even")
               and row["overrun_fast_group"] and row["overrun_fast_group"][2] > OVERRUN_WARNING]
    if overrun:
        worst = max(row["overrun_fast_group"][2] for row in overrun)
        lines.append(f"WARNING: the fast group's real work overran the simulated step in up to {worst:.0%} of its "
                     f"steps in {len(overrun)} cell(s) ({', '.join(sorted({row['variant'] for row in overrun}))}), "
                     f"so they ran slower than simulated; rerun with a larger --step-ms")
    paired_steps = [row for row in rows
                    if row["decoupled"] and row["straggler"] == "straggler" and row["stopped_together"]]
    if paired_steps:
        lines.append(f"WARNING: in {sum(row['stopped_together'] for row in paired_steps)} decoupled run(s) under the "
                     f"straggler every trainer stopped at trainer 0's step: something paired the groups' steps (a "
                     f"stop decision broadcast over every trainer would), so those runs measure a paced job")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compute", default=",".join(COMPUTE), help=f"comma-separated subset of {list(COMPUTE)}")
    parser.add_argument("--stragglers", default=",".join(STRAGGLERS),
                        help=f"comma-separated subset of {list(STRAGGLERS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    parser.add_argument("--presets", default="small", help=f"comma-separated subset of {MODEL_PRESETS} (throughput)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the interleaved throughput sequence")
    parser.add_argument("--duration-s", type=float, default=40.0,
                        help="each trainer's timed time after its warm-up (the common window is shorter by the "
                             "slow group's later warm-up)")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="steps before a trainer's timed time")
    parser.add_argument("--nproc", type=int, default=4, help="trainers per run")
    parser.add_argument("--group-size", type=int, default=2,
                        help="trainers per replica group (sync.sharding_group_size)")
    parser.add_argument("--every", type=int, default=10,
                        help="steps between foreground rounds and between torchrec_2d's table averages")
    parser.add_argument("--interval-steps", type=int, default=None,
                        help="shadow variants: a round every this many steps of the fastest rank (sync.interval_steps; "
                             "default: the config's)")
    parser.add_argument("--interval-ms", type=float, default=None,
                        help="shadow variants: the least time between two rounds (sync.interval_ms; default: the "
                             "config's)")
    parser.add_argument("--slow-trainer", type=int, default=1, help="index of the slowed trainer")
    parser.add_argument("--factor", type=float, default=3.0, help="slowdown of the slowed trainer")
    parser.add_argument("--step-ms", type=float,
                        help=f"simulated compute per step, throughput runs (default per preset: {SIMULATED_STEP_MS})")
    parser.add_argument("--quality", default="simulated:straggler",
                        help="comma-separated COMPUTE:STRAGGLER cells of quality runs (empty: none)")
    parser.add_argument("--quality-steps", type=int, default=3000,
                        help="a quality run's samples: this many steps of every trainer's batch")
    parser.add_argument("--quality-stop", choices=("samples", "steps"), default="samples",
                        help="samples: the job stops at the total (a fast group takes more); steps: every trainer "
                             "takes --quality-steps")
    parser.add_argument("--quality-seeds", default="0,1,2", help="comma-separated seeds, one quality repetition each")
    parser.add_argument("--quality-step-ms", type=float, default=30.0, help="simulated compute per step, quality runs")
    parser.add_argument("--quality-preset", default="",
                        help=f"model preset of the quality runs, one of {MODEL_PRESETS} (empty: the harness's "
                             "default model)")
    parser.add_argument("--hosts-rate", default="",
                        help="run every job across 2 simulated hosts (a replica group a host) whose links run at this "
                             "rate, e.g. 1gbit (needs root); empty: one host's loopback")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "bench_2d.json", help="JSON results")
    args, extra = parser.parse_known_args(argv)
    computes = parse_list(args.compute, COMPUTE, "--compute")
    stragglers = parse_list(args.stragglers, list(STRAGGLERS), "--stragglers")
    variants = parse_variants(args.variants, VARIANTS, "--variants")
    variant_table = {name: variant.arguments(args.group_size, args.every) for name, variant in VARIANTS.items()}
    presets = parse_presets(args.presets)
    quality_cells = parse_quality_cells(args.quality)
    if args.quality_preset:
        parse_presets(args.quality_preset)
    if "simulated" in computes and args.step_ms is None and set(presets) - set(SIMULATED_STEP_MS):
        parser.error(f"--step-ms: simulated compute has a default only for {list(SIMULATED_STEP_MS)}")
    cells = [(preset, compute, straggler) for preset in presets for compute in computes for straggler in stragglers]

    def run(label: str, arguments: list[str], output: Path) -> dict[str, Any]:
        if not args.hosts_rate:
            return run_example(label, args.nproc, arguments, output)
        return run_across_hosts(label, arguments, output, nproc_per_host=args.nproc // 2, rate=args.hosts_rate)

    throughput, quality = [], []
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "result.json"
        for rep in range(args.reps):
            for preset, compute, straggler in cells:
                for variant in variants:
                    label = f"rep {rep} {preset} {compute} {straggler} {variant}"
                    result = run(label, variant_arguments(variant, variant_table, [
                        *pacing_arguments(args), *preset_arguments(preset),
                        "--train.duration_s", str(args.duration_s), "--train.warmup_steps", str(args.warmup_steps),
                        *straggler_arguments(compute, straggler, args.step_ms or SIMULATED_STEP_MS.get(preset, 0.0),
                                             args), *extra]), output)
                    metrics = throughput_metrics(result, args.slow_trainer, args.group_size)
                    throughput.append({"preset": preset, "compute": compute, "straggler": straggler,
                                       "variant": variant, "rep": rep, "metrics": metrics, "result": result})
                    print(f"{label}: {metrics['samples_per_s']:,.0f} samples/s over {metrics['window_s']:.1f} s, "
                          f"{1e3 * (result['resources']['cpu_s_per_sample'] or 0):.3f} CPU ms/sample", flush=True)
        for rep, seed in enumerate(int(seed) for seed in args.quality_seeds.split(",")):
            for compute, straggler in quality_cells:
                for variant in variants:
                    label = f"quality seed {seed} {compute} {straggler} {variant}"
                    result = run(label, variant_arguments(variant, variant_table, [
                        *pacing_arguments(args), *quality_length(args, extra),
                        *(preset_arguments(args.quality_preset) if args.quality_preset else []),
                        "--train.warmup_steps", str(args.warmup_steps),
                        "--train.seed", str(seed), "--data.synthetic.seed", str(seed), *SYNTHETIC_HELDOUT,
                        *straggler_arguments(compute, straggler, args.quality_step_ms, args), *extra]), output)
                    quality.append({
                        "compute": compute, "straggler": straggler, "variant": variant, "rep": rep, "seed": seed,
                        "overrun_fast_group": fast_group_overrun(result, args.slow_trainer, args.group_size),
                        "group_step_ratio": group_step_ratio(result["steps_by_trainer"], args.slow_trainer,
                                                             args.group_size),
                        "result": result})
                    print(f"{label}: AUC {result['auc']:.4f} after {result['samples_computed_total']:,.0f} samples, "
                          f"{result['wall_s']:.0f} s", flush=True)
    report: dict[str, Any] = {"settings": {key: str(value) for key, value in vars(args).items()} | {
        "overrides": list(extra)}, "ideal_ratio": ideal_ratio(args.nproc // args.group_size, args.factor)}
    if throughput:
        report["throughput"] = throughput_rows(throughput, cells, variants)
        print(markdown_table(THROUGHPUT_COLUMNS, report["throughput"]))
        print(f"ideal ratio of a decoupled 2D variant to a paced one under the straggler: {report['ideal_ratio']:.2f} "
              f"({args.nproc // args.group_size} replica groups, one {args.factor:g}x slower)")
        for line in warnings(report["throughput"]):
            print(line)
    if quality:
        report["quality"] = quality_rows(quality, quality_cells, variants)
        print(markdown_table(QUALITY_COLUMNS, report["quality"]))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report |= {"throughput_runs": throughput, "quality_runs": quality}
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
