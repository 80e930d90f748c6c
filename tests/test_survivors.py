"""Survivors finish cleanly: a trainer that departed a job with servers costs only its own work.

The harness (`benchmarks/train_dlrm.py`) runs GBA with the tables on the server, 2 trainers and 1
server, `sync.ps.on_trainer_lost: continue` (the default). Trainer 1 stops for good (SIGSTOP, never
continued) after step 10; the server marks it departed after `sync.ps.trainer_timeout_s`, and
trainer 0 trains on to the end. What follows training (the barrier that its row gradients landed,
the throughput window, the replica check, held-out evaluation, the resources) runs on the
survivors (`Job.survivors`), so trainer 0 writes the result instead of waiting in a collective
with the stopped process until it times out naming nobody.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiprocess import run_ranks_outcomes

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[1]
STOP_AT, STEPS, TIMEOUT_S = 10, 80, 4.0


def _harness_with_a_stopped_trainer(rank: int, world_size: int, fault_log: str) -> dict[str, Any] | None:
    from train_dlrm import run

    from dlrm.config import ExperimentConfig
    from shadowgba.config import load_config
    from tests.test_checkpoint import SMALL

    torch.set_num_threads(1)
    os.environ.update(SHADOWGBA_TEST_FAULTS=f"stop:1:{STOP_AT}", SHADOWGBA_TEST_FAULT_LOG=fault_log)
    timeouts = [f"--sync.{key}" for key in ("timeout_s", "ps.rpc_timeout_s", "ps.trainer_timeout_s")]
    config = load_config(ExperimentConfig, REPO / "examples/configs/gba_ps_embeddings.yaml",
                         [*SMALL, "--train.steps", str(STEPS),
                          *[part for key in timeouts for part in (key, str(TIMEOUT_S))]])
    started = time.monotonic()
    results = run(config, torch.device("cpu"), "gloo")
    return {"results": results, "elapsed_s": time.monotonic() - started}


def test_a_trainer_stopped_for_good_costs_the_harness_only_its_own_work(tmp_path: Path) -> None:
    fault_log = tmp_path / "faults.jsonl"
    outcomes = run_ranks_outcomes(_harness_with_a_stopped_trainer, 3, str(fault_log), timeout_s=150,
                                  stopped_for_good=True)
    fired = [json.loads(line) for line in fault_log.read_text().splitlines()]
    assert [(event["kind"], event["trainer"], event["step"]) for event in fired] == [("stop", 1, STOP_AT)], fired
    assert outcomes[1].stopped, outcomes  # still stopped when the others had ended
    assert outcomes[2].returned and outcomes[2].value["results"] is None, outcomes  # the server: nothing to write
    assert outcomes[0].returned, outcomes
    trainer = outcomes[0].value["results"]
    assert trainer["writer"] and trainer["departed_trainers"] == [1], trainer
    assert trainer["steps"] == STEPS and trainer["steps_by_trainer"] == [STEPS], trainer
    assert 0.5 < trainer["auc"] < 1.0 and trainer["dense_replica_max_abs_diff"] == 0.0, trainer
    assert [rank["rank"] for rank in trainer["resources"]["by_rank"]] == [0, 2], trainer["resources"]
    assert trainer["gba"]["dense_shards"][0]["global_step"] > 0, trainer["gba"]
