"""The one entry point with parameter-server ranks: `join` + `dense_sync` around TorchRec's pipeline.

2 trainers + 1 server, TorchRec tables sharded over the trainers only (`job.dmp_kwargs()`), the
optimizer built as TorchRec's golden training script builds it (a KeyedOptimizerWrapper over every
named parameter). One job per algorithm that needs servers, gba first (with a switch to sync and
back inside the loop), then easgd_ps; before them, a DMP over the whole world is refused.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import shadowgba
from torchrec.distributed.model_parallel import DistributedModelParallel
from shadowgba import SetupError, SyncConfig
from shadowgba.config import from_dict
from tests.multiprocess import run_ranks
from tests.test_torchrec_and_hogwild import train_loop

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

    result: dict = {}
    job = shadowgba.join(from_dict(SyncConfig, {"algo": "gba", "ps": {"num_servers": 1}, "timeout_s": 60}))
    if job.is_server:
        return {"server": True}
    # the pitfall: TorchRec's default environment shards over every rank, the server included
    started = time.monotonic()
    try:
        DistributedModelParallel(tiny_dmp.TinyRec(), device=torch.device("cpu"))
    except SetupError as error:
        result["refused"] = (str(error), time.monotonic() - started)
    model, optimizer = tiny_dmp.build(dmp_kwargs=job.dmp_kwargs(), golden_optimizer=True)
    # end_job=False: the replicas are compared on the trainer group after the sync has closed
    with shadowgba.dense_sync(model, optimizer, job, local_batch_size=tiny_dmp.BATCH, end_job=False) as sync:
        result["modes"] = gba_with_switches(model, optimizer, rank, sync)
    result["gba"] = {"metrics": sync.metrics.summary(), "spread": replica_spread(model, job.trainer_group)}
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
    assert trainer0["modes"] == trainer1["modes"]  # lockstep trainers switch at the same step
