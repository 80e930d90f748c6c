"""The throughput model's maths (benchmarks/throughput_model.py) and calibrate.py's fits: no processes."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

import calibrate
import throughput_model as tm

pytestmark = pytest.mark.timeout(30)

PRESET = tm.Preset("test", compute_s=0.02, dense_params=2_000_000, batch_size=512, lookup_bytes=1_000_000)
CALIBRATION = tm.Calibration(
    presets={"test": PRESET},
    allreduce=tm.AllReduce(bandwidth_bytes_per_s=1e9, latency_s=50e-6),
    shard_push=tm.LinearCost(fixed_s=1e-5, per_unit_s=1e-9),
    lookup=tm.LinearCost(fixed_s=2e-4, per_unit_s=5e-10),
    server_row_byte_s=1e-10,
    copy_bytes_per_s=5e9,
    shadow_steal=0.1,
    cores=2,
    provisional=True,
)
ONE_HOST_EACH = tm.Hosts(cores=2)
STRAGGLER = tm.Stragglers(factor=3.0, count=1)


def test_ring_allreduce_is_the_ring_formula_and_free_on_one_rank() -> None:
    ring = CALIBRATION.allreduce
    assert ring.time_s(8e6, 1) == 0.0
    assert ring.time_s(8e6, 4) == pytest.approx(2 * 3 / 4 * 8e6 / 1e9 + 2 * 3 * 50e-6)


def test_sync_pays_the_slowest_trainer_plus_the_allreduce_every_step() -> None:
    job = tm.Job(PRESET, 64, ONE_HOST_EACH, STRAGGLER)
    step_s = 3.0 * PRESET.compute_s + CALIBRATION.allreduce.time_s(PRESET.dense_bytes, 64)
    prediction = tm.predict_sync(job, CALIBRATION)
    assert prediction.samples_per_s == pytest.approx(64 * 512 / step_s)
    assert prediction.bound == "slowest trainer"


def test_shadow_and_gba_trainers_run_at_their_own_pace() -> None:
    job = tm.Job(PRESET, 8, ONE_HOST_EACH, STRAGGLER)
    fast_and_slow = 7 * 512 / PRESET.compute_s + 512 / (3 * PRESET.compute_s)
    assert tm.predict_gba(job, CALIBRATION).computed_samples_per_s == pytest.approx(fast_and_slow)
    assert tm.predict_none(job, CALIBRATION).samples_per_s == pytest.approx(fast_and_slow)
    shadow = tm.predict_shadow(job, CALIBRATION)
    busy = shadow.detail["shadow_busy"]
    assert 0 < busy < 1
    assert shadow.samples_per_s == pytest.approx(fast_and_slow / (1 + CALIBRATION.shadow_steal * busy))
    assert shadow.samples_per_s > tm.predict_sync(job, CALIBRATION).samples_per_s


def test_shadow_rounds_are_bounded_by_the_allreduce_and_their_share_of_the_time() -> None:
    job = tm.Job(PRESET, 1024, ONE_HOST_EACH, interval_s=1e-6, round_share=1.0)
    detail = tm.predict_shadow(job, CALIBRATION).detail
    assert detail["round_s"] > CALIBRATION.allreduce.time_s(PRESET.dense_bytes, 1024)
    assert detail["rounds_per_s"] == pytest.approx(1 / detail["round_s"])
    shared = tm.predict_shadow(tm.Job(PRESET, 1024, ONE_HOST_EACH, interval_s=1e-6, round_share=0.1), CALIBRATION)
    assert shared.detail["rounds_per_s"] == pytest.approx(0.1 / detail["round_s"])


def test_gba_is_capped_by_the_shards_ingest_and_more_shards_lift_the_cap() -> None:
    job = tm.Job(PRESET, 1024, ONE_HOST_EACH, ps_tables=True)
    one = tm.predict_gba(job, CALIBRATION)
    per_push = CALIBRATION.shard_push.time_s(PRESET.dense_bytes) + PRESET.lookup_bytes * CALIBRATION.server_row_byte_s
    assert one.bound == "servers"
    assert one.samples_per_s == pytest.approx(512 / per_push)
    assert one.computed_samples_per_s > one.samples_per_s
    four = tm.predict_gba(dataclasses.replace(job, shards=4), CALIBRATION)
    assert one.samples_per_s < four.samples_per_s < 4 * one.samples_per_s  # the per-push cost does not shrink


def test_shards_needed_keeps_up_with_headroom_and_grows_with_trainers() -> None:
    needed = []
    for trainers in (8, 64, 256, 1024):
        job = tm.Job(PRESET, trainers, ONE_HOST_EACH, STRAGGLER, ps_tables=True)
        shards = tm.shards_needed(job, CALIBRATION, headroom=0.25)
        assert shards is not None
        demand = 1.25 * tm.predict_none(job, CALIBRATION).samples_per_s / 512
        assert tm.server_pushes_per_s(job, CALIBRATION, shards) >= demand
        assert shards == 1 or tm.server_pushes_per_s(job, CALIBRATION, shards - 1) < demand
        needed.append(shards)
    assert needed == sorted(needed) and needed[0] < needed[-1]


def test_shards_needed_is_none_when_the_per_push_cost_alone_is_too_high() -> None:
    job = tm.Job(PRESET, 1024, ONE_HOST_EACH)
    assert tm.shards_needed(job, dataclasses.replace(CALIBRATION, shard_push=tm.LinearCost(1e-2, 0.0))) is None


def test_ranks_sharing_cores_stretch_compute_by_ranks_over_cores() -> None:
    alone = tm.Job(PRESET, 1, tm.Hosts(cores=2, ranks_per_host=1))
    crowded = tm.Job(PRESET, 8, tm.Hosts(cores=2, ranks_per_host=8))
    assert crowded.compute_s() == pytest.approx(4 * PRESET.compute_s)
    assert tm.predict_none(crowded, CALIBRATION).samples_per_s == pytest.approx(
        2 * tm.predict_none(alone, CALIBRATION).samples_per_s)
    simulated = tm.Hosts(cores=2, ranks_per_host=8, busy_share=0.1)
    assert simulated.stretch() == 1.0 and simulated.stretch(extra_busy=0.2) == pytest.approx(1.2)


def test_expected_max_of_lognormal_jitter_matches_sampling() -> None:
    stragglers = tm.Stragglers(factor=3.0, count=1, jitter_sigma=0.3)
    draws = random.Random(0)
    sigma, mu = 0.3, -0.3 ** 2 / 2
    samples = [max([3.0 * math.exp(draws.gauss(mu, sigma))] + [math.exp(draws.gauss(mu, sigma)) for _ in range(63)])
               for _ in range(4000)]
    assert stragglers.expected_max(64) == pytest.approx(sum(samples) / len(samples), rel=0.02)
    assert tm.Stragglers(jitter_sigma=0.3).expected_max(1) == pytest.approx(1.0, rel=1e-3)
    assert tm.Stragglers(factor=3.0, fraction=0.1).expected_max(8) == 3.0
    assert tm.Stragglers(factor=3.0, fraction=0.01).slow(8) == 0


def test_ring_allreduce_waits_for_scheduling_only_where_ranks_share_cores() -> None:
    ring = tm.AllReduce(bandwidth_bytes_per_s=1e9, latency_s=50e-6, switch_s=1e-3)
    assert ring.time_s(8e6, 8) == pytest.approx(CALIBRATION.allreduce.time_s(8e6, 8))
    assert ring.time_s(8e6, 8, crowding=4.0) == pytest.approx(2 * 7 / 8 * 8e6 / 1e9 + 14 * (50e-6 + 3 * 1e-3))
    crowded = tm.Job(PRESET, 8, tm.Hosts(cores=2, ranks_per_host=8))
    assert crowded.allreduce_s(dataclasses.replace(CALIBRATION, allreduce=ring)) == pytest.approx(
        ring.time_s(PRESET.dense_bytes, 8, crowding=4.0))


def test_fits_recover_the_costs_they_were_made_from() -> None:
    ring = tm.AllReduce(bandwidth_bytes_per_s=2e9, latency_s=30e-6, switch_s=800e-6)
    points = [{"ranks": n, "bytes": b, "wall_s": ring.time_s(b, n, max(1.0, n / 2))}
              for n in (2, 4, 8) for b in calibrate.SIZES]
    found = calibrate.fit_allreduce(points, cores=2)
    assert found.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert found.latency_s == pytest.approx(30e-6, rel=1e-6)
    assert found.switch_s == pytest.approx(800e-6, rel=1e-6)
    pushes = [{"bytes": b, "wall_s": 1e-3 + 2e-9 * b} for b in (1e3, 1e6, 1e7)]
    fit = calibrate.fit_linear_cost(pushes)
    assert (fit.fixed_s, fit.per_unit_s) == pytest.approx((1e-3, 2e-9))
    assert calibrate.fit_linear_cost(pushes[1:2]) == tm.LinearCost(0.0, pushes[1]["wall_s"] / 1e6)


def test_a_calibration_written_as_calibrate_fits_it_loads_into_the_model(tmp_path: Path) -> None:
    compute = {"preset": "small", "wall_s": 0.05, "cpu_s": 0.02, "dense_params": 338_241, "batch_size": 512, "lookup_bytes": 1 << 20,
               "shadow_steal": {"copy_bytes_per_s": 4e9, "steal_per_busy_core": 0.05}}
    ring = tm.AllReduce(1e9, 1e-5, 1e-4)
    measured = {
        "compute": [compute],
        "sharded_compute": [{"preset": "small", "ranks": n, "wall_s": 0.04, "cpu_s": 0.02 + 0.005 * n} for n in (2, 4)],
        "allreduce": [{"ranks": n, "bytes": b, "wall_s": ring.time_s(b, n, n / 2)} for n in (2, 4) for b in (1 << 10, 1 << 20)],
        "ps": {"pushes": [{"bytes": b, "wall_s": 1e-3 + b * 1e-9} for b in (1 << 10, 1 << 20)],
               "lookups": [{"bytes": b, "wall_s": 2e-4 + b * 1e-9} for b in (1 << 10, 1 << 20)],
               "server_rows": {"bytes": 1 << 20, "server_s": 1e-3}},
    }
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"provisional": True, "model": calibrate.fitted(measured, cores=2)}))
    loaded = tm.Calibration.load(path)
    assert loaded.presets["small"] == tm.Preset("small", 0.02, 338_241, 512, 1 << 20, {2: 0.03, 4: 0.04})
    assert loaded.shard_push.fixed_s == pytest.approx(1e-3) and loaded.shard_push.per_unit_s == pytest.approx(1e-9)
    assert loaded.allreduce.latency_s == pytest.approx(1e-5) and loaded.shadow_steal == 0.05


def test_torchrec_tables_cost_the_step_measured_at_that_many_ranks_held_past_the_last() -> None:
    preset = dataclasses.replace(PRESET, sharded_compute_s={2: 0.03, 8: 0.05})
    assert [preset.step_compute_s(n) for n in (1, 2, 4, 8, 1024)] == [0.02, 0.03, 0.03, 0.05, 0.05]
    hosts = tm.Hosts(cores=2, ranks_per_host=4)
    sharded = tm.Job(preset, 4, hosts, torchrec_tables=True)
    assert sharded.compute_s() == pytest.approx(0.03 * 2)  # 4 busy ranks on 2 cores
    assert tm.Job(preset, 4, hosts).compute_s() == pytest.approx(0.02 * 2)
    assert tm.predict_none(sharded, CALIBRATION).samples_per_s == pytest.approx(4 * 512 / 0.06)


def test_prediction_rows_hold_each_algorithm_and_shard_count() -> None:
    rows = tm.prediction_rows(CALIBRATION, ["test"], [8, 64], STRAGGLER, [1, None], ONE_HOST_EACH)
    assert [row["trainers"] for row in rows] == [8, 64]
    job = tm.Job(PRESET, 64, ONE_HOST_EACH, STRAGGLER, shards=64, ps_tables=True)
    assert rows[1]["gba_N"] == tm.predict_gba(job, CALIBRATION).samples_per_s
    assert rows[1]["sync"] == tm.predict_sync(job, CALIBRATION).samples_per_s
    assert rows[1]["shards_needed"] == tm.shards_needed(job, CALIBRATION)


def test_validation_reads_a_scaling_run_as_the_job_it_was() -> None:
    run = {"variant": "ddp", "rep": 0, "trainers": 4, "dense_params": PRESET.dense_params, "samples_per_s_total": 9000.0,
           "window_s": 10.0, "resources": {"cpu_s_in_window": 15.0},
           "config": {"sync": {"interval_ms": 100.0}, "model": {"embeddings": "torchrec"}}}
    (entry,) = calibrate.scaling_points({"runs": [run]}, CALIBRATION)
    assert entry["algorithm"] == "sync" and entry["measured"] == 9000.0
    assert entry["job"].hosts == tm.Hosts(cores=2, ranks_per_host=4) and entry["job"].interval_s == 0.1
    assert entry["cores_got"] == 1.5 and entry["job_at_cores_got"].hosts.cores == 1.5
    assert entry["job"].torchrec_tables
    with pytest.raises(SystemExit, match="no calibrated preset"):
        calibrate.scaling_points({"runs": [{**run, "dense_params": 7}]}, CALIBRATION)


def test_bench_ps_rows_become_the_push_and_row_costs() -> None:
    def row(kind: str, trainers: int, size: int, median: float, **extra: float) -> dict:
        return {"kind": kind, "trainers": trainers, "shards": 1, "size": size, "in_flight": extra.pop("in_flight", 1),
                "tree": "after", "reps": 5, "median": median, **extra}

    raw = {"summary": [
        row("dense", 2, 1 << 20, 0.5, pushes_per_s=500.0, in_flight=4),
        row("dense", 2, 1 << 23, 0.9, pushes_per_s=100.0, in_flight=4),
        row("dense", 1, 1 << 20, 0.2, pushes_per_s=200.0),
        {**row("dense", 2, 1 << 20, 9.9, pushes_per_s=9e4, in_flight=4), "shards": 2},
        row("lookup", 1, 4096, 1e6), row("lookup", 2, 4096, 2e6), row("row_push", 2, 4096, 1e6),
    ]}
    measured = calibrate.from_bench_ps(raw)
    assert measured["pushes"] == [{"bytes": 1 << 20, "wall_s": 1 / 500, "reps": 5}, {"bytes": 1 << 23, "wall_s": 1 / 100, "reps": 5}]
    assert measured["lookups"][0]["wall_s"] == pytest.approx(2 * 4096 / 2e6)
    assert measured["server_rows"]["server_s"] == pytest.approx(1 / 2e6 + 1 / 1e6)
    assert calibrate.from_bench_ps({"summary": [row("lookup", 1, 4096, 1e6)]}) is None


def test_allreduce_fit_without_crowded_points_has_no_scheduling_wait() -> None:
    ring = tm.AllReduce(bandwidth_bytes_per_s=1e9, latency_s=40e-6)
    points = [{"ranks": 2, "bytes": b, "wall_s": ring.time_s(b, 2)} for b in calibrate.SIZES]
    found = calibrate.fit_allreduce(points, cores=2)
    assert found.switch_s == 0.0 and found.latency_s == pytest.approx(40e-6, rel=1e-6)
