"""NaN / Inf stopped on the trainer where it starts (`shadowgba.nonfinite`), tables included.

One trainer's dense weights turn NaN (`dlrm.faults`' `nan` fault, after step NAN_STEP): its forward,
loss and every gradient are NaN from then on. Before the guard, TorchRec's backward all-to-all carried
its NaN embedding gradients to the table shards of every trainer, and from them every replica went
NaN; PS-hosted tables refused the rows and ended the job even under `skip`. The spawned group (3
ranks, `tiny_dmp`'s model, wired as a user does: `join` + `dense_sync`) runs, in this order:

- gba in GBA mode over TorchRec-sharded tables (2 trainers + 1 server), skip: the bad trainer's
  pushes are dropped, it installs the shards' parameters and trains on; the job finishes.
- gba in GBA mode over PS-hosted tables (2 trainers + 1 server), skip: the same, and its row pushes
  are dropped and counted by the server instead of ending the job.
- easgd_ps (2 trainers + 1 server holding the centre, a round every step) under skip: the bad
  trainer's snapshot never reaches the centre, and it takes the centre, read unmoved, in its place.
- ma (3 trainers, a round every step) under fail: the bad trainer's own error names it and what
  was caught; every other trainer's names it, and only it.
- ma under skip with `max_skipped_steps` 3, trained by TorchRec's `TrainPipelineSparseDist` (it calls
  the sharded tables' `compute_and_output_dist` itself, where the hook sits): the bad trainer skips
  its step, takes the others' average at the round after it (healed), and trains on to the end.
- the same with every trainer's weights NaN: no healthy replica exists, so no round heals anyone and
  `max_skipped_steps` is the backstop: each trainer skips three steps, then ends naming itself.

Every job but the last: the fault fired on trainer 1 alone, and every other trainer's dense weights
and table shards (or the server's tables) end finite. The ma jobs come last: a trainer that ends by
an error may leave a peer in TorchRec's all-to-all until its process exits.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

import shadowgba
from dlrm.faults import FaultInjector
from shadowgba.config import from_dict
from shadowgba.errors import SyncError
from shadowgba.integrations.torchrec import dense_named_parameters
from shadowgba.nonfinite import NonFiniteGuard
from tests import tiny_dmp
from tests.multiprocess import run_shared

pytestmark = pytest.mark.timeout(240)

NAN_STEP = 4
GBA_STEPS = 30
"""Steps of the GBA jobs: the bad trainer has time to install the shards' parameters and train on."""
MA_STEPS = 12


# ------------------------------------------------------------------------------------ the guard alone
def test_the_guard_zeroes_and_records_what_is_not_finite_and_fail_names_the_trainer() -> None:
    guard = NonFiniteGuard("trainer 1 (rank 1)", "fail")
    good, bad = torch.ones(3), torch.tensor([1.0, math.nan, 2.0])
    assert guard.clean(good, "embedding gradients of tables t0") is good and guard.end_step()
    assert torch.equal(guard.clean(bad, "embedding gradients of tables t0"), torch.zeros(3))
    assert not guard.check_all([good, torch.tensor([math.inf])], "dense gradients") and not guard.step_finite
    assert guard.caught == "embedding gradients of tables t0; dense gradients"
    with pytest.raises(SyncError, match=r"^trainer 1 \(rank 1\): NaN / Inf in its embedding gradients of tables t0; "
                                        r"dense gradients at its step 2; .*\(sync.on_nonfinite: fail\)"):
        guard.end_step()
    guard.note("dense gradients")
    guard.discard_step()  # the runtime raised for this step itself: the next one starts clean
    assert guard.step_finite and guard.end_step()
    guard.enabled = False  # its runtime ended: a hook left on the model passes values through
    assert guard.clean(bad, "embedding gradients") is bad


