"""What the runtimes hold in dense-sized tensors: `metrics.memory()` accounts for exactly the tensors
they hold, and rounds after the first allocate none (their buffers are allocated once and reused).

One spawned 2-rank group runs every algorithm in foreground mode (the rounds then run in the
training thread, where `NewTensors` sees every op), and the shadow mode of BMUF for the account
alone; a 3-rank group (2 trainers, 1 dense server) runs GBA mode.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memory_probe import held_tensors, tensor_bytes
from shadowgba import SyncConfig
from shadowgba.config import from_dict
from shadowgba.gba.config import GBAConfig
from shadowgba.gba.runtime import GBASync, serve_dense_shard
from shadowgba.ps.start import start_transport
from shadowgba.shadow.runtime import ShadowSync
from tests.multiprocess import run_ranks, run_shared

pytestmark = pytest.mark.timeout(240)

WARMUP_STEPS = 8
STEPS = 24
QUEUE_SIZE = 2


def make_model() -> nn.Module:
    """Two layers of about equal size, so no training tensor is as large as the flat dense vector."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))


def dense_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class NewTensors(TorchDispatchMode):
    """Records every op of this thread whose output is a new storage of at least `numel` elements
    (not an input's storage, as in-place ops, `out=` and views return)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.allocations: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for output in _tensors(result):
            if output.numel() >= self.numel and output.untyped_storage().data_ptr() not in inputs:
                self.allocations.append(str(func))
        return result


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def account(runtime: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The runtime's own account next to what it is seen to hold from the outside."""
    held = list(held_tensors(runtime, model, optimizer))
    return {"memory": runtime.metrics.memory(), "held_bytes": tensor_bytes(iter(held)),
            "held_ptrs": sorted(t.untyped_storage().data_ptr() for t in held)}


def shadow_run(rank: int, world_size: int, algo: str, mode: str) -> dict[str, Any]:
    """Warm up, then count allocations over later steps (foreground: the rounds are in them)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = SyncConfig(algo=algo, mode=mode, foreground_every=2, interval_ms=1.0, first_round_after=0,
                        log_interval_s=0.0)
    with ShadowSync(model, optimizer, config) as sync:
        for _ in range(WARMUP_STEPS):
            step(model, optimizer, rank)
        before = account(sync, model, optimizer)
        rounds_before = sync.metrics.rounds
        watcher = NewTensors(dense_numel(model))
        with watcher:
            for _ in range(STEPS):
                step(model, optimizer, rank)
                time.sleep(0.002)
        after = account(sync, model, optimizer)
        rounds = sync.metrics.rounds - rounds_before
    return {"before": before, "after": after, "rounds": rounds, "allocations": watcher.allocations,
            "numel": dense_numel(model)}


@pytest.fixture(scope="module")
def shadow_runs() -> dict[str, list]:
    return run_shared(2, {
        **{f"{algo}-foreground": (shadow_run, (algo, "foreground")) for algo in ("ma", "easgd", "bmuf")},
        "bmuf-shadow": (shadow_run, ("bmuf", "shadow")),
    }, timeout_s=180)


EXPECTED = {
    "ma": {"snapshot", "allreduce"},
    "easgd": {"snapshot", "allreduce", "center"},
    "bmuf": {"snapshot", "allreduce", "global_model", "momentum"},
}


@pytest.mark.parametrize("case", ["ma-foreground", "easgd-foreground", "bmuf-foreground", "bmuf-shadow"])
def test_shadow_accounts_for_every_tensor_it_holds(case: str, shadow_runs: dict) -> None:
    algo = case.split("-")[0]
    for result in shadow_runs[case]:
        numel, memory = result["numel"], result["after"]["memory"]
        assert set(memory) == EXPECTED[algo]
        flagged = numel + 1 + 3 * 2  # payload, stop flag, one status, step count and round time per rank
        assert memory == {name: 4 * (flagged if name == "allreduce" else numel) for name in EXPECTED[algo]}
        assert sum(memory.values()) == result["after"]["held_bytes"]
        assert result["after"]["held_ptrs"] == result["before"]["held_ptrs"]  # the same buffers, rounds later


@pytest.mark.parametrize("algo", ["ma", "easgd", "bmuf"])
def test_rounds_after_warmup_allocate_no_dense_sized_tensor(algo: str, shadow_runs: dict) -> None:
    for result in shadow_runs[f"{algo}-foreground"]:
        assert result["rounds"] == STEPS // 2  # foreground_every=2: the rounds ran inside the watch
        assert result["allocations"] == []


def gba_run(rank: int, world_size: int) -> dict[str, Any] | None:
    """GBA mode against one dense shard; the client's queue buffers are counted in its account."""
    ps = start_transport(1)
    roles = ps.roles
    try:
        if roles.is_server:
            serve_dense_shard(ps)
            return None
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        config = from_dict(GBAConfig, {"initial_mode": "gba", "queue_size": QUEUE_SIZE})
        with GBASync(model, optimizer, config, roles, local_batch_size=4, transport=ps) as gba:
            for _ in range(WARMUP_STEPS):
                step(model, optimizer, rank)
            before = quiet_account(gba, model, optimizer)
            watcher = NewTensors(dense_numel(model))
            with watcher:
                for _ in range(STEPS):
                    step(model, optimizer, rank)
            after = quiet_account(gba, model, optimizer)
        return {"before": before, "after": after, "allocations": watcher.allocations, "numel": dense_numel(model)}
    finally:
        ps.stop()


def quiet_account(gba: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`account` with GBA's background threads quiet: its pusher moves a buffer from the queue to
    "in flight" to the spares and its watcher delivers parameters while the tensors are counted from
    the outside, so the two counts would be of different moments whenever a push is under way. The
    client leaves GBA's traffic as a switch to sync does (its pushes answered, none arriving), is
    counted, and enters again."""
    gba._client.leave()
    try:
        return account(gba, model, optimizer)
    finally:
        gba._client.enter()


def queue_buffers(memory: dict[str, int]) -> list[str]:
    return [name for name in memory if name.startswith("queue_")]


def test_gba_accounts_for_its_queue_and_optimizer_and_allocates_only_new_queue_buffers() -> None:
    trainers = [result for result in run_ranks(gba_run, 3, timeout_s=180) if result is not None]
    assert len(trainers) == 2
    for result in trainers:
        memory, numel = result["after"]["memory"], result["numel"]
        queue = queue_buffers(memory)
        assert 1 <= len(queue) <= QUEUE_SIZE + 1  # the queue and the push in flight, never more
        assert {"allreduce", "optimizer_param"} <= set(memory) and "gradient" not in memory  # written where it is sent
        assert all(memory[name] == 4 * numel for name in ["optimizer_param", *queue])
        assert sum(memory.values()) == result["after"]["held_bytes"]
        # a step's one dense-sized allocation is a queue buffer the pool did not have yet, never more
        grown = len(queue) - len(queue_buffers(result["before"]["memory"]))
        assert result["allocations"] == ["aten.empty.memory_format"] * grown
