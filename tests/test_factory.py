"""The one entry point with parameter-server ranks: `join` + `dense_sync` around TorchRec's pipeline.

2 trainers + 1 server, TorchRec tables sharded over the trainers only (`job.dmp_kwargs()`), the
optimizer built as TorchRec's golden training script builds it (a KeyedOptimizerWrapper over every
named parameter). One job per algorithm that needs servers, gba first (with a switch to sync and
back inside the loop), then easgd_ps; before them, a DMP over the whole world is refused.

Then the user's exception: trainer 1 raises inside the `with` block of `dense_sync`, as a typo in
a user's loop would, under gba with the dense shards on the server, easgd_ps, sync all-reduce
without servers (3 trainers) and gba with TorchRec-sharded tables; four jobs one after another in
one spawned group of 3 ranks, so each failed job must leave the processes able to run the next.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shadowgba
from torchrec.distributed.model_parallel import DistributedModelParallel
from shadowgba import PeerLost, SetupError, SyncConfig
from shadowgba.config import from_dict
from tests.multiprocess import run_ranks, run_shared

pytestmark = pytest.mark.timeout(300)

STEPS, SWITCH_TO_SYNC_AT, SWITCH_TO_GBA_AT = 120, 30, 70


def replica_spread(model: torch.nn.Module, group: dist.ProcessGroup) -> float:
    from shadowgba.integrations.torchrec import dense_named_parameters

    flat = torch.cat([param.detach().reshape(-1) for _, param in dense_named_parameters(model)])
    mean = flat.clone()
    dist.all_reduce(mean, group=group)
    spread = (flat - mean / dist.get_world_size(group)).abs().max()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=group)
    return spread.item()


def gba_with_switches(model: torch.nn.Module, optimizer: object, rank: int, sync: shadowgba.DenseSync) -> list[str]:
    """The pipeline loop, with the user's own switch to sync all-reduce and back to GBA inside it."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from tests import tiny_dmp

    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
    batches = iter([tiny_dmp.batch(rank, index) for index in range(STEPS)])
    modes = []
    for step in range(STEPS):
        if step == SWITCH_TO_SYNC_AT:
            sync.switch_mode("sync")
        if step == SWITCH_TO_GBA_AT:
            sync.switch_mode("gba")
        pipeline.progress(batches)
        modes.append(sync.mode)
    return modes


def trainers_and_a_server(rank: int, world_size: int) -> dict:
    from tests import tiny_dmp

    from tests.test_reporting import RecordingWriter, capture_logs

    result: dict = {}
    job = shadowgba.join(from_dict(SyncConfig, {"algo": "gba", "ps": {"num_servers": 1}, "timeout_s": 60,
                                                "log_interval_s": 0.01}))
    if job.is_server:
        return {"server": True}
    records, writer = capture_logs(), RecordingWriter()
    # the pitfall: TorchRec's default environment shards over every rank, the server included
    started = time.monotonic()
    try:
        DistributedModelParallel(tiny_dmp.TinyRec(), device=torch.device("cpu"))
    except SetupError as error:
        result["refused"] = (str(error), time.monotonic() - started)
    model, optimizer = tiny_dmp.build(dmp_kwargs=job.dmp_kwargs(), golden_optimizer=True)
    # end_job=False: the replicas are compared on the trainer group after the sync has closed
    with shadowgba.dense_sync(model, optimizer, job, local_batch_size=tiny_dmp.BATCH, end_job=False,
                              summary_writer=writer) as sync:
        result["modes"] = gba_with_switches(model, optimizer, rank, sync)
    result["gba"] = {"metrics": sync.metrics.summary(), "spread": replica_spread(model, job.trainer_group)}
    result["logs"] = [(record.levelname, record.getMessage()) for record in records]
    result["switches_written"] = [value for tag, value, _ in writer.scalars if tag == "shadowgba/mode_switches"]
    job.close()
    return result


def test_gba_wraps_a_torchrec_pipeline_switches_inside_the_loop_and_refuses_a_dmp_over_the_servers() -> None:
    trainer0, trainer1, server = run_ranks(trainers_and_a_server, 3, timeout_s=240)
    assert server == {"server": True}
    for trainer in (trainer0, trainer1):
        message, seconds = trainer["refused"]
        assert "would shard its tables over 3 ranks, but only 2 train" in message
        assert "DistributedModelParallel(..., **job.dmp_kwargs())" in message
        assert seconds < 5
        modes = trainer["modes"]
        assert modes[0] == "gba" and "sync" in modes[SWITCH_TO_SYNC_AT:SWITCH_TO_GBA_AT] and modes[-1] == "gba", modes
        assert trainer["gba"]["metrics"]["mode_switches"] == 2
        assert trainer["gba"]["spread"] == 0.0
        # starting in initial_mode gba is no switch: logged at info; the two switches are warnings
        switches = [(level, message.split(" switched ")[1].split(" at ")[0]) for level, message in trainer["logs"]
                    if " switched " in message]
        assert switches == [("INFO", "sync -> gba"), ("WARNING", "gba -> sync"), ("WARNING", "sync -> gba")], switches
        assert not [message for level, message in trainer["logs"] if level == "WARNING" and " switched " not in message]
        assert any(message.startswith("shadowgba: rounds=") for _, message in trainer["logs"])  # log_interval_s
        assert trainer["switches_written"][-1] == 2  # the writer got the last values at close
    assert trainer0["modes"] == trainer1["modes"]  # lockstep trainers switch at the same step


