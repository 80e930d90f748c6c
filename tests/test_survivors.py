"""Survivors finish cleanly: a trainer that departed, or a replica group lost, costs only its own work.

The harness (`benchmarks/train_dlrm.py`) runs GBA with the tables on the server, 2 trainers and 1
server, `sync.ps.on_trainer_lost: continue` (the default). Trainer 1 stops for good (SIGSTOP, never
continued) after step 10; the server marks it departed after `sync.ps.trainer_timeout_s`, and
trainer 0 trains on to the end. What follows training (the barrier that its row gradients landed,
the throughput window, the replica check, held-out evaluation, the resources) runs on the
survivors (`Job.survivors`), so trainer 0 writes the result instead of waiting in a collective
with the stopped process until it times out naming nobody.

The same harness in the 2D layout (ma, 2 groups of 2) under `sync.on_group_lost: continue`, its
ranks started by hand (rank 0's process hosts the store they meet at): a group is lost at step 10
(a rank killed, raising, or SIGTERMed; the group holding the store among them); the other trains to
the end on rounds rebuilt without it, and writes the result. A replica check over a group of one
member (trainer 0 alone under GBA; each table shard's replica group once a group is lost) has
nothing to compare and reports None, not a vacuous 0.0.

Each job waits most of its time (for `sync.timeout_s` to name a stopped rank, for the survivors to
agree on a loss), so a module fixture (`jobs`) runs them side by side.
"""

from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiprocess import CaseResults, RankOutcome, run_concurrently, run_ranks_outcomes

pytestmark = pytest.mark.timeout(300)  # the first test to read `jobs` waits for all of them

REPO = Path(__file__).resolve().parents[1]
STOP_AT, STEPS, TIMEOUT_S = 10, 80, 4.0
GROUP_LOSSES = [("kill", 0), ("fail", 1), ("term", 1), ("fail", 2)]
"""(kind, failing rank) of `test_the_survivors_of_any_2d_groups_loss_write_the_result_when_rank_0_hosted_the_store`."""


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


def _stopped_trainer(fault_log: Path) -> list[RankOutcome]:
    """GBA with PS-hosted tables, 2 trainers and 1 server: trainer 1 stops for good at STOP_AT."""
    servers = [part for key in ("rpc_timeout_s", "trainer_timeout_s") for part in (f"--sync.ps.{key}", str(TIMEOUT_S))]
    return run_ranks_outcomes(_harness_with_a_fault, 3, "gba_ps_embeddings.yaml", f"stop:1:{STOP_AT}",
                              str(fault_log), servers, timeout_s=150, stopped_for_good=True)


def _lost_group(kind: str, failing: int, fault_log: Path) -> list[RankOutcome]:
    """ma in 2 groups of 2, `sync.on_group_lost: continue`, the ranks started by hand: rank `failing`
    meets fault `kind` at STOP_AT."""
    return run_ranks_outcomes(_harness_with_a_fault, 4, "ma_2d.yaml", f"{kind}:{failing}:{STOP_AT}",
                              str(fault_log), ["--sync.on_group_lost", "continue"], timeout_s=150, by_hand=True)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> CaseResults:
    """Every job of this file, all at once (`run_concurrently`), each with its fault log in a folder
    of its own: (every rank's outcome, the fault log). "stopped": a trainer stopped for good;
    "kind-rank": each of GROUP_LOSSES.

    Every rank runs the whole harness (data, model, 80 steps, evaluation) under a `sync.timeout_s`
    of TIMEOUT_S, and a healthy rank starved that long would read as lost; yet the 19 ranks side by
    side kept every assertion in 8 runs of 8 on 2 cores shared with other work (load average 4 to
    15): the harness's steps are small, its time is the faults' timeouts."""
    runs = {"stopped": _stopped_trainer, **{f"{kind}-{failing}": functools.partial(_lost_group, kind, failing)
                                            for kind, failing in GROUP_LOSSES}}
    logs = {name: tmp_path_factory.mktemp(name) / "faults.jsonl" for name in runs}  # here: the factory is not thread-safe

    def job(name: str) -> tuple[list[RankOutcome], Path]:
        return runs[name](logs[name]), logs[name]

    return run_concurrently({name: functools.partial(job, name) for name in runs})


