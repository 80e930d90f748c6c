"""The benchmark matrix's summary tables: quality at equal samples seen, throughput against no-sync.

A run is one cell of `bench_matrix`: its fields (variant, dataset, straggler, seed, steps) and
`result`, the example's JSON. Pure functions of the runs, so they are tested on constructed runs.

- Quality (cells without a straggler): per dataset and variant, mean +/- std over seeds of held-out
  AUC and log loss, and the AUC difference to ddp taken per seed (the same seed is the same task
  and initialization, so only the sync differs).
- Throughput: per dataset, straggler setting and variant, the median over seeds (repetitions) of
  samples/s of all trainers, and the median of per-repetition ratios to `none`; the sync gap
  (training steps between two sync results reaching the weights) and GBA's gradient staleness.
- Throughput at the model presets (the cells with a `model`, `--model-presets`): per preset,
  straggler setting and variant, samples/s and the per-repetition ratio to `none`, each as median
  and min-max, and the resources (CPU ms per sample of all ranks, peak memory, a trainer's extra
  memory as a multiple of the dense size). Those cells are in no other table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from bench_summary import (
    EXTRA_OVER_NONE_COLUMN, RESOURCE_COLUMNS, Column, Run, difference_spread, distinct, extra_x_dense, markdown_table,
    mean_std, median_or_none, merged_histogram, optional, paired, ratio_spread, ratios_to, resource_spreads, select,
    spread, spread_cell, staleness_summary,
)


def seed_of(run: Run) -> int:
    """The repetition a run belongs to: runs of one seed ran side by side."""
    return run["seed"]


def matrix_runs(runs: Sequence[Run]) -> list[Run]:
    """The matrix's own cells (the example's default model), without the model presets' throughput cells."""
    return [run for run in runs if not run.get("model")]


def quality_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per dataset and variant (cells without a straggler): AUC and log loss over seeds, AUC minus ddp's."""
    rows = []
    even = select(matrix_runs(runs), straggler=False)
    for dataset in distinct(run["dataset"] for run in even):
        mine = select(even, dataset=dataset)
        ddp = select(mine, variant="ddp")
        for variant in distinct(run["variant"] for run in mine):
            cells = select(mine, variant=variant)
            auc = [run["result"]["auc"] for run in cells]
            loss = [run["result"]["log_loss"] for run in cells]
            delta = [run["result"]["auc"] - base["result"]["auc"] for run, base in paired(cells, ddp, seed_of)]
            teacher = [run["result"]["teacher_auc"] for run in cells if "teacher_auc" in run["result"]]
            rows.append({
                "dataset": dataset, "variant": variant, "seeds": len(cells),
                "samples_seen": cells[0]["result"]["curve"][-1]["samples_seen"],
                "auc": mean_std(auc), "log_loss": mean_std(loss),
                "auc_minus_ddp": mean_std(delta) if delta else None,
                "teacher_auc": mean_std(teacher)[0] if teacher else None,
            })
    return rows


def merged_staleness(runs: Sequence[Run]) -> dict[str, int]:
    """GBA's staleness histograms of `runs`, added up ({} for non-GBA runs): each run's shard 0's,
    which decides every push (the other shards follow its decisions)."""
    return merged_histogram(
        shards[0]["staleness_histogram"] for run in runs if (shards := (run["result"].get("gba") or {}).get("dense_shards"))
    )


def sync_gap(run: Run) -> float | None:
    """Mean training steps between two sync results reaching the weights, where the variant has rounds."""
    return run["result"]["sync"].get("sync_gap_steps_mean")


def samples_per_s(run: Run) -> float:
    """Samples per second of all trainers over the common timed window."""
    return run["result"]["samples_per_s_total"]


def throughput_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per dataset, straggler setting and variant: samples/s over seeds, ratio to none, sync gap, staleness."""
    rows = []
    runs = matrix_runs(runs)
    for dataset in distinct(run["dataset"] for run in runs):
        for straggler in distinct(run["straggler"] for run in select(runs, dataset=dataset)):
            mine = select(runs, dataset=dataset, straggler=straggler)
            none = select(mine, variant="none")
            for variant in distinct(run["variant"] for run in mine):
                cells = select(mine, variant=variant)
                speeds = [samples_per_s(run) for run in cells]
                histogram = merged_staleness(cells)
                rows.append({
                    "dataset": dataset, "straggler": straggler, "variant": variant, "seeds": len(cells),
                    "samples_per_s_median": median_or_none(speeds),
                    "samples_per_s_min": min(speeds), "samples_per_s_max": max(speeds),
                    "ratio_to_none_median": median_or_none(ratios_to(cells, none, seed_of, samples_per_s)),
                    "sync_gap_median": median_or_none([gap for gap in map(sync_gap, cells) if gap is not None]),
                    **(staleness_summary(histogram) if histogram else {}),
                })
    return rows


def model_throughput_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per model preset, straggler setting and variant (the model presets' cells): samples/s and the
    per-repetition ratios to none and to ddp, median and min-max, and the resources."""
    rows = []
    cells_of_models = [run for run in runs if run.get("model")]
    for model in distinct(run["model"] for run in cells_of_models):
        for straggler in (False, True):
            mine = select(cells_of_models, model=model, straggler=straggler)
            none, ddp = select(mine, variant="none"), select(mine, variant="ddp")
            for variant in distinct(run["variant"] for run in mine):
                cells = select(mine, variant=variant)
                rows.append({
                    "model": model, "straggler": straggler, "variant": variant, "reps": len(cells),
                    "dense_params": cells[0]["result"]["dense_params"],
                    "samples_per_s": spread([samples_per_s(run) for run in cells]),
                    "ratio_to_none": ratio_spread(cells, none, seed_of, samples_per_s),
                    "ratio_to_ddp": ratio_spread(cells, ddp, seed_of, samples_per_s),
                    **resource_spreads([run["result"] for run in cells]),
                    "extra_x_dense_over_none": difference_spread(
                        cells, none, seed_of, lambda run: extra_x_dense(run["result"])),
                })
    return rows


