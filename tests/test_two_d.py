"""The 2D layout (`sync.sharding_group_size`): 2 replica groups x 2 ranks on gloo.

One spawned group of 4 ranks runs every job that ends normally, one after another (`run_shared`):
TorchRec's `TrainPipelineSparseDist` over a tiny DMP through the one factory, in shadow mode (with a
live control file) and in foreground mode (tables built apart made one at the start, replicas
identical at the end, tables and dense, and the table counters); the
harness's exact-resume case (foreground BMUF stopped and resumed == uninterrupted); and a NaN
replica. Jobs whose ranks fail on purpose each get a group of their own. Those groups mostly wait
(for a timeout, a dead or stopped peer), so a module fixture (`spawned`) runs them and the shared
group side by side.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shadowgba.shadow.tables import Picked, TableFragments, TableShard, TableSyncConfig, plan_fragments
from tests.multiprocess import CaseResults, RankOutcome, run_concurrently, run_ranks, run_ranks_outcomes, run_shared

pytestmark = pytest.mark.timeout(300)  # the first test to read `spawned` waits for all of its jobs

STEPS = 40


def _pipeline_job(rank: int, world_size: int, options: dict[str, Any], fault: tuple[str, int, int] | None = None
                  ) -> dict[str, Any]:
    """TinyRec (2 tables, row-wise Adagrad fused in backward) in 2 groups of 2 through `join` /
    `dense_sync` on TorchRec's train pipeline. `fault = (kind, rank, step)`: that rank raises
    (`fail`), SIGKILLs itself (`kill`), stops itself for good (`stop`: SIGSTOP, a stalled rank) or
    turns its dense weights, table rows and their optimizer state NaN (`nan`) after that step. Returns the final table shards, dense weights and metrics (or the error)."""
    from torchrec.distributed import TrainPipelineSparseDist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    import shadowgba
    from dlrm.faults import InjectedFailure
    from shadowgba.integrations.torchrec import dense_named_parameters, fused_table_shards
    from tests import tiny_dmp

    config = shadowgba.SyncConfig(**{"sharding_group_size": 2, "interval_ms": 5.0, "first_round_after": 2,
                                     "foreground_every": 3, "timeout_s": 20.0, "log_interval_s": 0.0, **options})
    job = shadowgba.join(config)
    torch.manual_seed(rank)  # tables built apart: the start must make the replicas one
    model = tiny_dmp.TinyRec()
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.1})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), **job.dmp_kwargs())
    dense = dict(dense_named_parameters(dmp))
    optimizer = KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=0.05))
    pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
    batches = iter([tiny_dmp.batch(rank, index) for index in range(STEPS)])
    out: dict[str, Any] = {"error": None, "fired": None}

    def after_step() -> None:
        step = sync.metrics.steps
        if fault is None or fault[1] != rank or step != fault[2]:
            return
        out["fired"] = step
        if fault[0] == "fail":
            raise InjectedFailure(f"injected failure on rank {rank} after step {step}")
        if fault[0] in ("kill", "stop"):
            os.kill(os.getpid(), signal.SIGKILL if fault[0] == "kill" else signal.SIGSTOP)
        with torch.no_grad():  # nan: a diverged replica, dense weights, table rows and their optimizer state alike
            next(iter(dense.values())).view(-1)[:3] = float("nan")
            for tensor in fused_table_shards(dmp)[0].tensors:
                tensor[:2] = float("nan")

    built = [tensor.clone() for shard in fused_table_shards(dmp) for tensor in shard.tensors]
    try:
        with shadowgba.dense_sync(dmp, optimizer, job) as sync:
            out["start"] = {"built": built,
                            "started": [tensor.clone() for shard in fused_table_shards(dmp) for tensor in shard.tensors]}
            with contextlib.suppress(StopIteration):
                while True:
                    pipeline.progress(batches)
                    after_step()
    except Exception as error:  # what the user's loop sees: the fault tests assert on it
        out["error"] = f"{type(error).__name__}: {error}"
        out["blamed"] = (type(error).__name__, tuple(getattr(error, "ranks", ())))
        for note in getattr(error, "__notes__", ()):
            out["error"] += f"\n{note}"
        return out
    shards = fused_table_shards(dmp)
    return out | {"tables": [tensor.clone() for shard in shards for tensor in shard.tensors],
                  "table_weights": [shard.tensors[0].clone() for shard in shards],
                  "dense": [param.detach().clone() for param in dense.values()], "metrics": sync.metrics.summary(),
                  "pacing": (sync.interval_ms, sync.interval_steps)}


def _resume_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The harness in the 2D layout, foreground BMUF: 8 steps uninterrupted, and 4 steps + a resume
    to 8 from the checkpoint of step 4, in new jobs of the same processes."""
    from train_dlrm import run

    from dlrm.checkpoints import CheckpointOptions
    from dlrm.config import ExperimentConfig
    from shadowgba.config import load_config
    from tests.test_checkpoint import REPO, SMALL

    def _config(_: Any, steps: int) -> ExperimentConfig:
        overrides = ["--sync.mode", "foreground", *SMALL, "--sync.foreground_every", "3",
                     "--data.synthetic.eval_batches", "4", "--train.steps", str(steps)]  # a multiple of 4 trainers
        return load_config(ExperimentConfig, REPO / "examples/configs/bmuf_2d.yaml", overrides)

    torch.set_num_threads(1)
    args = None
    full = run(_config(args, 8), torch.device("cpu"), "gloo", CheckpointOptions(Path(root, "whole"), 4))
    run(_config(args, 4), torch.device("cpu"), "gloo", CheckpointOptions(Path(root, "split"), 4))
    resumed = run(_config(args, 8), torch.device("cpu"), "gloo", CheckpointOptions(Path(root, "split"), 4, resume=True))
    keys = ("steps", "log_loss", "auc", "dense_replica_max_abs_diff", "table_replica_max_abs_diff")
    return {"full": {key: full[key] for key in keys}, "resumed": {key: resumed[key] for key in keys},
            "resumed_from": resumed["checkpoint"]["resumed_from_step"]}


