"""PNG plots of the benchmark matrix and the scaling curve (matplotlib, the `bench` extra).

Imported only when plots are written (`bench_summary.plotting()`), so the tables, the JSON and the
test suite need no matplotlib. Every figure has one panel per dataset; numbers come from the same
summaries as the Markdown tables (`bench_matrix_report`), so plots and tables cannot disagree.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from bench_matrix_report import merged_staleness, throughput_rows  # noqa: E402
from bench_summary import Run, curve_at, distinct, select  # noqa: E402

STRAGGLER_LABELS = {False: "no straggler", True: "trainer 1 3x slow"}


def panels(count: int, title: str) -> tuple[Figure, list[Axes]]:
    """A figure of `count` panels side by side."""
    figure, axes = plt.subplots(1, count, figsize=(7 * count, 4.5), squeeze=False)
    figure.suptitle(title)
    for panel in axes[0]:  # 20 distinct colours: the default 10 repeat within one panel of 12 variants
        panel.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    return figure, list(axes[0])


def save(figure: Figure, path: Path) -> Path:
    """Write `figure` to `path` and release it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def grouped_bars(axes: Axes, labels: Sequence[str], series: dict[str, list[float]], ylabel: str,
                 ranges: dict[str, list[tuple[float, float]]] | None = None) -> None:
    """One group of bars per label, one bar per series in each group (NaN: no bar); `ranges`: per
    series, each bar's (min, max), drawn as an error bar."""
    width = 0.8 / len(series)
    for index, (name, values) in enumerate(series.items()):
        spans = (ranges or {}).get(name)
        errors = None if spans is None else [[value - low for value, (low, _) in zip(values, spans)],
                                             [high - value for value, (_, high) in zip(values, spans)]]
        axes.bar([position + index * width for position in range(len(labels))], values, width, label=name,
                 yerr=errors, capsize=3)
    axes.set_xticks([position + 0.4 - width / 2 for position in range(len(labels))], labels, rotation=30, ha="right")
    axes.set_ylabel(ylabel)
    axes.legend()


def metric_bars(runs: Sequence[Run], key: str, ylabel: str, title: str, path: Path) -> Path:
    """Bars of a throughput-row metric per variant, with and without the straggler, one panel per dataset."""
    rows = throughput_rows(runs)
    datasets = distinct(row["dataset"] for row in rows)
    figure, axes = panels(len(datasets), title)
    for panel, dataset in zip(axes, datasets):
        mine = select(rows, dataset=dataset)
        variants = distinct(row["variant"] for row in mine)
        series = {}
        for straggler in distinct(row["straggler"] for row in mine):
            values = {row["variant"]: row[key] for row in select(mine, straggler=straggler)}
            series[STRAGGLER_LABELS[straggler]] = [
                float("nan") if values.get(variant) is None else values[variant] for variant in variants
            ]
        grouped_bars(panel, variants, series, ylabel)
        panel.set_title(dataset)
    return save(figure, path)


def auc_curves(runs: Sequence[Run], path: Path) -> Path:
    """Held-out AUC vs samples seen, mean over seeds, one line per variant (runs without a straggler)."""
    even = select(runs, straggler=False)
    datasets = distinct(run["dataset"] for run in even)
    figure, axes = panels(len(datasets), "Held-out AUC vs samples seen (mean over seeds, no straggler)")
    for panel, dataset in zip(axes, datasets):
        mine = select(even, dataset=dataset)
        for variant in distinct(run["variant"] for run in mine):
            by_samples: dict[int, list[float]] = {}
            for run in select(mine, variant=variant):
                for point in run["result"]["curve"]:
                    by_samples.setdefault(point["samples_seen"], []).append(point["auc"])
            samples = sorted(by_samples)
            panel.plot(samples, [statistics.mean(by_samples[seen]) for seen in samples], marker=".", label=variant)
        panel.set_title(dataset)
        panel.set_xlabel("samples seen (all trainers)")
        panel.set_ylabel("held-out AUC")
        panel.legend(fontsize="small")
    return save(figure, path)


def staleness_histograms(runs: Sequence[Run], path: Path) -> Path | None:
    """GBA's gradient staleness at the server, added over seeds; None when no run has any."""
    gba = [run for run in runs if merged_staleness([run])]
    if not gba:
        return None
    datasets = distinct(run["dataset"] for run in gba)
    figure, axes = panels(len(datasets), "GBA: staleness of dense gradients at the server (all seeds)")
    for panel, dataset in zip(axes, datasets):
        mine = select(gba, dataset=dataset)
        histograms = {
            STRAGGLER_LABELS[straggler]: merged_staleness(select(mine, straggler=straggler))
            for straggler in distinct(run["straggler"] for run in mine)
        }
        keys = sorted({key for histogram in histograms.values() for key in histogram}, key=lambda key: int(key.rstrip("+")))
        grouped_bars(panel, keys, {name: [histogram.get(key, 0) for key in keys] for name, histogram in histograms.items()},
                     "gradients")
        panel.set_title(dataset)
        panel.set_xlabel("staleness (global steps)")
    return save(figure, path)


