"""The runtime with TorchRec DMP models, TorchRec's train pipeline, and Hogwild training threads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

import shadowgba
from shadowgba import SyncConfig
from shadowgba.shadow.runtime import ShadowSync
from shadowgba.shadow.hogwild import HogwildThreads, shared_replicas
from tests import tiny_dmp
from tests.multiprocess import run_shared

pytestmark = pytest.mark.timeout(300)


def dense_spread(model: nn.Module) -> float:
    """max |w - mean over ranks| of the dense parameters (0 when replicas agree)."""
    import torch.distributed as dist

    from shadowgba.integrations.torchrec import dense_named_parameters

    flat = torch.cat([p.detach().reshape(-1) for _, p in dense_named_parameters(model)])
    mean = flat.clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    spread = (flat - mean).abs().max()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return spread.item()


def train_loop(model: nn.Module, optimizer: object, rank: int, steps: int, use_pipeline: bool) -> None:
    """The user's loop, or TorchRec's `TrainPipelineSparseDist` (which calls optimizer.step() itself)."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from tests import tiny_dmp

    if use_pipeline:
        pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
        batches = iter([tiny_dmp.batch(rank, index) for index in range(steps)])
        for _ in range(steps):
            pipeline.progress(batches)
    else:
        for index in range(steps):
            loss, _ = model(tiny_dmp.batch(rank, index))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


SHADOW_CASES = [  # (label, sync config fields, steps, TorchRec pipeline)
    ("ma-shadow-pipeline", {"algo": "ma"}, 150, True),
    ("easgd-shadow-pipeline", {"algo": "easgd"}, 150, True),
    ("bmuf-handoff-pipeline", {"algo": "bmuf"}, 300, True),
    ("bmuf-hogwild-own-loop", {"algo": "bmuf", "writeback": "hogwild"}, 300, False),
    ("bmuf-foreground-pipeline", {"algo": "bmuf", "mode": "foreground"}, 150, True),
    ("ma-foreground-pipeline", {"algo": "ma", "mode": "foreground"}, 150, True),
]


def train_dmp_under_every_shadow_algorithm(rank: int, world_size: int) -> dict:
    """The tiny DMP under each shadow algorithm through the one factory, one job for all of them."""
    from tests import tiny_dmp

    results = {}
    for label, fields, steps, use_pipeline in SHADOW_CASES:
        model, optimizer = tiny_dmp.build(golden_optimizer=True)
        config = SyncConfig(**{"interval_ms": 2.0, "max_round_share": 1.0, "max_step_cost": 1.0, "foreground_every": 5,
                               **fields})
        with shadowgba.dense_sync(model, optimizer, config) as sync:
            train_loop(model, optimizer, rank, steps, use_pipeline)
        results[label] = {"metrics": sync.metrics.summary(), "spread": dense_spread(model), "steps": steps}
    return results


def test_every_shadow_algorithm_wraps_a_torchrec_pipeline_through_the_factory(two_ranks: dict) -> None:
    """ma, easgd, bmuf (shadow, foreground; handoff, hogwild) on a DMP trained by TorchRec's
    pipeline or the user's loop, with TorchRec's golden-script optimizer (a KeyedOptimizerWrapper
    over every named parameter): hundreds of steps, rounds applied, replicas identical at the end.
    Hogwild writes race the training thread's autograd graph: they must not break it."""
    (results, _) = two_ranks["torchrec"]
    assert list(results) == [label for label, *_ in SHADOW_CASES]
    for label, result in results.items():
        assert result["metrics"]["steps"] == result["steps"], label
        assert result["metrics"]["applied_rounds"] >= 10, (label, result["metrics"])
        assert result["spread"] == 0.0, label


def adoption_pitfalls(rank: int, world_size: int, tensorboard_dir: str) -> dict:
    """What a user adopting shadowgba on a DMP can get wrong, caught at start-up: a DMP built without
    `job.dmp_kwargs()` (TorchRec's DDP on the dense part) is refused; a `local_batch_size` that is not
    the batch's is warned about. And the shadow runtime's metrics reach the log and TensorBoard."""
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

    from tests.test_reporting import capture_logs

    result: dict = {}
    model, optimizer = tiny_dmp.build(wrapper=DefaultDataParallelWrapper())
    try:
        shadowgba.dense_sync(model, optimizer, SyncConfig(algo="ma"))
    except shadowgba.SetupError as error:
        result["ddp_refused"] = str(error)
    records = capture_logs()
    model, optimizer = tiny_dmp.build()
    config = SyncConfig(algo="ma", mode="foreground", foreground_every=5, first_round_after=0, log_interval_s=0.01,
                        tensorboard_dir=tensorboard_dir)
    with shadowgba.dense_sync(model, optimizer, config, local_batch_size=2 * tiny_dmp.BATCH) as sync:
        for index in range(30):
            train_loop(model, optimizer, rank, 1, use_pipeline=False)
            time.sleep(0.001)  # at least one log interval passes whatever the machine's speed
    result["logs"] = [(record.levelname, record.getMessage()) for record in records]
    result["steps"] = sync.metrics.summary()["steps"]
    return result


