"""The example's comparison baselines and measurements under torchrun: torch's periodic model averaging
(`baseline: pma`) and the held-out curve (`train.eval_every_samples`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_example import finish, run_example

pytestmark = pytest.mark.timeout(120)

def run_evaluating(config: str, ranks: int, extra: list[str], tmp_path: Path) -> dict:
    """Results of a short run evaluating every 40960 samples (40 steps of 2 trainers x 512)."""
    output = tmp_path / "curve.json"
    launcher = ["--standalone", f"--nproc_per_node={ranks}"]
    finish(run_example(launcher, config, output, ["--train.eval_every_samples", "40960", *extra]), timeout_s=100)
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


@pytest.mark.timeout(150)
def test_without_lockstep_trainer_0_evaluates_alone_counting_the_samples_gba_applied(tmp_path: Path) -> None:
    """2 trainers + 1 server, tables on the PS, trainer 1 slowed: no collective between steps."""
    extra = ["--train.global_samples", "122880", "--straggler.trainers", "[1]", "--straggler.factor", "2"]
    results = run_evaluating("gba_ps_embeddings.yaml", 3, extra, tmp_path)
    curve = checked_curve(results)
    assert len(curve) >= 3 and curve[0]["samples_seen"] >= 40960 and curve[-1]["samples_seen"] >= 122880
    assert curve[-1]["samples_seen"] == results["gba"]["global_step"] * 2 * 512  # global batch: 2 trainers x 512