def test_under_skip_the_guard_counts_skipped_steps_and_a_run_of_them_ends_the_job() -> None:
    guard = NonFiniteGuard("trainer 0 (rank 0)", "skip", max_skipped_steps=3)
    for _ in range(2):
        guard.note("row gradients of PS-hosted tables")
        assert not guard.end_step()
    assert guard.end_step() and guard.streak == 0  # a clean step ends the run
    for _ in range(2):
        guard.note("dense gradients")
        assert not guard.end_step()
    guard.note("dense gradients")
    with pytest.raises(SyncError, match=r"trainer 0 \(rank 0\): NaN / Inf in its dense gradients at its step 6: "
                                        r"3 of its steps in a row skipped, .*sync.max_skipped_steps: 3"):
        guard.end_step()
    assert (guard.skipped_steps, guard.steps) == (5, 6)
    with pytest.raises(ValueError, match="max_skipped_steps must be an integer >= 1"):
        NonFiniteGuard("trainer 0", "skip", max_skipped_steps=0)


# ------------------------------------------------------------------------------ one bad trainer's job
def nan_job(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """One job of `case` on this rank: NaN written into trainer 1's dense weights after NAN_STEP;
    what this rank saw (error, metrics, finiteness of its weights and tables, the servers' counts)."""
    config = from_dict(shadowgba.SyncConfig, case["sync"])
    ps_tables = case["tables"] == "ps"
    tables = options = None
    if ps_tables:
        tables, options = tiny_dmp.table_configs(), shadowgba.ps_table_options(config, 2, tiny_dmp.BATCH)
    job = shadowgba.join(config, tables, options)
    if job.is_server:
        return {"role": "server"}
    if ps_tables:
        model: nn.Module = tiny_dmp.TinyRec(job.ps_embeddings())
        optimizer: Any = torch.optim.SGD(model.mlp.parameters(), lr=0.05)
        dense = list(model.mlp.parameters())
    else:
        model, optimizer = tiny_dmp.build(dmp_kwargs=job.dmp_kwargs())
        dense = [param for _, param in dense_named_parameters(model)]
    faults = FaultInjector(job.trainer_index, params=dense)
    for trainer in case.get("nan", [1]):
        faults.nan_at(trainer, NAN_STEP)
    record: dict[str, Any] = {"role": f"trainer {job.trainer_index}", "error": None, "steps": 0}
    sync = shadowgba.dense_sync(model, optimizer, job, local_batch_size=tiny_dmp.BATCH)
    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu")) if case.get("pipeline") else None
    batches = iter([tiny_dmp.batch(job.trainer_index, step) for step in range(case["steps"] + 2)])
    try:
        with sync:
            for step in range(case["steps"]):
                if pipeline is not None:
                    pipeline.progress(batches)  # forward, backward and optimizer.step of one batch
                else:
                    loss, _ = model(next(batches))
                    optimizer.zero_grad()
                    loss.backward()
                    if ps_tables:
                        model.ebc.push_gradients()
                    optimizer.step()
                record["steps"] = step + 1
                faults.after_step(step + 1)
            if ps_tables:  # the servers' counts, before the job ends
                model.ebc.flush()
                record["embedding_shards"] = model.ebc.server_stats()
                record["tables_finite"] = all(bool(torch.isfinite(model.ebc.read_table(t)).all())
                                              for t in tiny_dmp.TABLES)
            if config.algo == "gba":
                record["dense_shards"] = sync.server_stats()
    except Exception as error:  # noqa: BLE001 (what the rank saw is the test's evidence)
        record["error"] = {"type": type(error).__name__, "message": str(error), "ranks": getattr(error, "ranks", None),
                           "text": " ".join([str(error), *getattr(error, "__notes__", [])])}
    record["fired"] = [(fired["kind"], fired["trainer"], fired["step"]) for fired in faults.fired]
    record["metrics"] = sync.metrics.summary()
    record["streak"] = sync.guard.streak
    record["dense_finite"] = all(bool(torch.isfinite(param).all()) for param in dense)
    if not ps_tables:
        record["tables_finite"] = all(bool(torch.isfinite(shard.tensor).all()) for value in model.state_dict().values()
                                      if isinstance(value, ShardedTensor) for shard in value.local_shards())
    return record


def sync_section(algo: str, servers: int, **options: Any) -> dict[str, Any]:
    return {"algo": algo, "log_interval_s": 0.0, "timeout_s": 30.0,
            "ps": {"num_servers": servers, "rpc_timeout_s": 30.0, "trainer_timeout_s": 30.0},
            "gba": {"initial_mode": "gba", "switch_policy": {"enabled": False}}, **options}


JOBS = {
    "gba-torchrec": {"tables": "torchrec", "steps": GBA_STEPS, "sync": sync_section("gba", 1)},
    "gba-ps": {"tables": "ps", "steps": GBA_STEPS, "sync": sync_section("gba", 1)},
    "easgd_ps-skip": {"tables": "torchrec", "steps": MA_STEPS, "sync": sync_section(
        "easgd_ps", 1, mode="foreground", foreground_every=1, first_round_after=0, max_skipped_steps=3)},
    "ma-fail": {"tables": "torchrec", "steps": MA_STEPS, "sync": sync_section(
        "ma", 0, mode="foreground", foreground_every=1, first_round_after=0, on_nonfinite="fail")},
    "ma-skip": {"tables": "torchrec", "steps": MA_STEPS, "sync": sync_section(
        "ma", 0, mode="foreground", foreground_every=1, first_round_after=0, max_skipped_steps=3),
        "pipeline": True},
    "ma-skip-all": {"tables": "torchrec", "steps": MA_STEPS, "nan": [0, 1, 2], "sync": sync_section(
        "ma", 0, mode="foreground", foreground_every=1, first_round_after=0, max_skipped_steps=3)},
}


@pytest.fixture(scope="module")
def jobs() -> dict[str, list[dict[str, Any]]]:
    return run_shared(3, {name: (nan_job, (case,)) for name, case in JOBS.items()}, timeout_s=180)


def trainers(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [record for record in records if record["role"] != "server"]


def assert_names_rank_1_alone(error: dict[str, Any] | None) -> None:
    """An error of trainer 0 or 2: its message names rank 1 and no other; its notes (what peers
    posted before it failed, their own aborts included) blame NaN / Inf on no other rank."""
    assert error is not None and "rank 1" in error["message"], error
    assert "rank 0" not in error["message"] and "rank 2" not in error["message"], error
    for other in ("rank 0", "rank 2"):
        assert f"{other}): NaN" not in error["text"] and f"{other} sent NaN" not in error["text"], error


def assert_only_trainer_1_went_bad(records: list[dict[str, Any]]) -> None:
    """The fault fired on trainer 1 alone; every other trainer's weights and tables stayed finite and
    it skipped no step of its own."""
    for index, record in enumerate(trainers(records)):
        assert record["fired"] == ([("nan", 1, NAN_STEP)] if index == 1 else []), records
        if index != 1:
            assert record["dense_finite"] and record["tables_finite"], records
            assert record["metrics"]["nonfinite_steps_skipped"] == 0, records


@pytest.mark.parametrize("name", ["gba-torchrec", "gba-ps"])
def test_under_gba_a_bad_trainer_is_dropped_until_it_takes_the_shards_parameters_and_the_job_finishes(
        jobs: dict[str, list[dict[str, Any]]], name: str) -> None:
    records = jobs[name]
    assert_only_trainer_1_went_bad(records)
    first, bad = trainers(records)
    for record in (first, bad):
        assert record["error"] is None and record["steps"] == GBA_STEPS, records
        assert record["dense_finite"] and record["tables_finite"], records
    skipped = bad["metrics"]["nonfinite_steps_skipped"]
    assert skipped >= 1 and bad["streak"] == 0, records  # it trained on after installing finite parameters
    dense = first["dense_shards"][0]
    assert 1 <= dense["nonfinite_dropped"] <= skipped and dense["global_step"] >= GBA_STEPS // 2, records
    if name == "gba-ps":  # the NaN rows never reached the server: it dropped and counted the marked pushes
        tables = first["embedding_shards"][0]
        assert tables["nonfinite_dropped"] == skipped and tables["failure"] is None, records


def test_under_fail_the_bad_trainer_ends_the_job_and_every_error_names_it_alone(
        jobs: dict[str, list[dict[str, Any]]]) -> None:
    records = jobs["ma-fail"]
    assert_only_trainer_1_went_bad(records)
    bad = records[1]
    assert bad["error"]["type"] == "SyncError", records
    assert bad["error"]["text"].startswith(f"trainer 1 (rank 1): NaN / Inf in its embedding gradients of tables "
                                           f"t0, t1; dense gradients at its step {NAN_STEP + 1}"), records
    assert "unknown" not in bad["error"]["text"], records  # it named itself: nothing else to find
    for rank in (0, 2):  # a peer's failure: PeerLost naming the first failure, rank 1's, and no other rank
        error = records[rank]["error"]
        assert error["type"] == "PeerLost" and tuple(error["ranks"]) == (1,), (rank, error)
        assert "NaN" in error["message"], error
        assert_names_rank_1_alone(error)


def test_under_skip_the_bad_replica_takes_the_others_average_and_trains_on(
        jobs: dict[str, list[dict[str, Any]]]) -> None:
    records = jobs["ma-skip"]
    assert_only_trainer_1_went_bad(records)
    bad = records[1]
    assert bad["metrics"]["nonfinite_steps_skipped"] == 1 and bad["metrics"]["nonfinite_replicas_healed"] == 1, records
    for record in records:
        assert record["error"] is None and record["steps"] == MA_STEPS and record["dense_finite"], records
        assert record["metrics"]["nonfinite_rounds_skipped"] == 1, records  # one round left rank 1 out, and healed it
    assert bad["streak"] == 0 and records[0]["metrics"]["nonfinite_replicas_healed"] == 0, records


def test_under_skip_an_easgd_ps_trainer_gone_bad_takes_the_centre_and_trains_on(
        jobs: dict[str, list[dict[str, Any]]]) -> None:
    records = jobs["easgd_ps-skip"]
    assert_only_trainer_1_went_bad(records)
    first, bad = trainers(records)
    assert bad["metrics"]["nonfinite_steps_skipped"] == 1 and bad["metrics"]["nonfinite_replicas_healed"] == 1, records
    for record in (first, bad):
        assert record["error"] is None and record["steps"] == MA_STEPS and record["dense_finite"], records
    assert first["metrics"]["nonfinite_rounds_skipped"] == 0, records  # no collective: trainer 0 saw nothing


def test_under_skip_with_no_healthy_replica_every_trainer_ends_naming_itself(
        jobs: dict[str, list[dict[str, Any]]]) -> None:
    records = jobs["ma-skip-all"]
    for index, record in enumerate(records):
        assert record["fired"] == [("nan", index, NAN_STEP)], records
        assert "3 of its steps in a row skipped" in record["error"]["text"], records
        assert record["error"]["text"].startswith(f"trainer {index} (rank {index}): "), records
        assert record["metrics"]["nonfinite_steps_skipped"] == 3 and record["steps"] == NAN_STEP + 2, records
        assert record["metrics"]["nonfinite_replicas_healed"] == 0, records


def test_a_healed_replicas_optimizer_drops_its_state_for_the_healed_weights_and_steps_as_a_new_one() -> None:
    """`restart_state`, through TorchRec's keyed optimizer as through torch's: the healed weights'
    state (finite, but exploded) is dropped, another parameter's kept, and the next step is the one a
    new optimizer takes."""
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    from shadowgba.nonfinite import restart_state
    weights, other = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(2))
    optimizer = KeyedOptimizerWrapper({"weights": weights, "other": other}, lambda params: torch.optim.Adam(params))
    for param in (weights, other):
        param.grad = torch.full_like(param, 1e18)
    optimizer.step()
    kept = {key: value.clone() for key, value in optimizer.state[other].items()}
    assert restart_state(optimizer, [weights]) == 1
    assert optimizer.state[weights] == {} and all(torch.equal(optimizer.state[other][key], kept[key]) for key in kept)
    new = nn.Parameter(weights.detach().clone())
    for param in (weights, new):
        param.grad = torch.ones_like(param)
    optimizer.step()
    torch.optim.Adam([new]).step()
    assert torch.equal(weights, new)
    assert restart_state(object(), [weights]) == 0  # no state to drop
