"""The benchmark matrix's pure parts (presets, summaries, tables) on constructed runs, and one tiny real cell."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import bench_matrix
from bench_matrix import PRESETS, STRAGGLER, VARIANTS, Cell, estimate_s
from bench_matrix_report import QUALITY_COLUMNS, THROUGHPUT_COLUMNS, markdown_report, quality_rows, throughput_rows


def fake_run(variant: str, seed: int, auc: float, speed: float, straggler: bool = False,
             dataset: str = "synthetic", **result: Any) -> dict[str, Any]:
    """A run as bench_matrix stores it, with only the result fields the summaries read."""
    curve = [{"samples_seen": 1024, "auc": auc - 0.1, "log_loss": 0.7}, {"samples_seen": 2048, "auc": auc, "log_loss": 0.5}]
    return {
        "variant": variant, "dataset": dataset, "straggler": straggler, "seed": seed, "steps": 2,
        "result": {"auc": auc, "log_loss": 1.0 - auc, "samples_per_s_total": speed, "curve": curve,
                   "sync": {}, "gba": {}, **result},
    }


def test_quick_preset_runs_every_algorithm_once_in_shadow_mode_within_ten_minutes() -> None:
    cells = PRESETS["quick"].cells()
    assert {cell.variant for cell in cells} == {
        "none", "ddp", "pma", "ma-shadow", "easgd-shadow", "bmuf-shadow", "gba", "gba-ps-tables", "easgd_ps-ps-tables",
    }
    assert {(cell.dataset, cell.seed) for cell in cells} == {("synthetic", 0)}
    assert len(cells) == 9 * 2  # with and without the straggler
    assert estimate_s(cells) < 8 * 60


def test_full_preset_is_the_whole_matrix_interleaved_by_repetition() -> None:
    cells = PRESETS["full"].cells()
    assert len(cells) == len(VARIANTS) * 2 * (3 + 1) == 96  # 3 seeds even, seed 0 with a straggler too
    assert len(set(cells)) == len(cells)
    # the first block: seed 0, synthetic, no straggler, every variant in a row
    assert [cell.variant for cell in cells[: len(VARIANTS)]] == list(VARIANTS)
    assert {(cell.seed, cell.dataset, cell.straggler) for cell in cells[: len(VARIANTS)]} == {(0, "synthetic", False)}
    assert [cell.seed for cell in cells[:: len(VARIANTS) * 2]] == [0, 0, 1, 2]
    assert {cell.seed for cell in cells if cell.straggler} == {0}
    steps = {(cell.dataset, cell.straggler) for cell in cells}
    assert {(cell.dataset, cell.straggler): cell.steps for cell in cells} == {
        ("synthetic", False): 1000, ("synthetic", True): 333, ("movielens", False): 156, ("movielens", True): 52,
    } and len(steps) == 4
    assert estimate_s(cells) < 50 * 60


def test_quality_preset_trains_the_shadow_algorithms_and_peers_six_times_longer_without_a_straggler() -> None:
    cells = PRESETS["quality"].cells()
    assert [cell.variant for cell in cells[:7]] == ["none", "ddp", "pma", "ma-shadow", "easgd-shadow", "bmuf-shadow", "gba"]
    assert len(cells) == 7 * 3 and {cell.seed for cell in cells} == {0, 1, 2}
    assert {(cell.dataset, cell.straggler, cell.steps) for cell in cells} == {("synthetic", False, 6000)}
    pairs = dict(zip(cells[0].arguments()[2::2], cells[0].arguments()[3::2]))
    assert pairs["--data.synthetic.eval_batches"] == "128"  # held-out noise well below the 0.002 target


def test_model_preset_cells_interleave_variants_per_repetition_and_run_only_the_chosen_straggler_settings() -> None:
    variants = PRESETS["quick"].variants
    both = bench_matrix.model_cells(variants, ["small", "production"], reps=2, duration_s=30.0)
    assert len(both) == 2 * 2 * 2 * len(variants)
    assert [(cell.seed, cell.model, cell.straggler) for cell in both[: len(variants)]] == [(0, "small", False)] * len(variants)
    assert [cell.variant for cell in both[: len(variants)]] == list(variants)
    slow = bench_matrix.model_cells(variants, ["production"], reps=5, duration_s=30.0, stragglers=[True])
    assert {(cell.straggler, cell.model, cell.steps, cell.duration_s) for cell in slow} == {(True, "production", 0, 30.0)}
    assert [cell.seed for cell in slow[:: len(variants)]] == [0, 1, 2, 3, 4]
    assert STRAGGLER[0] in slow[0].arguments() and "--train.duration_s" in slow[0].arguments()


def test_a_cell_names_its_config_seeds_length_curve_and_straggler() -> None:
    cell = Cell("gba", "movielens", True, 2, 52)
    arguments = cell.arguments()
    assert cell.nproc == 3  # 2 trainers + 1 parameter server
    assert arguments[:2] == ["--config", str(bench_matrix.CONFIGS / "gba.yaml")]
    pairs = dict(zip(arguments[2::2], arguments[3::2]))
    assert pairs["--data.source"] == "movielens" and pairs["--data.movielens.seed"] == pairs["--train.seed"] == "2"
    assert pairs["--train.steps"] == "52" and int(pairs["--train.eval_every_samples"]) == 52 * 512 * 2 // 8
    assert arguments[-len(STRAGGLER):] == STRAGGLER
    assert "--data.synthetic.eval_batches" not in arguments  # MovieLens has its own held-out split
    assert Cell("ma-foreground", "synthetic", False, 0, 10).arguments()[2:4] == ["--sync.mode", "foreground"]


def test_quality_is_mean_and_std_over_seeds_and_the_auc_difference_to_ddp_per_seed() -> None:
    runs = [
        fake_run("ddp", 0, 0.80, 1.0), fake_run("ddp", 1, 0.70, 1.0),
        fake_run("ma-shadow", 0, 0.79, 1.0), fake_run("ma-shadow", 1, 0.71, 1.0),
        fake_run("ma-shadow", 0, 0.10, 1.0, straggler=True),  # straggler cells are not quality cells
    ]
    rows = {row["variant"]: row for row in quality_rows(runs)}
    ma = rows["ma-shadow"]
    assert ma["auc"] == pytest.approx((0.75, 0.0565685), rel=1e-5)
    assert ma["auc_minus_ddp"] == pytest.approx((0.0, 0.0141421), abs=1e-6)  # -0.01 and +0.01
    assert ma["seeds"] == 2 and ma["samples_seen"] == 2048 and ma["teacher_auc"] is None
    assert rows["ddp"]["auc_minus_ddp"] == (0.0, 0.0)


def test_throughput_ratio_to_none_is_the_median_of_per_repetition_ratios() -> None:
    histogram = {"0": 1, "1": 8, "4+": 1}
    runs = [
        fake_run("none", 0, 0.7, 100.0), fake_run("none", 1, 0.7, 200.0), fake_run("none", 2, 0.7, 400.0),
        *(fake_run("gba", seed, 0.7, speed, sync={"sync_gap_steps_mean": 1.0 + seed},
                   gba={"dense_shards": [{"staleness_histogram": histogram}]})
          for seed, speed in ((0, 90.0), (1, 100.0), (2, 380.0))),
    ]
    rows = {row["variant"]: row for row in throughput_rows(runs)}
    gba = rows["gba"]
    assert gba["ratio_to_none_median"] == pytest.approx(0.9)  # ratios 0.9, 0.5, 0.95; not 100/200
    assert gba["samples_per_s_median"] == 100.0 and (gba["samples_per_s_min"], gba["samples_per_s_max"]) == (90.0, 380.0)
    assert gba["sync_gap_median"] == 2.0
    assert (gba["staleness_mean"], gba["staleness_p90"], gba["staleness_top"]) == (pytest.approx(1.2), 1, 4)
    assert rows["none"]["ratio_to_none_median"] == 1.0 and rows["none"]["sync_gap_median"] is None


def test_model_preset_rows_take_ratios_to_none_and_to_ddp_per_repetition() -> None:
    from bench_matrix_report import model_throughput_rows
    resources = {"cpu_s_per_sample": 1e-4, "trainer_peak_rss_mib_max": 600.0, "server_peak_rss_mib_max": None,
                 "trainer_extra_x_dense_max": 3.0}
    speeds = {"none": (100.0, 200.0, 400.0), "ddp": (50.0, 200.0, 100.0), "ma-shadow": (90.0, 100.0, 380.0)}
    runs = [{**fake_run(variant, seed, 0.7, speed, True, resources=resources, dense_params=10), "model": "production"}
            for seed in range(3) for variant, by_seed in speeds.items() for speed in [by_seed[seed]]]
    rows = {row["variant"]: row for row in model_throughput_rows(runs)}
    assert set(rows) == set(speeds) and all(row["straggler"] and row["reps"] == 3 for row in rows.values())
    ma = rows["ma-shadow"]
    assert ma["ratio_to_none"] == pytest.approx((0.9, 0.5, 0.95))  # median, min, max of 0.9, 0.5, 0.95
    assert ma["ratio_to_ddp"] == pytest.approx((1.8, 0.5, 3.8))  # 1.8, 0.5, 3.8
    assert rows["ddp"]["ratio_to_ddp"] == (1.0, 1.0, 1.0)


def test_report_has_one_row_per_dataset_and_variant_and_per_straggler_setting() -> None:
    runs = [
        fake_run(variant, seed, 0.7, 100.0, straggler, dataset)
        for dataset in ("synthetic", "movielens") for straggler in (False, True)
        for seed in (0, 1) for variant in ("none", "ddp", "bmuf-shadow")
    ]
    report = markdown_report(runs, {"preset": "full", "trainers": 2, "batch_size": 512}, [Path("plots/throughput.png")])
    table_rows = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith(("| dataset", "| ---"))]
    assert len(table_rows) == 2 * 3 + 2 * 2 * 3
    assert "| synthetic | bmuf-shadow | 2,048 | 0.7000 ± 0.0000 |" in report
    assert "| movielens | trainer 1 3x slow | ddp | 100 | 100-100 | 1.000 | - | - | 2 |" in report
    assert "![throughput](plots/throughput.png)" in report
    assert report.count("| --- |") == 2 and len(QUALITY_COLUMNS) == 7 and len(THROUGHPUT_COLUMNS) == 9


def test_plots_are_written_for_every_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from bench_plots import write_matrix_plots

    histogram = {"0": 3, "1": 5}
    runs = [fake_run("none", 0, 0.7, 100.0), fake_run("gba", 0, 0.7, 90.0, sync={"sync_gap_steps_mean": 1.0},
                                                      gba={"dense_shards": [{"staleness_histogram": histogram}]})]
    plots = write_matrix_plots(runs, tmp_path)
    assert [path.name for path in plots] == ["throughput.png", "auc_vs_samples.png", "sync_gap.png", "gba_staleness.png"]
    assert all(path.stat().st_size > 1000 for path in plots)


@pytest.mark.timeout(180)
def test_one_real_cell_runs_under_torchrun_and_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shadow EASGD cell: the one run of the shipped easgd.yaml under torchrun in the suite."""
    output = tmp_path / "matrix.json"
    cell = Cell("easgd-shadow", "synthetic", False, 0, 40)
    settings = {"preset": "test", "trainers": 2, "batch_size": 512}
    bench_matrix.run_matrix([cell], output, settings)
    (run,) = json.loads(output.read_text())["runs"]
    assert run["variant"] == "easgd-shadow" and run["result"]["steps"] == 40
    assert run["result"]["curve"][-1]["samples_seen"] == 40 * 512 * 2
    (row,) = quality_rows([run])
    assert row["auc"][0] == run["result"]["auc"] and row["auc_minus_ddp"] is None
    # resuming keeps the finished cell and runs nothing again
    monkeypatch.setattr(bench_matrix, "run_cell", lambda *_: pytest.fail("a finished cell ran again"))
    assert bench_matrix.run_matrix([cell], output, settings, done=[run]) == [run]
    assert json.loads(output.read_text())["runs"] == [run]


def test_scaling_ratios_are_taken_per_size_and_repetition() -> None:
    from bench_scaling import COLUMNS, summarize

    runs = [
        {"variant": variant, "rep": rep, "trainers": trainers, "samples_per_s_total": speed}
        for trainers, rep, variant, speed in (
            (1, 0, "none", 100.0), (1, 0, "ddp", 90.0), (4, 0, "none", 80.0), (4, 0, "ddp", 40.0),
            (4, 1, "none", 60.0), (4, 1, "ddp", 60.0),
        )
    ]
    rows = {(row["trainers"], row["variant"]): row for row in summarize(runs)}
    assert rows[(1, "ddp")]["ratio_to_none_median"] == pytest.approx(0.9)
    assert rows[(4, "ddp")]["ratio_to_none_median"] == pytest.approx(0.75)  # median of 0.5 and 1.0
    assert rows[(4, "ddp")]["samples_per_s_per_trainer"] == pytest.approx(50.0 / 4)
    assert len(COLUMNS) == 6
