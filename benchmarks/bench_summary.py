"""Summary maths and Markdown rendering shared by the benchmarks.

Every benchmark here compares runs that were interleaved in one invocation, so that slow drifts of
the machine cancel out: a run's throughput is divided by its baseline's from the same repetition
(`ratios_to`), and only then summarized. Tables are lists of columns, each a header and a function
that renders one summary row's cell (`markdown_table`). A figure over repetitions is shown as its
median with the min-max beside it (`Spread`, `spread_cell`); every run's resources (CPU seconds per
sample of all ranks, peak memory per trainer and server, a trainer's extra memory as a multiple of
the dense size) are summarized and rendered alike by every benchmark (`resource_spreads`,
`RESOURCE_COLUMNS`).
"""

from __future__ import annotations

import statistics
from types import ModuleType
from typing import Any, Callable, Hashable, Iterable, Sequence

Run = dict[str, Any]
Column = tuple[str, Callable[[dict[str, Any]], str]]
"""A table column: its header and how a summary row fills the cell."""
Spread = tuple[float, float, float]
"""Median, min and max of a figure over repetitions."""


def markdown_table(columns: Sequence[Column], rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table, first column left-aligned, the others right-aligned (numbers)."""
    lines = [
        "| " + " | ".join(header for header, _ in columns) + " |",
        "| --- |" + " ---: |" * (len(columns) - 1),
    ]
    lines += ["| " + " | ".join(cell(row) for _, cell in columns) + " |" for row in rows]
    return "\n".join(lines)


def distinct(values: Iterable[Hashable]) -> list[Any]:
    """The values in order of first appearance, each once (the matrix's own order)."""
    return list(dict.fromkeys(values))


def select(runs: Sequence[Run], **fields: Any) -> list[Run]:
    """The runs whose cell fields equal `fields`."""
    return [run for run in runs if all(run[key] == value for key, value in fields.items())]


def paired(runs: Sequence[Run], baselines: Sequence[Run], key: Callable[[Run], Hashable]) -> list[tuple[Run, Run]]:
    """Each run with its baseline, the one with the same `key` (e.g. the repetition); runs without one
    are left out."""
    reference = {key(baseline): baseline for baseline in baselines}
    return [(run, reference[key(run)]) for run in runs if key(run) in reference]


def ratios_to(
    runs: Sequence[Run],
    baselines: Sequence[Run],
    key: Callable[[Run], Hashable],
    value: Callable[[Run], float],
) -> list[float]:
    """`value(run) / value(baseline)` for each run whose baseline (same `key`, e.g. the repetition)
    exists and is non-zero; runs without one are left out."""
    return [value(run) / value(baseline) for run, baseline in paired(runs, baselines, key) if value(baseline)]


def curve_at(run: Run, every: int) -> dict[int, float]:
    """A run's held-out AUC curve (`train.eval_every_samples` = `every`) by evaluation point: the
    samples seen there rounded to the nearest multiple of `every` (a point lands a batch or so past
    it; the last is the final evaluation), so that runs of one invocation line up."""
    return {every * round(point["samples_seen"] / every): point["auc"] for point in run["result"]["curve"]}


def median_or_none(values: Sequence[float]) -> float | None:
    """The median, or None for no values (a column that does not apply to a row)."""
    return statistics.median(values) if values else None


def spread(values: Sequence[float | None]) -> Spread | None:
    """Median, min and max of the values that apply (None where none does)."""
    present = [value for value in values if value is not None]
    return (statistics.median(present), min(present), max(present)) if present else None


def spread_cell(figure: Spread | None, spec: str) -> str:
    """`median (min-max)`, or `-` where the figure does not apply."""
    if figure is None:
        return "-"
    median, low, high = (format(value, spec) for value in figure)
    return f"{median} ({low}-{high})"


def difference_spread(
    runs: Sequence[Run], baselines: Sequence[Run], key: Callable[[Run], Hashable], value: Callable[[Run], float]
) -> Spread | None:
    """`spread` of `value(run) - value(baseline)` over the runs paired with their baseline by `key`."""
    return spread([value(run) - value(baseline) for run, baseline in paired(runs, baselines, key)])


def ratio_spread(
    runs: Sequence[Run], baselines: Sequence[Run], key: Callable[[Run], Hashable], value: Callable[[Run], float]
) -> Spread | None:
    """`spread` of the per-repetition ratios `ratios_to` takes (None without a baseline)."""
    return spread(ratios_to(runs, baselines, key, value))


RESOURCE_FIGURES: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "cpu_ms_per_sample": lambda resources: (
        None if resources["cpu_s_per_sample"] is None else 1e3 * resources["cpu_s_per_sample"]),
    "trainer_peak_rss_mib": lambda resources: resources["trainer_peak_rss_mib_max"],
    "server_peak_rss_mib": lambda resources: resources["server_peak_rss_mib_max"],
    "extra_x_dense": lambda resources: resources["trainer_extra_x_dense_max"],
}
"""The resource figures of one run, from the harness's `resources` (benchmarks/dlrm/job.py): CPU
milliseconds of all ranks per sample trained in the timed window, the largest trainer's and
server's peak resident memory, the largest trainer's peak above its memory before the sync runtime
was built, as a multiple of the dense parameters' size."""


def extra_x_dense(result: dict[str, Any]) -> float:
    """A run's largest trainer peak memory above its memory before the sync runtime, in dense sizes."""
    return RESOURCE_FIGURES["extra_x_dense"](result["resources"])


def resource_spreads(results: Sequence[dict[str, Any]]) -> dict[str, Spread | None]:
    """Every `RESOURCE_FIGURES` figure over the runs whose harness results are `results`."""
    return {
        name: spread([figure(result["resources"]) for result in results]) for name, figure in RESOURCE_FIGURES.items()
    }


PRESET_COLUMN: Column = ("preset (dense params)", lambda row: f"{row['preset']} ({row['dense_params']:,})")
"""The model preset of a summary row, with its dense size."""

RESOURCE_COLUMNS: list[Column] = [
    ("CPU ms/sample", lambda row: spread_cell(row["cpu_ms_per_sample"], ".3f")),
    ("peak RSS MiB per trainer", lambda row: spread_cell(row["trainer_peak_rss_mib"], ",.0f")),
    ("per server", lambda row: spread_cell(row["server_peak_rss_mib"], ",.0f")),
    ("extra per trainer (x dense)", lambda row: spread_cell(row["extra_x_dense"], ".1f")),
]
"""The resource columns every benchmark table ends with (a row holds `resource_spreads`)."""

EXTRA_OVER_NONE_COLUMN: Column = (
    "extra over none (x dense)", lambda row: spread_cell(row["extra_x_dense_over_none"], ".1f"))
"""Where a table has a `none` baseline: a trainer's extra memory minus none's in the same repetition,
what the sync itself holds beyond local training (optimizer state and activations cancel)."""


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def merged_histogram(histograms: Iterable[dict[str, int]]) -> dict[str, int]:
    """Staleness histograms (of several shards or runs) added up bucket by bucket."""
    total: dict[str, int] = {}
    for histogram in histograms:
        for key, count in histogram.items():
            total[key] = total.get(key, 0) + count
    return total


def staleness_summary(histogram: dict[str, int]) -> dict[str, float]:
    """Mean (the open top bucket counted at its bound), 90th percentile and top bucket of a GBA
    staleness histogram (keys are staleness values, the last one `N+`)."""
    buckets = sorted((int(key.rstrip("+")), count) for key, count in histogram.items())
    total = sum(count for _, count in buckets)
    if not total:
        return {"staleness_mean": 0.0, "staleness_p90": 0, "staleness_top": 0}
    seen, p90 = 0, buckets[-1][0]
    for staleness, count in buckets:
        seen += count
        if seen >= 0.9 * total:
            p90 = staleness
            break
    mean = sum(staleness * count for staleness, count in buckets) / total
    return {"staleness_mean": mean, "staleness_p90": p90, "staleness_top": buckets[-1][0]}


def optional(value: float | None, spec: str) -> str:
    """A table cell for a number that may not apply: `-` for None."""
    return "-" if value is None else format(value, spec)


def plotting() -> ModuleType | None:
    """The `bench_plots` module, or None with a note where matplotlib (the `bench` extra) is missing:
    the JSON and the tables need no plots."""
    try:
        import bench_plots
    except ModuleNotFoundError as error:
        if error.name != "matplotlib":
            raise
        print("matplotlib is missing (pip install -e '.[bench]'): no plots written")
        return None
    return bench_plots
