"""Every sync algorithm against DDP, torch's periodic model averaging and no-sync: one command, one matrix.

    python benchmarks/bench_matrix.py --preset quick    # synthetic, 1 seed, shadow modes: < 10 min on 2 cores
    python benchmarks/bench_matrix.py --preset full     # the whole matrix, 3 seeds
    python benchmarks/bench_matrix.py --preset quality  # shadow algorithms vs ddp near convergence, 3 seeds
    python benchmarks/bench_matrix.py --report-only     # re-render tables and plots from the JSON
    python benchmarks/bench_matrix.py --preset quick --model-presets small,production [--model-reps 5] \
        [--model-duration-s 30] [--model-stragglers even,straggler]  # plus throughput cells at the model presets

The matrix: algorithm (none, ddp, pma, ma, easgd, bmuf, gba) x mode (shadow / foreground, for ma,
easgd and bmuf) x straggler (none / trainer 1 three times slower) x dataset (synthetic, MovieLens-100K)
x seed. Every cell is one `torchrun` job of `benchmarks/train_dlrm.py` on 2 trainers; gba runs
`examples/configs/gba.yaml` with 2 trainers and 1 parameter-server rank (3 processes, so on 2 cores
its server competes with the trainers for CPU); gba-ps-tables and easgd_ps-ps-tables also put the
tables on that server (`gba_ps_embeddings.yaml`, `easgd_ps.yaml`), so no trainer step is collective.
Cells run interleaved: for each seed, each dataset and each straggler setting, every algorithm runs
once in a row, so a throughput ratio to `none` is taken within one such group (the same repetition)
and slow drifts of the machine cancel out.

Equal samples seen: every cell of a dataset trains the same number of steps per trainer with the
same hyperparameters (the ExperimentConfig defaults, nothing tuned per algorithm), and records
held-out AUC and log loss every 1/8 of the run (`train.eval_every_samples`; evaluation time is left
out of the throughput window), the last point being the final evaluation. Run lengths:
- synthetic: 1000 steps of 2 x 512 samples (1M samples). Not converged: a mid-training
  comparison, the length that keeps the full matrix within an hour on 2 cores;
- MovieLens-100K: 156 steps of 2 x 512, two epochs of its 80K training ratings. Held-out AUC
  plateaus between one and two epochs and falls after that as the id embeddings overfit, so longer
  runs would compare algorithms on an overfitting model.
Both lengths were chosen from measured curves (docs/benchmarks.md, "The development machines").
With a straggler every TorchRec job runs at the slow trainer's pace (each step's embedding all-to-all
is a barrier), so straggler cells train a third of the steps, about the same timed window:
they measure throughput, and their AUC compares only among themselves. The quality table uses the
even cells.
The seed sets `train.seed` (model initialization) and the data seed (synthetic: teacher and streams;
MovieLens: epoch shuffles); differences to ddp are taken per seed, so task-to-task variation cancels.

Throughput at the model presets (`--model-presets`, off by default: `example_job.MODEL_PRESETS`,
small and production, whose steps take up to 50 times the default model's): after the matrix's own
cells, `--model-reps` repetitions of, for each preset, both straggler settings of the synthetic
data with every variant in a row, each a timed window of `--model-duration-s` after warm-up and no
held-out curve (they measure throughput and resources, not quality); their table has its own rows
with the ratio to `none` per repetition and the resources (CPU ms per sample, peak memory).
`--model-stragglers straggler` runs only the straggler cells (bench_sync measures the even setting
at both presets with the same harness).

Writes the runs as JSON after every cell (an interrupted benchmark keeps what it measured), then a
Markdown report (`bench_matrix_report`) and PNG plots (`bench_plots`, needs matplotlib:
`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from bench_matrix_report import markdown_report, matrix_runs
from bench_summary import plotting
from example_job import CONFIGS, ROOT, SYNTHETIC_HELDOUT, WARMUP_STEPS, parse_presets, preset_arguments, run_example

TRAINERS = 2
"""Trainer ranks of every cell (variants with servers add one server rank)."""
BATCH_SIZE = 512
"""Samples per batch and trainer, set explicitly for every source."""
STRAGGLER_FACTOR = 3
STRAGGLER = ["--straggler.trainers", "[1]", "--straggler.factor", str(STRAGGLER_FACTOR)]
"""The straggler setting: trainer 1's steps take three times as long (measured, not simulated)."""
CURVE_POINTS = 8
"""Held-out evaluations per run, the final one included."""
WARMUP_SHARE = 0.1
"""Share of a run's steps before its throughput window opens."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of syncing the dense parameters: a config of examples/configs, maybe a mode, its servers."""

    name: str
    config: str
    mode: str | None = None
    servers: int = 0

    def arguments(self) -> list[str]:
        """The train_dlrm.py arguments that select this variant."""
        return ["--config", str(CONFIGS / self.config), *(["--sync.mode", self.mode] if self.mode else [])]


