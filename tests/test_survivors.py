"""Survivors finish cleanly: a trainer that departed, or a replica group lost, costs only its own work.

The harness (`benchmarks/train_dlrm.py`) runs GBA with the tables on the server, 2 trainers and 1
server, `sync.ps.on_trainer_lost: continue` (the default). Trainer 1 stops for good (SIGSTOP, never
continued) after step 10; the server marks it departed after `sync.ps.trainer_timeout_s`, and
trainer 0 trains on to the end. What follows training (the barrier that its row gradients landed,
the throughput window, the replica check, held-out evaluation, the resources) runs on the
survivors (`Job.survivors`), so trainer 0 writes the result instead of waiting in a collective
with the stopped process until it times out naming nobody.

The same harness in the 2D layout (ma, 2 groups of 2) under `sync.on_group_lost: continue`: rank 2's
loop raises at step 20 (its abort reaches the others as a round's flag); group 1 ends, group 0 trains
to the end on rounds rebuilt without it, and writes the result. A replica check over a group of one
member (trainer 0 alone under GBA; each table shard's replica group once group 1 is lost) has
nothing to compare and reports None, not a vacuous 0.0.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiprocess import run_ranks_outcomes

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[1]
STOP_AT, STEPS, TIMEOUT_S = 10, 80, 4.0


def _harness_with_a_fault(rank: int, world_size: int, example: str, fault: str, fault_log: str,
                          options: list[str]) -> dict[str, Any] | None:
    """The harness on this rank running `example` with `fault` armed (SHADOWGBA_TEST_FAULTS),
    sync.timeout_s at TIMEOUT_S and `options` over that."""
    from train_dlrm import run

    from dlrm.config import ExperimentConfig
    from shadowgba.config import load_config
    from tests.test_checkpoint import SMALL

    torch.set_num_threads(1)
    os.environ.update(SHADOWGBA_TEST_FAULTS=fault, SHADOWGBA_TEST_FAULT_LOG=fault_log)
    config = load_config(ExperimentConfig, REPO / "examples/configs" / example,
                         [*SMALL, "--train.steps", str(STEPS), "--sync.timeout_s", str(TIMEOUT_S), *options])
    return {"results": run(config, torch.device("cpu"), "gloo")}


def fired(fault_log: Path) -> list[tuple[str, int, int]]:
    return [(event["kind"], event["trainer"], event["step"]) for event in map(json.loads, fault_log.read_text().splitlines())]


def test_a_trainer_stopped_for_good_costs_the_harness_only_its_own_work(tmp_path: Path) -> None:
    fault_log = tmp_path / "faults.jsonl"
    servers = [part for key in ("rpc_timeout_s", "trainer_timeout_s") for part in (f"--sync.ps.{key}", str(TIMEOUT_S))]
    outcomes = run_ranks_outcomes(_harness_with_a_fault, 3, "gba_ps_embeddings.yaml", f"stop:1:{STOP_AT}",
                                  str(fault_log), servers, timeout_s=150, stopped_for_good=True)
    assert fired(fault_log) == [("stop", 1, STOP_AT)]
    assert outcomes[1].stopped, outcomes  # still stopped when the others had ended
    assert outcomes[2].returned and outcomes[2].value["results"] is None, outcomes  # the server: nothing to write
    assert outcomes[0].returned, outcomes
    trainer = outcomes[0].value["results"]
    assert trainer["writer"] and trainer["departed_trainers"] == [1], trainer
    assert trainer["steps"] == STEPS and trainer["steps_by_trainer"] == [STEPS], trainer
    assert 0.5 < trainer["auc"] < 1.0, trainer
    assert trainer["dense_replica_max_abs_diff"] is None, trainer  # one surviving replica: nothing to compare
    assert [rank["rank"] for rank in trainer["resources"]["by_rank"]] == [0, 2], trainer["resources"]
    assert trainer["gba"]["dense_shards"][0]["global_step"] > 0, trainer["gba"]


def test_a_2d_group_whose_rank_raised_drops_out_and_the_other_writes_the_result(tmp_path: Path) -> None:
    fault_log = tmp_path / "faults.jsonl"
    outcomes = run_ranks_outcomes(_harness_with_a_fault, 4, "ma_2d.yaml", "fail:2:20", str(fault_log),
                                  ["--sync.on_group_lost", "continue"], timeout_s=150)
    assert fired(fault_log) == [("fail", 2, 20)]
    assert "InjectedFailure" in outcomes[2].traceback, outcomes[2]  # the user's exception, as it was raised
    assert outcomes[3].traceback is not None and "rank 2" in outcomes[3].traceback, outcomes[3]  # its partner names it
    first, second = (outcomes[rank].value["results"] for rank in (0, 1))
    assert first["writer"] and not second["writer"] and first["departed_trainers"] == [2, 3], first
    assert first["steps"] == STEPS and first["steps_by_trainer"] == [STEPS, STEPS], first
    assert first["sync"]["replica_groups_lost"] == 1, first["sync"]
    assert first["dense_replica_max_abs_diff"] == 0.0, first  # group 0's two ranks
    # each table shard's replica group is group 0's rank alone now: no replica to compare, but the
    # table rounds ran with group 1 until it was lost
    assert first["table_replica_max_abs_diff"] is None and first["sync"]["table_rounds"] > 0, first
    assert [rank["rank"] for rank in first["resources"]["by_rank"]] == [0, 1], first["resources"]