def plus_minus(pair: tuple[float, float] | None, spec: str) -> str:
    """`mean +/- std`, or `-` where the statistic does not apply."""
    return "-" if pair is None else f"{format(pair[0], spec)} ± {format(pair[1], spec.lstrip('+'))}"


QUALITY_COLUMNS: list[Column] = [
    ("dataset", lambda row: row["dataset"]),
    ("algorithm", lambda row: row["variant"]),
    ("samples seen", lambda row: f"{row['samples_seen']:,}"),
    ("held-out AUC", lambda row: plus_minus(row["auc"], ".4f")),
    ("log loss", lambda row: plus_minus(row["log_loss"], ".4f")),
    ("AUC - ddp (per seed)", lambda row: plus_minus(row["auc_minus_ddp"], "+.4f")),
    ("seeds", lambda row: str(row["seeds"])),
]
"""Quality table: header and cell of each column."""

THROUGHPUT_COLUMNS: list[Column] = [
    ("dataset", lambda row: row["dataset"]),
    ("straggler", lambda row: "trainer 1 3x slow" if row["straggler"] else "none"),
    ("algorithm", lambda row: row["variant"]),
    ("samples/s (median)", lambda row: f"{row['samples_per_s_median']:,.0f}"),
    ("min-max", lambda row: f"{row['samples_per_s_min']:,.0f}-{row['samples_per_s_max']:,.0f}"),
    ("ratio to none", lambda row: optional(row["ratio_to_none_median"], ".3f")),
    ("sync gap (steps)", lambda row: optional(row["sync_gap_median"], ".2f")),
    ("staleness mean / p90 / max", lambda row: (
        f"{row['staleness_mean']:.2f} / {row['staleness_p90']} / {row['staleness_top']}"
        if "staleness_mean" in row else "-")),
    ("seeds", lambda row: str(row["seeds"])),
]
"""Throughput table: header and cell of each column."""


MODEL_THROUGHPUT_COLUMNS: list[Column] = [
    ("preset (dense params)", lambda row: f"{row['model']} ({row['dense_params']:,})"),
    ("straggler", lambda row: "trainer 1 3x slow" if row["straggler"] else "none"),
    ("algorithm", lambda row: row["variant"]),
    ("samples/s (min-max)", lambda row: spread_cell(row["samples_per_s"], ",.0f")),
    ("ratio to none", lambda row: spread_cell(row["ratio_to_none"], ".3f")),
    ("ratio to ddp", lambda row: spread_cell(row["ratio_to_ddp"], ".3f")),
    *RESOURCE_COLUMNS,
    EXTRA_OVER_NONE_COLUMN,
    ("reps", lambda row: str(row["reps"])),
]
"""Throughput table of the model presets: header and cell of each column."""


def markdown_report(runs: Sequence[Run], settings: dict[str, Any], plots: Sequence[Path]) -> str:
    """The whole report: settings, the quality and throughput tables, the teacher ceiling, the plots."""
    quality = quality_rows(runs)
    teachers = {row["dataset"]: row["teacher_auc"] for row in quality if row["teacher_auc"] is not None}
    lines = [
        "# Sync algorithms side by side",
        "",
        f"`python benchmarks/bench_matrix.py --preset {settings['preset']}`: {len(runs)} runs, "
        f"{settings['trainers']} trainers x batch {settings['batch_size']} (gba, gba-ps-tables, easgd_ps-ps-tables: "
        f"{settings['trainers']} trainers + 1 parameter-server rank), same hyperparameters for every algorithm.",
        "",
        "## Quality at equal samples seen (no straggler)",
        "",
        markdown_table(QUALITY_COLUMNS, quality),
        "",
        *(f"Planted teacher's held-out AUC ({dataset}): {auc:.4f}, the ceiling." for dataset, auc in teachers.items()),
        "",
        "## Throughput (all trainers), ratio to none within each repetition",
        "",
        markdown_table(THROUGHPUT_COLUMNS, throughput_rows(runs)),
        "",
        "With TorchRec-sharded tables every step's embedding all-to-all is a barrier, so a straggler paces",
        "every algorithm, none included; straggler runs train a third of the steps. The -ps-tables variants",
        "keep the tables on the parameter server: no trainer step is collective, the fast trainer runs ahead.",
    ]
    model_rows = model_throughput_rows(runs)
    if model_rows:
        lines += [
            "", f"## Throughput at the model presets, {settings['model_duration_s']:g} s windows, "
            "ratio to none within each repetition", "", markdown_table(MODEL_THROUGHPUT_COLUMNS, model_rows),
        ]
    if plots:
        lines += ["", "## Plots", "", *(f"![{path.stem}]({path.as_posix()})" for path in plots)]
    return "\n".join(lines)
