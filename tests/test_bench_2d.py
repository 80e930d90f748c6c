"""bench_2d's pure parts on constructed runs (no torchrun): the variants' arguments, one run's metrics,
the per-repetition ratios and differences of the throughput table, the quality table's per-seed AUC
gaps, and the warnings; and one harness job under torchrun: the sample budget of quality runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import bench_2d
from bench_2d import QUALITY_COLUMNS, THROUGHPUT_COLUMNS, VARIANTS, quality_rows, throughput_metrics, throughput_rows
from example_job import run_example


def result(speed: float, steps: list[int], overruns: list[float], sync: dict[str, Any], extra_mib: float,
           stopped_at: int = 0, auc: float = 0.75, seed_samples: int = 0) -> dict[str, Any]:
    """The harness's results of one 4-trainer run, only the fields bench_2d reads; `stopped_at`: every
    trainer stopped at that step (0: trainer 0 at step 100, the others later)."""
    batch = 8
    return {
        "samples_per_s_total": speed, "window_s": 30.0, "steps_in_window_by_trainer": steps,
        "straggler_overrun_fraction_by_trainer": overruns, "sync": sync, "trainers": 4, "dense_params": 1000,
        "steps": stopped_at or 100, "samples_computed_total": 4 * batch * stopped_at if stopped_at else 1000 * batch,
        "config": {"data": {"source": "synthetic", "synthetic": {"batch_size": batch}}},
        "auc": auc, "log_loss": 1 - auc, "wall_s": 60.0,
        "resources": {"cpu_s_per_sample": 1e-4, "trainer_peak_rss_mib_max": 900.0, "server_peak_rss_mib_max": None,
                      "trainer_extra_rss_mib_max": extra_mib, "trainer_extra_x_dense_max": extra_mib / 4},
    }


def test_flat_ddp_shards_over_every_trainer_and_the_2d_variants_over_a_group() -> None:
    assert VARIANTS["ddp"].arguments(2, 10)[-4:] == ["--sync.sharding_group_size", "0", "--sync.foreground_every", "10"]
    bmuf = VARIANTS["bmuf-foreground"].arguments(2, 7)
    assert bmuf[-6:] == ["--sync.mode", "foreground", "--sync.sharding_group_size", "2", "--sync.foreground_every", "7"]
    assert {name for name, variant in VARIANTS.items() if variant.decoupled} == {"ma-shadow", "bmuf-shadow", "none-2d"}


def test_the_fast_group_is_the_one_without_the_slowed_trainer() -> None:
    sync = {"rounds_per_s": 2.0, "table_rounds": 51, "table_cycles": 1, "fragment_refresh_age_steps_mean": 3.5,
            "fragment_refresh_age_steps_max": 9}
    run = result(1000.0, [10, 10, 30, 29], [1.0, 0.0, 0.1, 0.3], sync, 40.0)
    run["sync_gap_steps_max_between_rounds_by_trainer"] = [7, 7, 21, 20]  # each in its own steps
    metrics = throughput_metrics(run, 1, 2)
    assert metrics["dense_gap_max_any_trainer"] == 21
    assert metrics["group_step_ratio"] == pytest.approx(2.95)  # trainers 2 and 3 over 0 and 1
    assert metrics["overrun_fast_group"] == pytest.approx(0.2)  # trainer 0 waits on its slow partner: left out
    assert metrics["table_rounds"] == 51 and metrics["fragment_refresh_age_steps_max"] == 9 and metrics["extra_mib"] == 40.0
    assert not metrics["stopped_together"]
    ddp = throughput_metrics(result(500.0, [10, 10, 10, 10], [0.0] * 4, {}, 20.0, stopped_at=40), 1, 2)
    assert ddp["sync_rounds_per_s"] is None and ddp["table_cycles"] is None and ddp["stopped_together"]
    assert ddp["dense_gap_max_any_trainer"] is None


def throughput_run(variant: str, rep: int, speed: float, extra_mib: float, straggler: str = "straggler",
                   overrun: float = 0.0, stopped_at: int = 0) -> dict[str, Any]:
    run = result(speed, [10, 10, 30, 30], [0.0, 0.0, overrun, overrun], {}, extra_mib, stopped_at)
    return {"preset": "small", "compute": "simulated", "straggler": straggler, "variant": variant, "rep": rep,
            "metrics": throughput_metrics(run, 1, 2), "result": run}


def test_ratios_and_extra_memory_are_taken_per_repetition_against_the_same_cell() -> None:
    runs = [throughput_run(variant, rep, speed, extra) for rep, speeds in enumerate(((100.0, 50.0, 190.0, 200.0),
                                                                                     (200.0, 200.0, 300.0, 400.0)))
            for variant, speed, extra in zip(("torchrec_2d", "ddp", "bmuf-shadow", "none-2d"), speeds,
                                             (30.0, 20.0, 45.0, 30.0))]
    runs.append(throughput_run("bmuf-shadow", 0, 10.0, 45.0, straggler="even"))  # another cell: never paired
    variants = ["torchrec_2d", "ddp", "bmuf-shadow", "none-2d"]
    rows = {row["variant"]: row for row in throughput_rows(runs, [("small", "simulated", "straggler")], variants)}
    bmuf = rows["bmuf-shadow"]
    assert bmuf["ratios_to_torchrec_2d"] == pytest.approx([1.9, 1.5])  # 190/100 and 300/200, not 490/300
    assert bmuf["ratio_to_torchrec_2d"] == pytest.approx((1.7, 1.5, 1.9))
    assert bmuf["ratio_to_ddp"] == pytest.approx((2.65, 1.5, 3.8))
    assert bmuf["extra_mib_over_none_2d"] == (15.0, 15.0, 15.0) and bmuf["reps"] == 2
    assert rows["torchrec_2d"]["ratio_to_torchrec_2d"] == (1.0, 1.0, 1.0)
    table = bench_2d.markdown_table(THROUGHPUT_COLUMNS, list(rows.values()))
    assert "| simulated / straggler | small (1,000) | bmuf-shadow | 245 (190-300) | 1.70 (1.50-1.90) |" in table
    assert "- / -" in table  # no table rounds, no fragment age: not a 2D shadowgba run


def test_warnings_name_overruns_only_where_the_fast_group_never_waits_and_paired_decoupled_steps() -> None:
    paced = throughput_run("torchrec_2d", 0, 100.0, 1.0, overrun=0.9)  # waits for the slow rank in every step
    rows = throughput_rows([paced], [("small", "simulated", "straggler")], ["torchrec_2d"])
    assert bench_2d.warnings(rows) == []
    overrun = throughput_run("ma-shadow", 0, 100.0, 1.0, overrun=0.5)
    paired_steps = throughput_run("none-2d", 0, 100.0, 1.0, stopped_at=120)
    rows = throughput_rows([overrun, paired_steps], [("small", "simulated", "straggler")], ["ma-shadow", "none-2d"])
    first, second = bench_2d.warnings(rows)
    assert "up to 50%" in first and "(ma-shadow)" in first
    assert second.startswith("WARNING: in 1 decoupled run(s)")


def test_quality_gaps_are_paired_by_seed() -> None:
    runs = [{"compute": "simulated", "straggler": "straggler", "variant": variant, "rep": rep, "seed": seed,
             "overrun_fast_group": 0.0, "group_step_ratio": 1.0,
             "result": result(0.0, [0] * 4, [0.0] * 4, {}, 0.0, stopped_at=3000, auc=auc)}
            for rep, (seed, aucs) in enumerate(((0, (0.80, 0.79, 0.801)), (1, (0.70, 0.71, 0.698))))
            for variant, auc in zip(("torchrec_2d", "ddp", "ma-shadow"), aucs)]
    rows = {row["variant"]: row for row in quality_rows(runs, [("simulated", "straggler")],
                                                         ["torchrec_2d", "ddp", "ma-shadow"])}
    assert rows["ma-shadow"]["auc_minus_torchrec_2d"] == pytest.approx([0.001, -0.002])
    assert rows["ma-shadow"]["auc_minus_ddp"] == pytest.approx([0.011, -0.012])
    assert rows["ma-shadow"]["samples_seen"] == (96_000, 96_000, 96_000)  # 4 trainers x 3000 steps x 8
    table = bench_2d.markdown_table(QUALITY_COLUMNS, list(rows.values()))
    assert "+0.0010 -0.0020" in table


def test_option_lists_refuse_unknown_names() -> None:
    assert bench_2d.parse_quality_cells("simulated:straggler,real:even") == [
        ("simulated", "straggler"), ("real", "even")]
    assert bench_2d.parse_quality_cells("") == []
    with pytest.raises(SystemExit, match="COMPUTE:STRAGGLER"):
        bench_2d.parse_quality_cells("simulated")
    with pytest.raises(SystemExit, match="--variants must name only"):
        bench_2d.parse_list("ddp,flat", list(VARIANTS), "--variants")


@pytest.mark.timeout(180)
def test_a_sample_budget_lets_the_fast_replica_group_take_more_of_the_job_samples(tmp_path: Path) -> None:
    """`--quality-stop samples`: a 2 x 2 shadow BMUF job with trainer 1 three times slower stops once
    the trainers together computed the budget; the fast group took more of it, and the job still
    ended with identical replicas. With the held-out curve on: each group evaluates its own replica
    at the job's samples seen, so the curve's points do not hold the fast group back to the slow
    one's steps (they did while the curve evaluated over every trainer)."""
    batch, check_every, budget, every = 64, 5, 4 * 60 * 64, 4096
    arguments = [*VARIANTS["bmuf-shadow"].arguments(2, 10), "--train.job_samples", str(budget),
                 "--train.stop_check_every", str(check_every), "--train.warmup_steps", "5",
                 "--data.synthetic.batch_size", str(batch), "--data.synthetic.eval_batches", "4",
                 "--sync.interval_ms", "20", "--straggler.trainers", "[1]", "--straggler.factor", "3",
                 "--straggler.step_ms", "30", "--train.eval_every_samples", str(every)]
    run = run_example("job_samples", 4, arguments, tmp_path / "result.json")
    slow, fast = run["steps_by_trainer"][:2], run["steps_by_trainer"][2:]
    assert slow[0] == slow[1] and fast[0] == fast[1]  # each group's all-to-all pairs its steps
    assert fast[0] > 1.5 * slow[0], run["steps_by_trainer"]
    overshoot = 2 * 2 * check_every * batch  # each group may count one check interval past the budget
    assert budget <= run["samples_computed_total"] <= budget + overshoot
    assert run["dense_replica_max_abs_diff"] == 0.0 and run["table_replica_max_abs_diff"] == 0.0
    # trainer 0's curve: one point per multiple of `every` the job's counter crossed, at the counter
    # its group's decider last read (later by what both groups computed since), then the final
    # evaluation (which replaces a point taken at the same count)
    seen = [point["samples_seen"] for point in run["curve"]]
    assert len(seen) in (budget // every, budget // every + 1), seen
    assert all((index + 1) * every <= count < (index + 2) * every for index, count in enumerate(seen[:-1])), seen
    assert seen[-1] == max(seen) <= budget + overshoot, seen


def test_a_quality_run_stops_at_its_steps_times_the_batch_the_overrides_set() -> None:
    args = bench_2d.argparse.Namespace(quality_stop="samples", quality_steps=100, nproc=4)
    default = bench_2d.ExperimentConfig().data.batch_size
    assert bench_2d.quality_length(args)[:2] == ["--train.job_samples", str(100 * 4 * default)]
    overridden = bench_2d.quality_length(args, ["--sync.interval_ms", "0", "--data.synthetic.batch_size", "64"])
    assert overridden[:2] == ["--train.job_samples", str(100 * 4 * 64)] and default != 64


def test_the_shadow_rounds_run_at_the_configs_pacing_unless_the_interval_flags_are_given() -> None:
    default = bench_2d.argparse.Namespace(interval_steps=None, interval_ms=None)
    assert bench_2d.pacing_arguments(default) == []
    given = bench_2d.argparse.Namespace(interval_steps=2, interval_ms=None)
    assert bench_2d.pacing_arguments(given) == ["--sync.interval_steps", "2"]
