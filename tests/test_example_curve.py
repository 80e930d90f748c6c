"""The example's comparison baselines and measurements under torchrun: torch's periodic model averaging
(`sync.algo: pma`) and the held-out curve (`train.eval_every_samples`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_example import finish, run_example

pytestmark = pytest.mark.timeout(120)

TWO_RANKS = ["--standalone", "--nproc_per_node=2"]


def test_pma_averages_every_period_steps_and_ends_identical_after_an_averaging_step(tmp_path: Path) -> None:
    output = tmp_path / "pma.json"
    extra = ["--train.steps", "120", "--sync.foreground_every", "20"]  # the last step (120) averages
    finish(run_example(TWO_RANKS, "pma.yaml", output, extra), timeout_s=100)
    results = json.loads(output.read_text())
    assert results["steps"] == 120
    assert results["sync"]["rounds"] == 120 // 20 and results["sync"]["steps"] == 120
    assert results["sync"]["sync_gap_steps_max"] == 20
    assert 0 < results["sync"]["training_sync_s"] < results["window_s"]
    assert results["dense_replica_max_abs_diff"] == 0.0  # averaged at the last step, no final sync