CONTROL = "interval_ms: 7\ninterval_steps: 3\n"
"""The live control file of the shadow case (configured: 5 ms, 0 steps): every rank must take it."""


@pytest.fixture(scope="module")
def four_ranks(spawned: CaseResults) -> dict[str, list]:
    """The jobs that end normally, by name: one after another in one group of 4 ranks (`spawned`)."""
    return spawned["four_ranks"]


def _max_diff(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("case", ["bmuf-shadow", "ma-foreground"])
def test_a_2x2_job_on_the_train_pipeline_ends_with_identical_replicas(four_ranks: dict, case: str) -> None:
    results = four_ranks[case]
    assert all(result["error"] is None for result in results), [result["error"] for result in results]
    for rank in range(1, 4):  # the dense replicas: every rank holds one
        assert _max_diff(results[0]["dense"], results[rank]["dense"]) == 0.0
    for first, partner in ((0, 2), (1, 3)):  # same position, other group: replicas of the same shards
        assert _max_diff(results[first]["tables"], results[partner]["tables"]) == 0.0
    metrics = results[0]["metrics"]
    # shadow mode: a fragment per round, here many per cycle; foreground: a cycle per round; both
    # end with the final sync's whole cycle
    assert metrics["table_rounds"] >= metrics["table_cycles"] >= (1 if case == "bmuf-shadow" else STEPS // 3)
    assert metrics["fragment_age_steps_max"] == 0  # the final sync has just averaged every fragment
    assert metrics["memory_bytes"] > 0 and metrics["table_bytes_moved"] > 0


def test_table_replicas_built_apart_start_as_their_replica_groups_first_rank_built_them(four_ranks: dict) -> None:
    """Each rank seeds its own tables (`torch.manual_seed(rank)`): the start broadcasts them."""
    starts = [result["start"] for result in four_ranks["bmuf-shadow"]]
    for first, partner in ((0, 2), (1, 3)):
        assert _max_diff(starts[first]["built"], starts[partner]["built"]) > 0.0
        assert _max_diff(starts[partner]["started"], starts[first]["built"]) == 0.0
        assert _max_diff(starts[first]["started"], starts[first]["built"]) == 0.0


def test_every_rank_of_a_2d_job_takes_the_live_control_file(four_ranks: dict) -> None:
    assert [result["pacing"] for result in four_ranks["bmuf-shadow"]] == [(7.0, 3)] * 4


def test_the_bounded_fragments_rotate_over_many_rounds_in_shadow_mode(four_ranks: dict) -> None:
    metrics = four_ranks["bmuf-shadow"][0]["metrics"]
    assert metrics["table_rounds"] > 2 * metrics["table_cycles"]  # 1e-4 MiB: several fragments per table


def test_fragments_cover_every_row_exactly_once_per_cycle() -> None:
    shards = [TableShard("a", (torch.zeros(10, 4), torch.zeros(10))), TableShard("b", (torch.zeros(7, 3),)),
              TableShard("huge_rows", (torch.zeros(3, 50),)), TableShard("tiny", (torch.zeros(2, 2),))]
    for budget in (1, 5, 12, 13, 40, 1000):
        fragments = plan_fragments(shards, budget)
        rows = [(part.shard, row) for fragment in fragments for part in fragment.rows for row in range(part.start, part.stop)]
        assert rows == [(index, row) for index, shard in enumerate(shards) for row in range(shard.rows)], budget
        for fragment in fragments:  # within the budget, unless one row alone exceeds it
            single_row = len(fragment.rows) == 1 and fragment.rows[0].stop - fragment.rows[0].start == 1
            assert fragment.numel(shards) <= budget or single_row, (budget, fragment)
    assert len(plan_fragments(shards, 1000)) == 1  # small tables share one fragment: one round per cycle


def picked_rows(tables: TableFragments) -> list[tuple[int, int]]:
    """(shard, row) of every row the queued touched-rows cycle holds, in order."""
    return [(part.shard, int(row)) for fragment in tables.queue for part in fragment.rows
            if isinstance(part, Picked) for row in part.index]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_touched_rows_cycle_takes_exactly_the_rows_touched_since_their_last_average(dtype: torch.dtype) -> None:
    """One rank (its sum is its own mask): a shard with a per-row optimizer state and one without,
    both fragments of 2 rows; float16 tables too (the fragment buffer is float32). Steps flag the
    rows they update (`TouchedRows.mark`: a fused kernel's lookups do, `fused_table_shards`)."""
    weights, state, other = torch.zeros(10, 4, dtype=dtype), torch.zeros(10, dtype=dtype), torch.zeros(7, 3, dtype=dtype)
    shards = [TableShard("a", (weights, state)), TableShard("b", (other,))]
    tables = TableFragments(shards, None, TableSyncConfig(fragment_mb=10 * 4 / 2**20))  # 10 values: 2 rows of "a"
    assert tables.touched is not None
    tables.plan_touched_cycle()
    assert tables.queue == []  # nothing touched since the start

    def step(shard: int, row: int, *updates: tuple[torch.Tensor, float]) -> None:
        tables.touched.mark(shard, torch.tensor([row]))
        for tensor, value in updates:
            tensor[row] += value

    step(0, 3, (weights, 1.0), (state, 1.0))
    step(0, 8, (weights, 2.0), (state, 0.5))
    step(1, 5, (other, 1.0))
    tables.plan_touched_cycle()
    assert picked_rows(tables) == [(0, 3), (0, 8), (1, 5)]
    assert [fragment.closes_cycle for fragment in tables.queue] == [False, True]
    flat = torch.zeros_like(tables.buffer)
    tables.copy_to(flat)  # rows 3 and 8 of "a": their weights, then their state
    assert flat[:10].tolist() == [1, 1, 1, 1, 2, 2, 2, 2, 1, 0.5]
    step(0, 8, (state, 1.0))  # row 8 trained on while its round was in flight
    tables.add_(torch.full_like(flat, 0.25))  # the delta avg - s of both rows
    assert weights[3].tolist() == [1.25] * 4 and state.tolist()[3] == 1.25 and state.tolist()[8] == 1.75
    tables.mark_applied(step=5)
    assert tables.cycles == 0  # the cycle's second fragment is still to come
    tables.copy_to(flat)  # row 5 of "b"
    assert flat[:3].tolist() == [1, 1, 1] and not flat[3:].any()
    tables.add_(torch.full_like(flat, -0.5))
    tables.mark_applied(step=6)
    assert tables.cycles == 1 and tables.ages(step=6) == (0, 0.0)
    tables.plan_touched_cycle()  # only row 8 was updated since its cycle was planned (in flight)
    assert picked_rows(tables) == [(0, 8)]
    tables.copy_to(flat)
    tables.add_(torch.zeros_like(flat))
    tables.plan_touched_cycle()
    assert tables.queue == []  # the average itself flags nothing
    step(1, 2, (other, 1.0))
    tables.plan_touched_cycle()
    tables.copy_to(flat)  # row 2 of "b" in flight when its partners restart the rotation (a rejoin):
    tables.restart_rotation()  # it goes to the next cycle
    tables.plan_touched_cycle()
    assert picked_rows(tables) == [(1, 2)]
    tables.start_full_cycle()  # the final sync goes through every row, in the fixed fragments
    tables.copy_to(flat)
    assert tables.current is tables.fragments[0]


def test_a_resumed_2d_job_equals_the_uninterrupted_one(four_ranks: dict) -> None:
    result = four_ranks["resume"][0]
    full, resumed = result["full"], result["resumed"]
    assert result["resumed_from"] == 4 and full["steps"] == resumed["steps"] == 8
    assert resumed["log_loss"] == pytest.approx(full["log_loss"], abs=1e-7)  # held-out: tables and dense
    assert resumed["auc"] == pytest.approx(full["auc"], abs=1e-9)
    for run in (full, resumed):
        assert run["dense_replica_max_abs_diff"] == 0.0 and run["table_replica_max_abs_diff"] == 0.0


def test_a_nan_replica_is_healed_by_its_partners_and_every_rank_finishes(four_ranks: dict) -> None:
    """Rank 1 (group 0) turns NaN, dense weights, table rows and their row-wise Adagrad state, after
    step 10 (a round every 3 steps). Until the next round its steps are skipped, and so are its group
    partner's, which read its NaN rows through the all-to-all; nothing NaN leaves either. That round
    heals it: its dense weights take the others' average, its NaN fragment the rows and optimizer
    state of its replica partner (rank 3). Then every rank trains on to the end, and the replicas end
    identical and finite."""
    _assert_healed_once(four_ranks["nan"], "tables")


def test_a_nan_replica_whose_table_state_is_not_averaged_starts_that_state_afresh(four_ranks: dict) -> None:
    """The same fault under `sync.tables.optimizer_state: false`: the rounds average the table rows
    alone, so the heal cannot take the partner's row state. The healed rows' state starts afresh (a
    new fused optimizer's, zero) instead of keeping its NaN, which would turn the rows NaN again at
    their next update, round after round. The replicas end with identical rows, and every rank finite."""
    _assert_healed_once(four_ranks["nan-weights-averaged-alone"], "table_weights")


def _assert_healed_once(results: list[dict], averaged: str) -> None:
    """`results[rank][averaged]`: what the table rounds average (rows and state, or rows alone)."""
    assert results[1]["fired"] == 10 and all(result["fired"] is None for index, result in enumerate(results) if index != 1)
    assert all(result["error"] is None for result in results), [result["error"] for result in results]
    for result in results:
        assert all(torch.isfinite(tensor).all() for tensor in result["dense"] + result["tables"])
        assert result["metrics"]["steps"] == STEPS
    healed = [result["metrics"]["nonfinite_replicas_healed"] for result in results]
    assert healed[1] == 2 and healed[0] == healed[2] == healed[3] == 0, healed  # its dense weights, one fragment
    assert results[1]["metrics"]["nonfinite_steps_skipped"] == 2  # steps 11 and 12, until the round at 12
    for rank in (2, 3):  # the other group saw rank 1 left out of the round that healed it
        assert results[rank]["metrics"]["nonfinite_rounds_skipped"] > 0
        assert results[rank]["metrics"]["nonfinite_steps_skipped"] == 0
    for rank in range(1, 4):
        assert _max_diff(results[0]["dense"], results[rank]["dense"]) == 0.0
    for first, partner in ((0, 2), (1, 3)):
        assert _max_diff(results[first][averaged], results[partner][averaged]) == 0.0


STALL_TIMEOUT_S = 6.0
"""`sync.timeout_s` of the stalled-rank case: every collective the others wait in gives up after it."""
FAILURES = [("fail", 2), ("kill", 3), ("stop", 1)]
"""(kind, failing rank) of `test_a_failure_in_one_group_ends_every_rank_naming_it`."""
GROUP_LOSSES = [("stop", 1)]
"""(kind, failing rank) of `test_under_continue_a_lost_group_drops_out_and_the_other_trains_on`."""


def _failing_job(options: dict[str, Any], fault: tuple[str, int, int], by_hand: bool) -> tuple[list[RankOutcome], float]:
    """`_pipeline_job` with `fault` on 4 ranks: every rank's outcome, and the seconds the job took."""
    started = time.monotonic()
    outcomes = run_ranks_outcomes(_pipeline_job, 4, options, fault, timeout_s=120,
                                  stopped_for_good=fault[0] == "stop", by_hand=by_hand)
    return outcomes, time.monotonic() - started


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> CaseResults:
    """Every spawned job of this file, all at once (`run_concurrently`): "four_ranks", the jobs that
    end normally, one after another in one group of 4 ranks (`run_shared`); and the jobs whose ranks
    fail on purpose at step 8, each in a group of its own: each of FAILURES by "kind-rank" (ma,
    `sync.timeout_s` at the configured 20 s, or STALL_TIMEOUT_S for a stopped rank; the ranks
    started by hand), each of GROUP_LOSSES by "continue-kind-rank" (bmuf under `sync.on_group_lost:
    continue`, `sync.timeout_s` STALL_TIMEOUT_S).

    Every job builds TorchRec's model on 4 ranks before it trains, and a healthy rank starved past
    STALL_TIMEOUT_S would read as lost; yet the failing jobs side by side kept every assertion in 11
    runs of 11 (4 of them beside the shared group) on 2 cores shared with other work (load average
    4 to 11): past the start, they wait, and the shared group's training fills that time."""
    control = tmp_path_factory.mktemp("two_d_control") / "control.yaml"
    control.write_text(CONTROL)
    jobs = {"four_ranks": functools.partial(run_shared, 4, {
        "bmuf-shadow": (_pipeline_job, ({"algo": "bmuf", "tables": TableSyncConfig(fragment_mb=1e-4),
                                         "control_file": str(control)},)),
        "ma-foreground": (_pipeline_job, ({"algo": "ma", "mode": "foreground"},)),
        "nan": (_pipeline_job, ({"algo": "ma", "mode": "foreground"}, ("nan", 1, 10))),
        "nan-weights-averaged-alone": (_pipeline_job, ({"algo": "ma", "mode": "foreground",
                                                        "tables": TableSyncConfig(optimizer_state=False)}, ("nan", 1, 10))),
        "resume": (_resume_job, (str(tmp_path_factory.mktemp("two_d")),)),
    }, 200)}
    jobs |= {f"{kind}-{failing}": functools.partial(
        _failing_job, {"algo": "ma", **({"timeout_s": STALL_TIMEOUT_S} if kind == "stop" else {})}, (kind, failing, 8),
        True) for kind, failing in FAILURES}
    jobs |= {f"continue-{kind}-{failing}": functools.partial(
        _failing_job, {"algo": "bmuf", "on_group_lost": "continue", "timeout_s": STALL_TIMEOUT_S}, (kind, failing, 8),
        False) for kind, failing in GROUP_LOSSES}
    return run_concurrently(jobs)


@pytest.mark.parametrize(("kind", "failing"), FAILURES)
def test_a_failure_in_one_group_ends_every_rank_naming_it(spawned: CaseResults, kind: str, failing: int) -> None:
    """An exception in group 1's loop, a SIGKILLed rank of group 1, or a rank of group 0 stopped for
    good (SIGSTOP, its sockets open), the ranks started by hand (no torchrun agent to end the others;
    rank 0's process hosts the store they met at, and often ends first): every other rank, in both
    groups, raises within the timeout, and its error is `PeerLost` naming the failed rank, and no
    other, whichever rank ended first: a rank that ended after it learned of the failure (its
    partner, whose collective failed first) is never named, and the cause stays readable in the
    job's own store (`shadowgba.job.store`) once rank 0 is gone."""
    outcomes, took_s = spawned[f"{kind}-{failing}"]
    failed = outcomes[failing]
    if kind == "stop":  # every other rank ended on its own, well before the harness's deadline
        assert failed.stopped and took_s < 60
    elif kind == "kill":
        assert failed.killed
    else:
        assert failed.returned and failed.value["fired"] == 8 and "injected failure on rank 2" in failed.value["error"]
    for rank, outcome in enumerate(outcomes):
        if rank == failing:
            continue
        assert outcome.returned, (rank, outcome)
        error = outcome.value["error"]
        assert error is not None and f"rank {failing}" in error, (rank, outcome.value)
        assert outcome.value["blamed"] == ("PeerLost", (failing,)), (rank, outcome.value)
        healthy = [f"rank {other}" for other in range(4) if other != failing]
        assert not [name for name in healthy if name in error], (rank, error)  # message and notes


@pytest.mark.parametrize(("kind", "failing"), GROUP_LOSSES)
def test_under_continue_a_lost_group_drops_out_and_the_other_trains_on(spawned: CaseResults, kind: str,
                                                                       failing: int) -> None:
    """`sync.on_group_lost: continue`: rank 1 stops for good (the others' rounds time out; its
    heartbeat has stopped). Its group ends, its partner naming it; the other group trains every
    step, drops the lost group from its rounds and ends with its two dense replicas identical and
    finite. (A rank whose loop raises, the aborted-flag path: `tests/test_survivors.py`.)"""
    outcomes, _ = spawned[f"continue-{kind}-{failing}"]
    lost_group = failing // 2
    partner, survivors = (1 - failing % 2) + 2 * lost_group, [rank for rank in range(4) if rank // 2 != lost_group]
    if kind == "stop":
        assert outcomes[failing].stopped
    else:
        assert outcomes[failing].returned and outcomes[failing].value["fired"] == 8
        assert "injected failure on rank 2" in outcomes[failing].value["error"]
    assert outcomes[partner].returned and f"rank {failing}" in outcomes[partner].value["error"], outcomes[partner]
    for rank in survivors:
        assert outcomes[rank].returned and outcomes[rank].value["error"] is None, (rank, outcomes[rank])
        metrics = outcomes[rank].value["metrics"]
        assert metrics["steps"] == STEPS and metrics["replica_groups_lost"] == 1, metrics
        assert all(torch.isfinite(tensor).all() for tensor in outcomes[rank].value["dense"])
    first, second = (outcomes[rank].value for rank in survivors)
    assert _max_diff(first["dense"], second["dense"]) == 0.0  # the final average ran over the survivors


def _a_small_update_after_a_large_one(rank: int, world_size: int) -> dict[str, Any]:
    """TinyRec's tables on one rank (row-wise Adagrad fused in backward, lr 0.1) and their touched
    rows (`TableFragments`) from after a large update of row 3 of t0 (gradient 1000, its Adagrad sum
    1e6) on: a small update of the same row (gradient 1e-3) moves its weights by 1e-7 while its sum
    grows by 1e-6, which float32 rounds away (an ulp of 1e6 is 0.06). Returns how much the row moved
    and the rows the next touched-rows cycle takes."""
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from shadowgba.integrations.torchrec import fused_table_shards
    from tests import tiny_dmp

    model = tiny_dmp.TinyRec()
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.1})
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), constraints={
        table: ParameterConstraints(compute_kernels=["fused"]) for table in tiny_dmp.TABLES})
    plan = planner.plan(model, [EmbeddingBagCollectionSharder()])
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan)
    row = KeyedJaggedTensor.from_lengths_sync(keys=list(tiny_dmp.TABLES), values=torch.tensor([3, 7]),
                                              lengths=torch.tensor([1, 1], dtype=torch.int32))

    def update(gradient: float) -> None:
        (gradient * dmp.module.ebc(row).values()).sum().backward()

    update(1000.0)
    shards = fused_table_shards(dmp)
    tables = TableFragments(shards, None, TableSyncConfig())
    before = [shard.tensors[0][index].clone() for shard, index in zip(shards, (3, 7))]
    update(1e-3)
    with torch.no_grad():  # an evaluation looks rows up and updates none
        dmp.module.ebc(KeyedJaggedTensor.from_lengths_sync(keys=list(tiny_dmp.TABLES), values=torch.tensor([5, 9]),
                                                           lengths=torch.tensor([1, 1], dtype=torch.int32)))
    tables.plan_touched_cycle()
    tables.close()
    return {"moved": [(shard.tensors[0][index] - old).abs().max().item()
                      for shard, index, old in zip(shards, (3, 7), before)], "picked": picked_rows(tables)}


def test_a_row_whose_update_rounds_its_adagrad_sum_to_no_change_is_still_taken() -> None:
    [result] = run_ranks(_a_small_update_after_a_large_one, 1, timeout_s=60)
    assert result["moved"][0] > 0  # the row moved
    assert result["picked"] == [(0, 3), (1, 7)], result