def test_a_dmp_with_ddp_is_refused_a_wrong_batch_size_warned_about_and_metrics_reach_log_and_tensorboard(
    two_ranks: dict, tensorboard_dir: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for trainer, result in enumerate(two_ranks["pitfalls"]):
        assert "wraps its dense part in DDP" in result["ddp_refused"]
        assert "DistributedModelParallel(..., **job.dmp_kwargs())" in result["ddp_refused"]
        warnings = [message for level, message in result["logs"] if level == "WARNING"]
        assert len(warnings) == 1 and f"holds {tiny_dmp.BATCH} samples" in warnings[0], warnings
        periodic = [message for level, message in result["logs"] if level == "INFO" and message.startswith("shadowgba: rounds=")]
        assert periodic, result["logs"]
        events = EventAccumulator(str(tensorboard_dir / f"trainer{trainer}")).Reload()
        steps, rounds = events.Scalars("shadowgba/steps"), events.Scalars("shadowgba/rounds")
        assert len(steps) >= 2 and (steps[-1].step, steps[-1].value) == (30, 30)  # periodic, and the last at close
        assert result["steps"] == 30 and rounds[-1].value >= 6


W_TRUE = torch.arange(8.0).unsqueeze(1) / 8
INITIAL_LOSS = float((W_TRUE**2).sum())  # E[(x @ w)^2] for x ~ N(0, I), from w = 0-ish


def train_hogwild_threads(rank: int, world_size: int, threads: int, steps: int) -> dict:
    """`threads` Hogwild threads per rank fit y = x @ W_TRUE together; shadow BMUF syncs the ranks."""
    torch.manual_seed(rank)
    model = nn.Linear(8, 1, bias=False)
    runner = HogwildThreads(model, threads, lambda replica: torch.optim.SGD(replica.parameters(), lr=0.05))
    losses: list[float] = []

    def train(index: int, replica: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        generator = torch.Generator().manual_seed(100 * rank + index)
        for _ in range(steps):
            x = torch.randn(32, 8, generator=generator)
            loss = nn.functional.mse_loss(replica(x), x @ W_TRUE)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        losses.append(loss.item())

    with ShadowSync(model, runner.optimizers, SyncConfig(algo="bmuf", interval_ms=2.0)) as sync:
        runner.run(train)
    return {"metrics": sync.metrics.summary(), "losses": losses, "weight": model.weight.detach().clone()}


def test_hogwild_threads_share_storage_and_feed_one_shadow_thread(two_ranks: dict) -> None:
    results = two_ranks["hogwild-threads"]
    for result in results:
        assert result["metrics"]["steps"] == 600  # both threads' optimizers are step boundaries
        assert max(result["losses"]) < 0.1 * INITIAL_LOSS, result["losses"]
    torch.testing.assert_close(results[0]["weight"], results[1]["weight"])
    torch.testing.assert_close(results[0]["weight"], W_TRUE.T, atol=0.1, rtol=0)


@pytest.fixture(scope="module")
def tensorboard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tensorboard")


@pytest.fixture(scope="module")
def two_ranks(tensorboard_dir: Path) -> dict[str, list]:
    """Both 2-rank jobs of this file, one after another in one spawned group (see `run_shared`)."""
    return run_shared(2, {
        "torchrec": (train_dmp_under_every_shadow_algorithm, ()),
        "hogwild-threads": (train_hogwild_threads, (2, 300)),
        "pitfalls": (adoption_pitfalls, (str(tensorboard_dir),)),
    }, timeout_s=270)


def test_shared_replicas_share_memory_but_not_version_counters_or_grads() -> None:
    model = nn.Linear(3, 2)
    original, replica = shared_replicas(model, 2)
    assert replica.weight.data_ptr() == original.weight.data_ptr()
    assert replica.weight is not original.weight
    output = replica(torch.ones(1, 3)).sum()  # replica's graph saves its weight
    with torch.no_grad():
        original.weight.add_(1.0)  # another thread's optimizer step
    output.backward()  # would raise "modified by an inplace operation" with one shared Parameter
    assert replica.weight.grad is not None and original.weight.grad is None