def test_a_trainer_stopped_for_good_costs_the_harness_only_its_own_work(jobs: CaseResults) -> None:
    outcomes, fault_log = jobs["stopped"]
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


@pytest.mark.parametrize(("kind", "failing"), GROUP_LOSSES)
def test_the_survivors_of_any_2d_groups_loss_write_the_result_when_rank_0_hosted_the_store(
        jobs: CaseResults, kind: str, failing: int) -> None:
    """Ranks started by hand (rank 0's process hosts the store they met at), ma in 2 groups of 2,
    `sync.on_group_lost: continue`. The group holding the store is lost: rank 0 itself killed, rank 1
    raising (rank 0 then ends too, its all-to-all broken), or rank 1 stopped by SIGTERM; or group 1
    is, rank 2 raising. The other group's ranks still agree on the loss, rebuild their rounds, meet
    after training, evaluate and write the result: the job's decisions live in a store of its own
    (`shadowgba.job.store`), not in rank 0's process."""
    outcomes, fault_log = jobs[f"{kind}-{failing}"]
    assert fired(fault_log) == [(kind, failing, STOP_AT)]
    lost_group = failing // 2
    partner = 4 * lost_group + 1 - failing
    survivors = [rank for rank in range(4) if rank // 2 != lost_group]
    if kind == "fail":
        assert "InjectedFailure" in outcomes[failing].traceback, outcomes[failing]  # the user's exception, as raised
    else:
        signal_number = {"kill": signal.SIGKILL, "term": signal.SIGTERM}[kind]
        assert outcomes[failing].killed and outcomes[failing].exitcode == -signal_number, outcomes[failing]
    assert outcomes[partner].traceback is not None and f"rank {failing}" in outcomes[partner].traceback, outcomes[partner]
    assert "could not reach the job's store" not in outcomes[partner].traceback, outcomes[partner]
    assert all(outcomes[rank].returned for rank in survivors), "\n".join(
        f"rank {rank}: {outcomes[rank].traceback}" for rank in survivors)
    first, second = (outcomes[rank].value["results"] for rank in survivors)
    assert first["writer"] and not second["writer"] and first["departed_trainers"] == [2 * lost_group, 2 * lost_group + 1], first
    assert first["steps"] == STEPS and first["steps_by_trainer"] == [STEPS, STEPS], first
    assert first["sync"]["replica_groups_lost"] == 1, first["sync"]
    assert first["dense_replica_max_abs_diff"] == 0.0, first  # the surviving group's two ranks
    # each table shard's replica group is the surviving group's rank alone now: no replica to compare,
    # but the table rounds ran with the lost group until it was lost
    assert first["table_replica_max_abs_diff"] is None and first["sync"]["table_rounds"] > 0, first
    assert [rank["rank"] for rank in first["resources"]["by_rank"]] == survivors, first["resources"]


def test_continue_under_a_torchrun_agent_of_several_groups_is_warned_about_once_per_agent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's agent ends every rank it started once one fails, so `continue` keeps no group
    going where one agent started ranks of several groups (one torchrun job for all of them): its
    first worker says so at `join`. One agent per group (`--nnodes 2 --nproc-per-node 2`), or no
    torchrun, is not warned about."""
    from shadowgba.job.survivors import launch_warning

    def torchrun(rank: int, local_rank: int, local_world_size: int) -> None:
        for name, value in (("TORCHELASTIC_RUN_ID", "job"), ("RANK", rank), ("LOCAL_RANK", local_rank),
                            ("LOCAL_WORLD_SIZE", local_world_size)):
            monkeypatch.setenv(name, str(value))

    torchrun(0, 0, 4)  # torchrun --standalone --nproc-per-node 4, groups of 2
    warning = launch_warning(0, 2)
    assert warning is not None and "this torchrun agent started ranks 0-3, of replica groups 0-1" in warning
    assert "one torchrun agent per replica group" in warning
    torchrun(1, 1, 4)
    assert launch_warning(1, 2) is None  # said once, by the agent's first worker
    torchrun(2, 0, 2)  # the second of two agents, one a group
    assert launch_warning(2, 2) is None
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert launch_warning(0, 2) is None