# -------------------------------------------------------------------------- the user's exception
TIMEOUT_S = 60.0
"""`sync.timeout_s` and the RPC timeout of the failing jobs: what a fault must never be waited out for."""
ENDS_WITHIN_S = 15.0
FAIL_AT = 5
SURVIVOR_CAP_S = 40.0
"""A trainer that nothing stops trains this long, then leaves its loop as if done (and fails the test)."""
FAILING_JOBS: dict[str, tuple[dict[str, Any], bool]] = {
    "gba": ({"algo": "gba", "ps": {"num_servers": 1}, "gba": {"initial_mode": "gba"}}, False),
    "easgd_ps": ({"algo": "easgd_ps", "ps": {"num_servers": 1}, "interval_ms": 5.0}, False),
    "sync_allreduce": ({"algo": "gba", "gba": {"initial_mode": "sync"}}, False),
    "gba_torchrec": ({"algo": "gba", "ps": {"num_servers": 1}, "gba": {"initial_mode": "gba"}}, True),
}
"""name: (the `sync` section, TorchRec-sharded tables). The TorchRec job runs last: a peer waiting in
TorchRec's all-to-all is released when the failed process exits (the group is TorchRec's to keep)."""
DECOUPLED_JOBS = {"gba", "easgd_ps"}
"""Jobs whose trainers step apart (they meet only the server): trainer 1 may reach its failing step
while trainer 0, started later or given less CPU, has taken a step or none (seen on a loaded CI
machine), so only the lockstep jobs promise that the survivors trained alongside until the failure."""


def describe(error: BaseException) -> dict[str, Any]:
    """An error as the user sees it: its type and message, its notes, and every error it chains."""
    chain, cause = [], error.__cause__ or error.__context__
    while cause is not None:
        chain.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    notes = list(getattr(error, "__notes__", []))
    return {"type": type(error).__name__, "message": str(error), "notes": notes,
            "text": " | ".join([str(error), *notes, *chain]), "is_peer_lost": isinstance(error, PeerLost)}


def plain_model() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(dist.get_rank())
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def loss(trainer: int, step: int) -> torch.Tensor:
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1000 * trainer + step))
        return nn.functional.mse_loss(model(x), x[:, :1])

    return model, torch.optim.SGD(model.parameters(), lr=0.05), loss


def torchrec_model(job: shadowgba.Job) -> tuple[nn.Module, Any, Any]:
    from tests import tiny_dmp

    model, optimizer = tiny_dmp.build(dmp_kwargs=job.dmp_kwargs())
    return model, optimizer, lambda trainer, step: model(tiny_dmp.batch(trainer, step))[0]


def raise_in_the_loop(rank: int, world_size: int, options: dict[str, Any], torchrec: bool) -> dict[str, Any]:
    """Join a job and train; trainer 1 raises ValueError at step FAIL_AT. What this rank saw and when."""
    servers = options.get("ps", {}).get("num_servers", 0)
    # a server's join() raises when its job fails: its role is known before
    record: dict[str, Any] = {"error": None, "steps": 0,
                              "role": "server" if rank >= world_size - servers else f"trainer {rank}"}
    try:
        job = shadowgba.join(from_dict(SyncConfig, {**options, "timeout_s": TIMEOUT_S, "ps": {
            **options.get("ps", {}), "rpc_timeout_s": TIMEOUT_S, "trainer_timeout_s": TIMEOUT_S}}))
        assert job.is_server == (record["role"] == "server"), record
        if not job.is_server:
            model, optimizer, loss_on = torchrec_model(job) if torchrec else plain_model()
            started = time.monotonic()
            with shadowgba.dense_sync(model, optimizer, job, local_batch_size=8):
                for step in itertools.count():
                    if job.trainer_index == 1 and step == FAIL_AT:
                        record["raised_at"] = time.time()
                        raise ValueError(f"boom at step {step}")
                    if time.monotonic() - started > SURVIVOR_CAP_S:
                        break
                    loss_on(job.trainer_index, step).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    record["steps"] = step + 1
    except Exception as error:  # noqa: BLE001 (what each rank saw is the evidence)
        record["error"] = describe(error)
    record["ended_at"] = time.time()
    return record


@pytest.fixture(scope="module")
def failed_jobs() -> dict[str, list[dict[str, Any]]]:
    return run_shared(3, {name: (raise_in_the_loop, job) for name, job in FAILING_JOBS.items()}, timeout_s=280)


@pytest.mark.parametrize("name", FAILING_JOBS)
def test_an_exception_in_one_trainers_loop_ends_every_rank_soon_naming_it(
        failed_jobs: dict[str, list[dict[str, Any]]], name: str) -> None:
    ranks = failed_jobs[name]
    failed = ranks[1]
    assert failed["role"] == "trainer 1" and failed["steps"] == FAIL_AT, ranks
    error = failed["error"]
    assert (error["type"], error["message"], error["notes"]) == ("ValueError", f"boom at step {FAIL_AT}", []), error
    for rank, seen in enumerate(ranks):
        late = seen["ended_at"] - failed["raised_at"]
        assert late < ENDS_WITHIN_S, f"rank {rank} ({seen['role']}) ended {late:.1f} s after the exception: {ranks}"
        if rank == 1:
            continue
        assert seen["error"] is not None, f"rank {rank} ({seen['role']}) ended without an error: {ranks}"
        assert "trainer 1 (rank 1) aborted: ValueError('boom at step 5')" in seen["error"]["text"], (rank, seen)
        if seen["role"] == "server":
            assert seen["error"]["is_peer_lost"], seen
        elif name not in DECOUPLED_JOBS:
            assert seen["steps"] >= FAIL_AT - 1, seen  # it trained alongside until the failure
