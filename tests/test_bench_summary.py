"""The benchmarks' summary maths on constructed runs (no torchrun): spreads, per-repetition ratios and
differences, dense-shard aggregation, and the harness's resource accounting (CPU in a window, pauses
left out, extra memory)."""

from __future__ import annotations

import time
from typing import Any

import pytest

import bench_gba
import bench_sync
from bench_summary import difference_spread, merged_histogram, ratio_spread, spread, spread_cell
from dlrm.config import preset_overrides
from example_job import parse_variants, variant_arguments
from dlrm.host import cpu_seconds
from dlrm.job import ResourceMeter, StepWallClock, resource_summary
from shadowgba.errors import ConfigError


def test_a_spread_is_median_min_max_of_the_values_that_apply() -> None:
    assert spread([3.0, None, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert spread([None]) is None
    assert spread_cell((2.0, 1.0, 3.5), ".1f") == "2.0 (1.0-3.5)" and spread_cell(None, ".1f") == "-"


def test_ratios_and_differences_are_taken_per_repetition_before_the_spread() -> None:
    runs = [{"rep": rep, "x": x} for rep, x in ((0, 90.0), (1, 100.0), (2, 380.0))]
    bases = [{"rep": rep, "x": x} for rep, x in ((0, 100.0), (1, 200.0), (2, 400.0))]
    assert ratio_spread(runs, bases, lambda run: run["rep"], lambda run: run["x"]) == pytest.approx((0.9, 0.5, 0.95))
    assert difference_spread(runs, bases, lambda run: run["rep"], lambda run: run["x"]) == (-20.0, -100.0, -10.0)
    assert ratio_spread(runs, [], lambda run: run["rep"], lambda run: run["x"]) is None


def test_histograms_add_up_bucket_by_bucket() -> None:
    assert merged_histogram([{"0": 1, "16+": 2}, {"0": 3, "1": 1}]) == {"0": 4, "16+": 2, "1": 1}


def resources(cpu_s_per_sample: float, extra_x_dense: float) -> dict[str, Any]:
    return {"cpu_s_per_sample": cpu_s_per_sample, "trainer_peak_rss_mib_max": 100.0, "server_peak_rss_mib_max": None,
            "trainer_extra_x_dense_max": extra_x_dense}


def test_bench_sync_compares_each_preset_to_its_own_none_and_ddp_per_repetition() -> None:
    runs = [
        {"preset": preset, "mode": mode, "rep": rep, "samples_per_s_total": speed, "auc": 0.7, "sync": {},
         "dense_params": 10 if preset == "small" else 1000, "resources": resources(1e-4 * speed, extra)}
        for preset, mode, rep, speed, extra in (
            ("small", "none", 0, 100.0, 1.0), ("small", "ddp", 0, 50.0, 2.0), ("small", "bmuf-shadow", 0, 80.0, 4.0),
            ("small", "none", 1, 200.0, 1.0), ("small", "ddp", 1, 200.0, 2.0), ("small", "bmuf-shadow", 1, 100.0, 2.0),
            ("production", "none", 0, 10.0, 3.0), ("production", "ddp", 0, 10.0, 3.0),
            ("production", "bmuf-shadow", 0, 9.0, 5.0),
        )
    ]
    rows = {(row["preset"], row["mode"]): row for row in bench_sync.summarize(runs, ["small", "production"],
                                                                             ["none", "ddp", "bmuf-shadow"])}
    small = rows[("small", "bmuf-shadow")]
    assert small["ratio_to_none"] == pytest.approx((0.65, 0.5, 0.8))  # 80/100 and 100/200, not 180/300
    assert small["ratio_to_ddp"] == pytest.approx((1.05, 0.5, 1.6))
    assert small["extra_x_dense_over_none"] == (2.0, 1.0, 3.0)
    assert small["cpu_ms_per_sample"] == pytest.approx((9.0, 8.0, 10.0))  # 1e-4 s x speed, in ms
    production = rows[("production", "bmuf-shadow")]
    assert production["ratio_to_none"] == pytest.approx((0.9, 0.9, 0.9)) and production["dense_params"] == 1000
    assert production["server_peak_rss_mib"] is None
    assert all(cell(row) for row in rows.values() for _, cell in bench_sync.COLUMNS)


def gba_result(speed: float, shards: list[dict[str, Any]], tables: list[dict[str, Any]]) -> dict[str, Any]:
    """The harness's results of one bench_gba run, only the fields run_metrics reads."""
    return {
        "samples_per_s_total": speed, "window_s": 10.0, "steps_in_window_by_trainer": [100, 100, 100, 30],
        "straggler_overrun_fraction_by_trainer": [0.0, 0.1, 0.2, 0.0], "auc": 0.75, "log_loss": 0.5, "trainers": 4,
        "dense_params": 1000, "config": {"data": {"source": "synthetic", "synthetic": {"batch_size": 8}},
                                         "sync": {"gba": {"aggregation": "global_batch"}}},
        "gba": {"dense_shards": shards, "embedding_shards": tables, "global_steps_per_s": 2.0, "mode_switches": 1},
        "sync": {"queue_dropped": 0}, "resources": resources(1e-3, 1.5),
    }


def dense_shard(histogram: dict[str, int], pushes: int, depth: int, dropped: int) -> dict[str, Any]:
    return {"staleness_histogram": histogram, "decayed": 1, "dropped": dropped, "pushes": pushes,
            "queue_depth_max": depth}


def test_a_variant_with_overrides_runs_its_entry_with_them_last_and_bad_names_are_refused() -> None:
    table = {"ma-shadow": ["--config", "ma.yaml"], "none": ["--config", "none.yaml"]}
    variants = parse_variants("none,ma-shadow@sync.rounds_nice=19@sync.max_round_share=0.05", table, "--modes")
    assert variants == ["none", "ma-shadow@sync.rounds_nice=19@sync.max_round_share=0.05"]
    assert variant_arguments(variants[1], table, ["--sync.rounds_nice", "0"]) == [
        "--config", "ma.yaml", "--sync.rounds_nice", "0", "--sync.rounds_nice", "19", "--sync.max_round_share", "0.05"]
    assert variant_arguments("none", table, ["--x", "1"]) == ["--config", "none.yaml", "--x", "1"]
    for wrong in ("pma", "ma-shadow@sync.rounds_nice", ""):
        with pytest.raises(SystemExit, match="--modes must name only"):
            parse_variants(wrong, table, "--modes")


def test_bench_gba_takes_staleness_from_shard_0_pushes_per_shard_and_adds_up_the_tables() -> None:
    shards = [dense_shard({"0": 1, "2": 1}, 40, 2, 3), dense_shard({"9": 5}, 20, 4, 9)]
    tables = [{"staleness_histogram": {"0": 1}, "dropped": 2}, {"staleness_histogram": {"2": 1}, "dropped": 5}]
    metrics = bench_gba.run_metrics(gba_result(1000.0, shards, tables), slow_trainer=3)
    assert metrics["staleness_mean"] == 1.0 and metrics["staleness_top"] == 2  # shard 0's, not shard 1's 9s
    assert metrics["dropped"] == 3 and metrics["pushes_per_shard"] == 30 and metrics["queue_depth"] == 4
    assert metrics["row_staleness_mean"] == 1.0 and metrics["rows_dropped"] == 7
    assert metrics["applied_samples_per_s"] == 2.0 * 8 * 4
    assert metrics["step_ms_fast"] == 100.0 and metrics["step_ms_slow"] == pytest.approx(1e4 / 30)
    assert metrics["overrun_fast"] == pytest.approx(0.1)


def test_bench_gba_ratios_to_sync_are_per_seed_within_a_preset_and_shard_count() -> None:
    shard = dense_shard({"0": 1}, 10, 1, 0)
    runs = []
    for rep, (sync_speed, gba_speed) in enumerate(((100.0, 200.0), (400.0, 600.0))):
        for shards in (1, 2):
            for algo, speed in (("sync", sync_speed), ("gba", gba_speed * shards)):
                result = gba_result(speed, [shard] * shards, [{"staleness_histogram": {}, "dropped": 0}] * shards)
                runs.append({"algo": algo, "rep": rep, "preset": "small", "shards": shards, "result": result,
                             "metrics": bench_gba.run_metrics(result, slow_trainer=3)})
    rows = {(row["shards"], row["algo"]): row for row in bench_gba.summarize(runs, ["small"], [1, 2], ["sync", "gba"])}
    assert rows[(1, "gba")]["samples_per_s_ratio_to_sync"] == pytest.approx((1.75, 1.5, 2.0))
    assert rows[(2, "gba")]["samples_per_s_ratio_to_sync"] == pytest.approx((3.5, 3.0, 4.0))
    assert rows[(2, "sync")]["samples_per_s_ratio_to_sync"] == (1.0, 1.0, 1.0)
    assert rows[(1, "gba")]["auc_minus_sync"] == [0.0, 0.0] and rows[(1, "gba")]["extra_x_dense"] == (1.5, 1.5, 1.5)
    assert all(cell(row) for row in rows.values() for _, cell in bench_gba.COLUMNS)


def test_the_production_preset_sets_mlperf_dlrm_shapes_and_nothing_but_model_and_data() -> None:
    pairs = dict(zip(*[iter(preset_overrides("production"))] * 2))
    assert pairs["--model.dense_arch_layer_sizes"] == "[512, 256, 128]"
    assert pairs["--model.over_arch_layer_sizes"] == "[1024, 1024, 512, 256, 1]"
    assert pairs["--data.synthetic.num_dense"] == "13" and pairs["--data.synthetic.num_tables"] == "26"
    assert {key.split(".")[0] for key in pairs} == {"--model", "--data"}
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset_overrides("huge")


def test_the_meter_reads_the_cpu_of_a_past_interval_and_a_sleeping_one_as_idle() -> None:
    meter = ResourceMeter(period_s=0.01)
    start, cpu_start = time.time(), cpu_seconds()
    while time.time() - start < 0.6:  # busy
        pass
    busy, cpu_busy = (start, time.time()), cpu_seconds() - cpu_start
    time.sleep(0.5)
    idle = (busy[1] + 0.1, time.time() - 0.1)
    meter.stop()
    # On a loaded machine the busy loop gets only a share of a core and the sampler wakes late: the
    # tolerance is a few sampling gaps of CPU at either end of the interval.
    assert cpu_busy > 0.15
    assert meter.cpu_s([busy]) == pytest.approx(cpu_busy, abs=0.06)
    assert meter.cpu_s([idle]) < 0.03
    assert meter.cpu_s([busy, idle]) == pytest.approx(meter.cpu_s([busy]) + meter.cpu_s([idle]))


def test_the_wall_clock_window_leaves_out_the_pauses_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, wall = StepWallClock(), [1000.0]
    monkeypatch.setattr(time, "time", lambda: wall[0])
    for step_end, pause in ((1.0, 0.0), (2.0, 5.0), (3.0, 0.0), (4.0, 0.0)):  # a 5 s evaluation after step 2
        wall[0] = 1000.0 + step_end + (5.0 if step_end > 2.0 else 0.0)
        clock.step_ended(step_end)
        clock.paused(pause)
    assert clock.intervals(1.5, 3.5) == [(1001.5, 1002.0), (1007.0, 1008.5)]
    assert clock.intervals(2.5, 4.0) == [(1007.5, 1009.0)]  # after the pause: shifted by it
    assert clock.intervals(0.5, 2.0) == [(1000.5, 1002.0)]  # a pause at the window's end is outside it


def test_cpu_per_sample_adds_every_rank_and_the_extra_is_a_trainers_growth_in_dense_sizes() -> None:
    by_rank = [
        {"role": "trainer", "cpu_s_in_window": 2.0, "peak_rss_mib": 500.0, "rss_before_sync_mib": 480.0},
        {"role": "trainer", "cpu_s_in_window": 3.0, "peak_rss_mib": 520.0, "rss_before_sync_mib": 490.0},
        {"role": "server", "cpu_s_in_window": 5.0, "peak_rss_mib": 900.0, "rss_before_sync_mib": None},
    ]
    summary = resource_summary(by_rank, samples=1000, dense_mib=10.0)
    assert summary["cpu_s_per_sample"] == pytest.approx(0.01)
    assert summary["trainer_peak_rss_mib_max"] == 520.0 and summary["server_peak_rss_mib_max"] == 900.0
    assert summary["trainer_extra_rss_mib_max"] == 30.0 and summary["trainer_extra_x_dense_max"] == 3.0
    assert resource_summary(by_rank[:2], samples=0, dense_mib=10.0)["server_peak_rss_mib_max"] is None


def test_a_warm_started_run_resumes_the_sync_checkpoint_and_stops_that_many_samples_later(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """bench_gba --warm-start-samples: sync alone (no straggler) to whole global batches past N, one
    checkpoint there; each algorithm resumes it and stops --global-samples after it; a run that did
    not resume from that checkpoint ends the benchmark, naming it; plain async is refused."""
    jobs: list[tuple[str, list[str]]] = []
    resumed = {"step": 3}

    def fake_run(label: str, nproc: int, arguments: list[str], output: Any) -> dict[str, Any]:
        jobs.append((label, arguments))
        return {"auc": 0.7, "checkpoint": {"resumed_from_step": resumed["step"]}}

    monkeypatch.setattr(bench_gba, "run_example", fake_run)
    args = bench_gba.argparse.Namespace(trainers=4, warm_start_samples=5000, warmup_steps=1, slow_trainer=3,
                                        factor=3.0, compute="real", step_ms=None, global_samples=1000,
                                        tables="ps")
    start = bench_gba.warm_start(0, "small", 1, args, [], tmp_path)
    flags = dict(zip(jobs[0][1][::2], jobs[0][1][1::2]))
    assert (start.steps, start.samples) == (3, 3 * 4 * 512)  # 5000 samples -> 3 global batches of 2048
    assert flags["--train.steps"] == "3" and flags["--checkpoint-every"] == "3" and "--straggler.factor" not in flags
    bench_gba.run_once("gba", 0, "small", 1, args, [], tmp_path / "r.json", start)
    label, arguments = jobs[1]
    assert arguments[-1] == "--resume" and arguments[arguments.index("--checkpoint-dir") + 1] == str(start.directory)
    assert arguments[arguments.index("--train.global_samples") + 1] == str(3 * 2048 + 1000)
    resumed["step"] = None
    with pytest.raises(SystemExit, match="resumed from step None, not from the warm start's checkpoint at step 3"):
        bench_gba.run_once("sync", 0, "small", 1, args, [], tmp_path / "r.json", start)
    with pytest.raises(SystemExit):
        bench_gba.main(["--compute", "real", "--algos", "sync,async", "--warm-start-samples", "1000"])


def test_bench_gba_puts_every_algorithms_tables_where_tables_says(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """--tables ps (default) and torchrec: the last --model.embeddings of every job's arguments, which
    overrides its config's; every algorithm keeps the same row optimizer and dense rate."""
    jobs: list[list[str]] = []
    monkeypatch.setattr(bench_gba, "run_example", lambda label, nproc, arguments, output: jobs.append(arguments) or {})
    args = bench_gba.argparse.Namespace(trainers=4, warmup_steps=1, slow_trainer=3, factor=1.0, compute="real",
                                        step_ms=None, global_samples=1000, tables="ps")
    for tables in ("ps", "torchrec"):
        args.tables = tables
        for algo in ("sync", "gba"):
            bench_gba.run_once(algo, 0, "production", 1, args, [], tmp_path / "r.json")
    for arguments, tables in zip(jobs, ("ps", "ps", "torchrec", "torchrec")):
        last = max(index for index, flag in enumerate(arguments) if flag == "--model.embeddings")
        assert arguments[last + 1] == tables
        assert arguments[arguments.index("--train.embedding_optimizer") + 1] == "rowwise_adagrad"
        assert arguments[arguments.index("--train.dense_lr") + 1] == str(bench_gba.TUNED_FOR_SYNC["production"])
