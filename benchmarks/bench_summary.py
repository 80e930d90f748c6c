"""Summary maths and Markdown rendering shared by the benchmarks.

Every benchmark here compares runs that were interleaved in one invocation, so that slow drifts of
the machine cancel out: a run's throughput is divided by its baseline's from the same repetition
(`ratios_to`), and only then summarized. Tables are lists of columns, each a header and a function
that renders one summary row's cell (`markdown_table`).
"""

from __future__ import annotations

import statistics
from types import ModuleType
from typing import Any, Callable, Hashable, Iterable, Sequence

Run = dict[str, Any]
Column = tuple[str, Callable[[dict[str, Any]], str]]
"""A table column: its header and how a summary row fills the cell."""


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


def median_or_none(values: Sequence[float]) -> float | None:
    """The median, or None for no values (a column that does not apply to a row)."""
    return statistics.median(values) if values else None


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


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