def write_matrix_plots(runs: Sequence[Run], folder: Path) -> list[Path]:
    """Every plot of the matrix into `folder`; returns their paths."""
    plots = [
        metric_bars(runs, "samples_per_s_median", "samples/s, all trainers (median over seeds)",
                    "Throughput per algorithm", folder / "throughput.png"),
        auc_curves(runs, folder / "auc_vs_samples.png"),
        metric_bars(runs, "sync_gap_median", "sync gap, steps (median over seeds)",
                    "Sync gap: training steps between two sync results reaching the weights", folder / "sync_gap.png"),
        staleness_histograms(runs, folder / "gba_staleness.png"),
    ]
    return [plot for plot in plots if plot is not None]


def scaling_plot(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Samples/s vs number of trainers, one line per variant (rows of `bench_scaling.summarize`)."""
    figure, (panel,) = panels(1, "Scaling on this machine: samples/s vs trainers")
    for variant in distinct(row["variant"] for row in rows):
        mine = select(rows, variant=variant)
        panel.plot([row["trainers"] for row in mine], [row["samples_per_s_median"] for row in mine],
                   marker="o", label=variant)
    panel.set_xscale("log", base=2)
    panel.set_xlabel("trainers")
    panel.set_ylabel("samples/s, all trainers (median)")
    panel.legend()
    return save(figure, path)


def gba_plot(report: dict[str, Any], path: Path) -> Path:
    """The README's figure, from `benchmarks/bench_gba.py`'s JSON (one preset and shard count, run
    with `--curve-every`): left, each algorithm's samples/s over sync's in the same repetition
    (median, min-max as error bars) beside the ideal ratio; right, its held-out AUC minus sync's of the
    same seed at each evaluation point (`--curve-every`), one thin line per seed and the median bold."""
    rows = [row for row in report["summary"] if row["algo"] != "sync"]
    settings = report["settings"]
    figure, (speed, quality) = panels(2, f"{settings['presets']} preset, {settings['trainers']} trainers and "
                                         f"{settings['shards']} server(s), trainer {settings['slow_trainer']} "
                                         f"{float(settings['factor']):g}x slow")
    algos = [row["algo"] for row in rows]
    colours = plt.get_cmap("tab10").colors
    ratios = [row["samples_per_s_ratio_to_sync"] for row in rows]
    speed.bar(algos, [median for median, _, _ in ratios], color=colours[:len(algos)], capsize=4,
              yerr=[[median - low for median, low, _ in ratios], [high - median for median, _, high in ratios]])
    speed.axhline(1.0, color="grey", linewidth=0.8, label="sync")
    speed.axhline(report["ideal_ratio"], color="grey", linestyle="--", linewidth=0.8,
                  label="ideal: the fast trainers never wait")
    speed.set_title("speed: samples/s over sync's (median, min-max)")
    speed.set_ylabel("x sync's samples/s")
    speed.set_ylim(0, 1.3 * max(high for _, _, high in ratios))  # room for the legend above the bars
    speed.legend(loc="upper left")

    every = int(settings["curve_every"])
    runs = report["runs"]
    for colour, algo in zip(colours, algos):
        gaps: dict[int, list[float]] = {}
        for run in select(runs, algo=algo):
            base = curve_at(select(runs, algo="sync", seed=run["seed"])[0], every)
            mine = {seen: auc - base[seen] for seen, auc in curve_at(run, every).items() if seen in base}
            quality.plot(sorted(mine), [mine[seen] for seen in sorted(mine)], color=colour, alpha=0.3, linewidth=0.8)
            for seen, gap in mine.items():
                gaps.setdefault(seen, []).append(gap)
        samples = sorted(gaps)
        quality.plot(samples, [statistics.median(gaps[seen]) for seen in samples], color=colour, marker="o",
                     linewidth=2, label=f"{algo} (median of {len(select(runs, algo=algo))} seeds)")
    quality.axhline(0.0, color="grey", linewidth=0.8, label="sync")
    quality.axhspan(-0.002, 0.002, color="grey", alpha=0.15, label="within 0.002 of sync")
    quality.set_title("quality: held-out AUC against sync's")
    quality.set_xlabel("samples applied to the dense model")
    quality.set_ylabel("held-out AUC - sync's (same seed)")
    quality.legend(fontsize="small")
    return save(figure, path)


if __name__ == "__main__":  # make readme-figure
    import argparse
    import json

    parser = argparse.ArgumentParser(description="The README's figure from benchmarks/bench_gba.py's JSON")
    parser.add_argument("--bench-gba", type=Path, default=Path("runs/bench_gba_figure.json"))
    parser.add_argument("--output", type=Path, default=Path("docs/images/gba_straggler.png"))
    arguments = parser.parse_args()
    print(gba_plot(json.loads(arguments.bench_gba.read_text()), arguments.output))