SHADOW_ALGOS = ("ma", "easgd", "bmuf")
VARIANTS: dict[str, Variant] = {
    variant.name: variant
    for variant in (
        Variant("none", "none.yaml"),
        Variant("ddp", "ddp.yaml"),
        Variant("pma", "pma.yaml"),
        *(Variant(f"{algo}-{mode}", f"{algo}.yaml", mode) for algo in SHADOW_ALGOS for mode in ("shadow", "foreground")),
        Variant("gba", "gba.yaml", servers=1),
        Variant("gba-ps-tables", "gba_ps_embeddings.yaml", servers=1),
        Variant("easgd_ps-ps-tables", "easgd_ps.yaml", servers=1),
    )
}
"""Every benchmarked variant, in table order. The `-ps-tables` ones keep the tables on the parameter
server instead of sharding them with TorchRec: a trainer step has no collective, so they are the
ones a straggler cannot pace (GBA, and ShadowSync's production S-EASGD setup)."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the matrix."""

    variant: str
    dataset: str
    straggler: bool
    seed: int
    steps: int
    """Training steps per trainer: the dataset's run length in the preset, a third of it with a straggler
    (0 for a throughput cell at a model preset, which trains for `duration_s`)."""
    model: str | None = None
    """A model preset (examples/configs/presets/) for a throughput cell; None: the example's default
    model, a cell of the matrix itself."""
    duration_s: float = 0.0
    """A throughput cell's timed window after warm-up."""

    @property
    def label(self) -> str:
        """Names the cell in progress lines and error messages."""
        model = f" {self.model}" if self.model else ""
        return f"{self.dataset}{model} {'straggler' if self.straggler else 'even'} seed {self.seed} {self.variant}"

    @property
    def nproc(self) -> int:
        """Processes of the torchrun job: the trainers and the variant's servers."""
        return TRAINERS + VARIANTS[self.variant].servers

    def arguments(self) -> list[str]:
        """Every train_dlrm.py argument of this cell."""
        samples = self.steps * BATCH_SIZE * TRAINERS
        length = [
            *preset_arguments(self.model), "--train.duration_s", str(self.duration_s),
            "--train.warmup_steps", str(WARMUP_STEPS),
        ] if self.model else [
            "--train.steps", str(self.steps),
            "--train.warmup_steps", str(max(1, int(WARMUP_SHARE * self.steps))),
            "--train.eval_every_samples", str(samples // CURVE_POINTS),
        ]
        return [
            *VARIANTS[self.variant].arguments(),
            "--data.source", self.dataset,
            f"--data.{self.dataset}.seed", str(self.seed),
            f"--data.{self.dataset}.batch_size", str(BATCH_SIZE),
            "--train.seed", str(self.seed),
            *length,
            *(SYNTHETIC_HELDOUT if self.dataset == "synthetic" else []),
            *(STRAGGLER if self.straggler else []),
        ]


def cell_of(run: dict[str, Any]) -> Cell:
    """The cell a saved run was made for (a run holds the cell's fields next to its results)."""
    return Cell(**{field.name: run[field.name] for field in dataclasses.fields(Cell) if field.name in run})


@dataclasses.dataclass(frozen=True)
class Preset:
    """Which part of the matrix runs, and how long."""

    variants: tuple[str, ...]
    steps: dict[str, int]
    """Dataset -> training steps per trainer; the datasets that run."""
    seeds: tuple[int, ...]
    straggler_seeds: tuple[int, ...]
    """Seeds that also run with a straggler: those cells measure throughput (the quality table uses
    the even cells), so fewer seeds suffice there."""

    def cells(self) -> list[Cell]:
        """The runs in their interleaved order: seed, dataset, straggler, then every variant in a row."""
        return [
            Cell(variant, dataset, straggler, seed, steps // STRAGGLER_FACTOR if straggler else steps)
            for seed in self.seeds
            for dataset, steps in self.steps.items()
            for straggler in ((False, True) if seed in self.straggler_seeds else (False,))
            for variant in self.variants
        ]


PRESETS: dict[str, Preset] = {
    "quick": Preset(
        variants=tuple(name for name in VARIANTS if not name.endswith("-foreground")),
        steps={"synthetic": 400},
        seeds=(0,),
        straggler_seeds=(0,),
    ),
    "full": Preset(
        variants=tuple(VARIANTS), steps={"synthetic": 1000, "movielens": 156}, seeds=(0, 1, 2), straggler_seeds=(0,),
    ),
    "quality": Preset(
        variants=("none", "ddp", "pma", *(f"{algo}-shadow" for algo in SHADOW_ALGOS), "gba"),
        steps={"synthetic": 6000},
        seeds=(0, 1, 2),
        straggler_seeds=(),
    ),
}
"""quick: every algorithm once (shadow mode), short synthetic runs; full: the whole matrix, 3 seeds for
quality, the straggler cells (paced by the slow trainer: 3 times as long per step) on seed 0 only,
which keeps it within an hour on 2 cores; quality: the shadow algorithms and their peers trained 6x
as long on synthetic data (6.1M samples, where ddp's held-out AUC flattens out near the teacher's),
3 seeds, no straggler: at 1M samples the runs are mid-curve, where an algorithm's AUC minus ddp's is
reproducible on one seed but changes sign from seed to seed, since which algorithm is ahead
mid-curve depends on the task (docs/benchmarks.md, "The development machines")."""

STARTUP_S = 12.0
"""Measured cost of one cell besides its steps: torchrun, imports, model build, evaluations."""
STEP_S = {"synthetic": 0.010, "movielens": 0.012}
"""Measured seconds per training step of 2 trainers on 2 cores, per dataset."""


MODEL_WARMUP_S = 60.0
"""Upper bound of a model preset's warm-up (`WARMUP_STEPS`) on 2 cores, the production preset's."""


STRAGGLER_SETTINGS = {"even": False, "straggler": True}
"""`--model-stragglers` names: which straggler settings the model presets' cells run."""


def model_cells(
    variants: Sequence[str], models: Sequence[str], reps: int, duration_s: float,
    stragglers: Sequence[bool] = (False, True),
) -> list[Cell]:
    """The throughput cells at the model presets, interleaved: for each repetition, each preset and
    each straggler setting of `stragglers`, every variant in a row (synthetic data; the repetition is
    the seed)."""
    return [
        Cell(variant, "synthetic", straggler, rep, 0, model, duration_s)
        for rep in range(reps) for model in models for straggler in stragglers for variant in variants
    ]


def estimate_s(cells: Sequence[Cell]) -> float:
    """Expected wall time of `cells` on 2 quiet cores (a straggler run is paced by its slow trainer)."""
    return sum(
        STARTUP_S + (cell.duration_s + MODEL_WARMUP_S if cell.model else
                     cell.steps * STEP_S[cell.dataset] * (STRAGGLER_FACTOR if cell.straggler else 1))
        for cell in cells
    )


def run_cell(cell: Cell, scratch: Path) -> dict[str, Any]:
    """Run one cell; its results, which must hold the held-out curve unless the cell measures throughput
    at a model preset."""
    result = run_example(cell.label, cell.nproc, cell.arguments(), scratch / "result.json", attempts=2)
    if not cell.model and not result.get("curve"):
        raise SystemExit(f"{cell.label}: the results have no held-out curve (train.eval_every_samples)")
    return result


def write_json(path: Path, settings: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """The settings and every run so far."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, "runs": runs}, indent=2) + "\n")


def run_matrix(
    cells: Sequence[Cell], output: Path, settings: dict[str, Any], done: Sequence[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """Run every cell in order, saving the JSON after each; each run is the cell's fields and its
    results. Cells of `done` (runs of an interrupted invocation) are kept and not run again."""
    wanted = set(cells)
    runs = [run for run in done if cell_of(run) in wanted]
    finished = {cell_of(run) for run in runs}
    write_json(output, settings, runs)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for index, cell in enumerate(cells):
            if cell in finished:
                continue
            result = run_cell(cell, Path(scratch))
            runs.append({**dataclasses.asdict(cell), "result": result})
            write_json(output, settings, runs)
            elapsed = time.perf_counter() - start
            print(f"[{index + 1}/{len(cells)} {elapsed / 60:.1f} min] {cell.label}: "
                  f"{result['samples_per_s_total']:,.0f} samples/s, AUC {result['auc']:.4f}", flush=True)
    return runs


def write_report(output: Path, report_path: Path, plots_dir: Path) -> None:
    """Markdown tables and PNG plots from the JSON at `output`."""
    saved = json.loads(output.read_text())
    plots_module = plotting()
    plots = plots_module.write_matrix_plots(matrix_runs(saved["runs"]), plots_dir) if plots_module else []
    links = [Path(os.path.relpath(path, report_path.parent)) for path in plots]
    report = markdown_report(saved["runs"], saved["settings"], links)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(report + "\n")
    print(report)
    print(f"wrote {output}, {report_path} and {len(plots)} plots in {plots_dir}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick", help="which part of the matrix")
    parser.add_argument("--output", type=Path, help="JSON results (default runs/bench_matrix_<preset>.json)")
    parser.add_argument("--report", type=Path, help="Markdown report (default: --output with .md)")
    parser.add_argument("--plots", type=Path, help="folder for the PNG plots (default runs/plots_<preset>)")
    parser.add_argument("--report-only", action="store_true", help="only re-render the report from --output")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in --output, run the rest")
    parser.add_argument("--model-presets", default="",
                        help="comma-separated model presets (small, production) to add throughput cells at")
    parser.add_argument("--model-reps", type=int, default=5, help="repetitions of the model presets' cells")
    parser.add_argument("--model-duration-s", type=float, default=30.0, help="timed window of a model preset's cell")
    parser.add_argument("--model-stragglers", default="even,straggler",
                        help="comma-separated straggler settings of the model presets' cells: even, straggler "
                             "(bench_sync measures the even ones at both presets too)")
    args = parser.parse_args(argv)
    args.output = args.output or ROOT / "runs" / f"bench_matrix_{args.preset}.json"
    args.plots = args.plots or ROOT / "runs" / f"plots_{args.preset}"
    report = args.report or args.output.with_suffix(".md")
    if not args.report_only:
        preset = PRESETS[args.preset]
        models = parse_presets(args.model_presets) if args.model_presets else []
        names = args.model_stragglers.split(",")
        if sorted(set(names) - set(STRAGGLER_SETTINGS)) or not names:
            parser.error(f"--model-stragglers must name only {list(STRAGGLER_SETTINGS)}; got {names}")
        stragglers = [STRAGGLER_SETTINGS[name] for name in names]
        cells = [*preset.cells(),
                 *model_cells(preset.variants, models, args.model_reps, args.model_duration_s, stragglers)]
        print(f"preset {args.preset}: {len(cells)} runs, about {estimate_s(cells) / 60:.0f} min on 2 quiet cores "
              f"(variants with servers: {TRAINERS} trainers + 1 parameter-server rank)", flush=True)
        settings = {"preset": args.preset, **dataclasses.asdict(preset), "trainers": TRAINERS,
                    "batch_size": BATCH_SIZE, "straggler": STRAGGLER, "curve_points": CURVE_POINTS,
                    "model_presets": models, "model_reps": args.model_reps, "model_duration_s": args.model_duration_s,
                    "model_stragglers": names}
        done = json.loads(args.output.read_text())["runs"] if args.resume and args.output.exists() else []
        run_matrix(cells, args.output, settings, done)
    write_report(args.output, report, args.plots)


if __name__ == "__main__":
    main()
