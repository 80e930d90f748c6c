"""The example's comparison baselines and measurements under torchrun: torch's periodic model averaging
(`baseline: pma`), GBA with PS tables and a straggler, and the held-out curve (`train.eval_every_samples`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_example import finish, run_example

pytestmark = pytest.mark.timeout(180)

def run_evaluating(config: str, ranks: int, extra: list[str], tmp_path: Path) -> dict:
    """Results of a short run evaluating every 40960 samples (40 steps of 2 trainers x 512)."""
    output = tmp_path / "curve.json"
    launcher = ["--standalone", f"--nproc_per_node={ranks}"]
    finish(run_example(launcher, config, output, ["--train.eval_every_samples", "40960", *extra]), timeout_s=150)
    return json.loads(output.read_text())


def checked_curve(results: dict) -> list[dict]:
    """The held-out curve of `results`, checked for what every curve must hold."""
    curve = results["curve"]
    assert [point["samples_seen"] for point in curve] == sorted({point["samples_seen"] for point in curve})
    assert all(0.0 < point["auc"] < 1.0 and point["log_loss"] > 0.0 for point in curve), curve
    assert [point["elapsed_s"] for point in curve] == sorted(point["elapsed_s"] for point in curve)
    assert (curve[-1]["auc"], curve[-1]["log_loss"]) == (results["auc"], results["log_loss"])  # the final evaluation
    assert curve[-1]["elapsed_s"] <= results["wall_s"] and results["eval_s_during_training"] > 0.0
    return curve


@pytest.fixture(scope="module")
def pma_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One 2-rank PMA run (TorchRec tables: the trainers are in lockstep) of 120 steps that evaluates
    every 40 steps: both tests below read it (one torchrun start-up, not two)."""
    extra = ["--train.steps", "120", "--sync.foreground_every", "20"]  # the last step (120) averages
    return run_evaluating("pma.yaml", 2, extra, tmp_path_factory.mktemp("pma"))


def test_pma_averages_every_period_steps_and_ends_identical_after_an_averaging_step(pma_run: dict) -> None:
    results = pma_run
    assert results["steps"] == 120
    assert results["sync"]["rounds"] == 120 // 20 and results["sync"]["steps"] == 120
    assert results["sync"]["sync_gap_steps_max"] == 20
    assert 0 < results["sync"]["training_sync_s"] < results["window_s"]
    assert results["dense_replica_max_abs_diff"] == 0.0  # averaged at the last step, no final sync


def test_lockstep_trainers_evaluate_together_at_each_multiple_and_end_on_the_final_evaluation(pma_run: dict) -> None:
    results, curve = pma_run, checked_curve(pma_run)
    # steps 40 and 80, then the final evaluation in place of the one at the last step (120)
    assert [point["samples_seen"] for point in curve] == [steps * 2 * 512 for steps in (40, 80, 120)]
    assert results["samples_computed_total"] == 120 * 2 * 512
    assert curve[-1]["sync_rounds"] == results["sync"]["rounds"]


GBA_SAMPLES = 300000
"""The GBA run's train.global_samples: about 290 global steps of 2 trainers x 512."""


@pytest.fixture(scope="module")
def gba_straggler_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """2 trainers + 1 server, tables on the PS, trainer 1 three times slower, evaluating every 40
    global steps: both tests below read this one run (one torchrun start-up, not two)."""
    extra = ["--train.global_samples", str(GBA_SAMPLES), "--straggler.trainers", "[1]", "--straggler.factor", "3"]
    return run_evaluating("gba_ps_embeddings.yaml", 3, extra, tmp_path_factory.mktemp("gba"))


def test_gba_with_ps_embeddings_and_a_straggler_stops_at_equal_samples_with_identical_replicas(
    gba_straggler_run: dict,
) -> None:
    """No collective in a trainer step: the fast trainer never waits for the slow one."""
    results = gba_straggler_run
    assert (results["world_size"], results["trainers"], results["servers"]) == (3, 2, 1)
    assert results["dense_replica_max_abs_diff"] == 0.0  # every trainer pulled the final parameters
    assert results["auc"] > 0.6, results
    gba, (shard,) = results["gba"], results["gba"]["dense_shards"]
    assert gba["mode"] == "gba" and gba["global_step"] * 1024 >= GBA_SAMPLES
    pushes = shard["pushes_by_trainer"]
    assert pushes["0"] > 1.5 * pushes["1"] > 0, pushes  # the fast trainer never waited for the slow one
    assert results["straggler_sleep_s_total"] > 0 and results["window_s"] > 0
    assert results["straggler_overrun_fraction_by_trainer"] == [0.0, 0.0]  # measured mode: no budget to overrun
    (rows,) = gba["embedding_shards"]  # row pushes carry tokens too: every push counted by staleness
    assert sum(rows["staleness_histogram"].values()) == rows["pushes"] >= pushes["0"] + pushes["1"]


def test_without_lockstep_trainer_0_evaluates_alone_counting_the_samples_gba_applied(gba_straggler_run: dict) -> None:
    """The GBA run above: no collective between steps, so trainer 0 evaluates alone."""
    results = gba_straggler_run
    curve = checked_curve(results)
    assert len(curve) >= 3 and curve[0]["samples_seen"] >= 40960 and curve[-1]["samples_seen"] >= GBA_SAMPLES
    assert curve[-1]["samples_seen"] == results["gba"]["global_step"] * 2 * 512  # global batch: 2 trainers x 512
