"""The shadow runtime on real gloo ranks: write-back, stopping together, failures, pacing."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn

from shadowgba import SyncConfig, SyncError
from shadowgba.shadow.runtime import ShadowSync
from sync_algos.bmuf import BMUFConfig
from tests.multiprocess import run_ranks, run_shared

from dlrm.faults import InjectedFailure, fail_round_after

pytestmark = pytest.mark.timeout(180)


class ConstantStep(torch.optim.Optimizer):
    """Adds a fixed increment to every parameter per step: local progress we can count exactly."""

    def __init__(self, params: list[nn.Parameter], increment: float) -> None:
        super().__init__(params, {"increment": increment})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.add_(group["increment"])


def vector_model(rank: int) -> nn.Module:
    """Integer-valued float64 weights that differ per rank (the runtime must broadcast them)."""
    model = nn.Linear(4, 3).double()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.arange(param.numel(), dtype=torch.float64).view_as(param) + 100 * rank)
    return model


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_constant_steps(rank: int, world_size: int, steps: list[int], options: dict) -> dict:
    """Rank r takes steps[r] steps of +(r+1); returns its weights before and after the final sync."""
    model = vector_model(rank)
    optimizer = ConstantStep(list(model.parameters()), increment=float(rank + 1))
    config = SyncConfig(**{"interval_ms": 1.0, "max_round_share": 1.0, "max_step_cost": 1.0, "log_interval_s": 0.0,
                           **options})
    sync = ShadowSync(model, optimizer, config)
    with sync:
        initial = flat(model).clone()
        for _ in range(steps[rank]):
            optimizer.step()
            time.sleep(0.002)
        sync.close(final_sync=False)
        before_final = flat(model).clone()
        sync._group = None  # closed; the context manager's close() is now a no-op
    return {"initial": initial, "before_final": before_final, "metrics": sync.metrics.summary()}


HANDOFF_STEPS = [150, 150]
HANDOFF_OPTIONS = {"ma": {"algo": "ma"}, "bmuf": {"algo": "bmuf", "bmuf": BMUFConfig(block_momentum=0.0)}}
"""For BMUF with eta = 0 the rounds are MA; the default eta would add momentum and not conserve."""


@pytest.mark.parametrize("algo", list(HANDOFF_OPTIONS))
def test_handoff_keeps_local_progress_made_during_rounds(algo: str, two_ranks: dict) -> None:
    """MA-type rounds preserve the sum of replicas, so sum(w) must equal sum(w0) + all local steps.

    Any lost local step (e.g. rebinding w to the average instead of w + (t - s)) breaks the equality.
    """
    results = two_ranks[f"handoff-{algo}"]
    torch.testing.assert_close(results[0]["initial"], results[1]["initial"])
    progress = sum(HANDOFF_STEPS[r] * (r + 1) for r in range(2))
    total = results[0]["before_final"] + results[1]["before_final"]
    torch.testing.assert_close(total, 2 * results[0]["initial"] + progress, rtol=0, atol=1e-9)
    for rank, result in enumerate(results):
        assert result["metrics"]["applied_rounds"] >= 5, result["metrics"]
        assert result["metrics"]["steps"] == HANDOFF_STEPS[rank]


def rounds_around_the_first_round_step(rank: int, world_size: int, steps_before: int, steps_after: int) -> dict:
    """Rounds seen after `steps_before` steps, then after `steps_after` more (first_round_after=20)."""
    model = vector_model(rank)
    optimizer = ConstantStep(list(model.parameters()), increment=float(rank + 1))
    config = SyncConfig(algo="ma", interval_ms=1.0, log_interval_s=0.0, first_round_after=20)
    with ShadowSync(model, optimizer, config) as sync:
        for _ in range(steps_before):
            optimizer.step()
            time.sleep(0.01)  # 1 ms pacing: without first_round_after, rounds would run all along
        rounds_before = sync.metrics.rounds
        for _ in range(steps_after):
            optimizer.step()
            time.sleep(0.01)
        rounds_after = sync.metrics.rounds
    return {"before": rounds_before, "after": rounds_after, "final": flat(model)}


def test_shadow_rounds_start_only_after_first_round_after_steps(two_ranks: dict) -> None:
    results = two_ranks["first-round-after"]
    for result in results:
        assert result["before"] == 0 and result["after"] >= 3, result
    torch.testing.assert_close(results[0]["final"], results[1]["final"])


def test_a_job_shorter_than_first_round_after_still_closes_together_with_identical_weights(two_ranks: dict) -> None:
    results = two_ranks["short-job"]
    assert [result["after"] for result in results] == [0, 0]
    torch.testing.assert_close(results[0]["final"], results[1]["final"])


def final_weights_after_unequal_training(rank: int, world_size: int, steps: list[int], options: dict) -> dict:
    model = vector_model(rank)
    optimizer = ConstantStep(list(model.parameters()), increment=1.0)
    with ShadowSync(model, optimizer, SyncConfig(**{"interval_ms": 1.0, "timeout_s": 60.0, **options})) as sync:
        for _ in range(steps[rank]):
            optimizer.step()
            time.sleep(0.001)
    return {"weights": flat(model), "metrics": sync.metrics.summary()}


UNEQUAL_STOP_CASES = {
    "ma-handoff": {"algo": "ma"},
    "easgd-handoff": {"algo": "easgd"},
    "bmuf-hogwild": {"algo": "bmuf", "writeback": "hogwild"},
    "bmuf-foreground": {"algo": "bmuf", "mode": "foreground", "foreground_every": 7},
    "ma-bf16": {"algo": "ma", "compress": "bf16"},  # compressed rounds, the stop round and final average exact
    "easgd-int8-foreground": {"algo": "easgd", "mode": "foreground", "foreground_every": 7, "compress": "int8"},
}


@pytest.fixture(scope="module")
def unequal_stops() -> dict[str, list]:
    """Every case on the same 3 ranks, one after another (one spawned group: see `run_shared`)."""
    return run_shared(3, {
        label: (final_weights_after_unequal_training, ([20, 300, 90], options))
        for label, options in UNEQUAL_STOP_CASES.items()
    }, timeout_s=180)


@pytest.mark.parametrize("label", list(UNEQUAL_STOP_CASES))
def test_ranks_that_stop_at_different_steps_all_exit_with_identical_weights(label: str, unequal_stops: dict) -> None:
    results = unequal_stops[label]
    for result in results[1:]:
        torch.testing.assert_close(result["weights"], results[0]["weights"])
    assert [r["metrics"]["steps"] for r in results] == [20, 300, 90]


def test_foreground_mode_syncs_every_k_steps_from_first_round_after_on(two_ranks: dict) -> None:
    results = two_ranks["foreground-every"]
    for result in results:
        # rounds at steps 30..60 (none at 10 and 20, before first_round_after), plus the stop round
        # that close() raises its flag in
        assert result["metrics"]["rounds"] == 5
        assert result["metrics"]["sync_gap_steps_mean"] == pytest.approx(60 / 5)


def shadow_failure_reaches_training(rank: int, world_size: int) -> str:
    model = vector_model(rank)
    optimizer = ConstantStep(list(model.parameters()), increment=1.0)
    sync = ShadowSync(model, optimizer, SyncConfig(algo="ma", interval_ms=1.0))
    with pytest.raises(SyncError, match="shadow thread failed") as caught:
        with sync:
            fail_round_after(sync, 3)
            for _ in range(10_000):
                optimizer.step()
                time.sleep(0.001)
    assert isinstance(caught.value.__cause__, InjectedFailure)
    assert sync.metrics.rounds == 3
    return "raised after %d steps" % sync.metrics.steps


def test_exception_in_shadow_thread_reaches_the_training_thread(one_rank: dict) -> None:
    (message,) = one_rank["shadow-failure"]
    assert int(message.split()[2]) < 10_000


def dead_peer(rank: int, world_size: int) -> str:
    model = vector_model(rank)
    optimizer = ConstantStep(list(model.parameters()), increment=1.0)
    sync = ShadowSync(model, optimizer, SyncConfig(algo="ma", interval_ms=1.0, timeout_s=20.0))
    sync.start()
    for step in range(100_000):
        if rank == 1 and step == 50:
            os._exit(0)  # fault injection: the peer dies without a word
        try:
            optimizer.step()
        except SyncError as error:
            return f"step {step}: {error}"
        time.sleep(0.001)
    raise AssertionError("the dead peer was never noticed")


def test_a_dead_peer_surfaces_as_an_error_with_its_cause() -> None:
    with pytest.raises(AssertionError) as failure:
        run_ranks(dead_peer, 2, timeout_s=60)
    message = str(failure.value)
    assert "ranks [0, 1] hung" not in message and "ranks [0] hung" not in message
    assert "ranks [1] hung or died" in message  # rank 1 exited without reporting, by design


def paced_rounds(rank: int, world_size: int) -> dict:
    model = vector_model(rank)
    optimizer = ConstantStep(list(model.parameters()), increment=1.0)
    with ShadowSync(model, optimizer, SyncConfig(algo="ma", interval_ms=50.0, max_round_share=1.0)) as sync:
        started = time.monotonic()
        while time.monotonic() - started < 1.0:
            optimizer.step()
            time.sleep(0.001)
        sync.set_interval_ms(0.0)
        fast_start, fast_rounds = time.monotonic(), sync.metrics.rounds
        while time.monotonic() - fast_start < 0.5:
            optimizer.step()
            time.sleep(0.001)
        return {"slow_rounds": fast_rounds, "slow_s": fast_start - started, "fast_rounds": sync.metrics.rounds - fast_rounds}


def test_pacing_bounds_the_round_rate_and_can_change_while_running(two_ranks: dict) -> None:
    for result in two_ranks["pacing"]:
        # at most one round starts per 50 ms interval (plus the one in flight)
        assert result["slow_rounds"] <= result["slow_s"] / 0.050 + 2, result
        assert result["fast_rounds"] > result["slow_rounds"], result


def niced_rounds(rank: int, world_size: int) -> dict:
    """`sync.rounds_nice` 19, fixed: the niceness of the training thread, the shadow thread and the
    gloo threads of the rounds' group while the job runs, and the rounds made."""
    model = vector_model(rank)
    optimizer = ConstantStep(list(model.parameters()), increment=1.0)
    config = SyncConfig(algo="ma", interval_ms=5.0, first_round_after=0, rounds_nice=19)
    with ShadowSync(model, optimizer, config) as sync:
        started = time.monotonic()
        while time.monotonic() - started < 0.5:
            optimizer.step()
            time.sleep(0.002)
        seen = {"training": os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                "shadow": os.getpriority(os.PRIO_PROCESS, sync._thread.native_id),
                "group": sorted(os.getpriority(os.PRIO_PROCESS, thread) for thread in sync._round_threads)}
    return seen | {"rounds": sync.metrics.rounds}


def test_rounds_nice_lowers_the_shadow_thread_and_its_groups_threads_and_rounds_go_on(two_ranks: dict) -> None:
    for seen in two_ranks["rounds-nice"]:
        suite = os.getpriority(os.PRIO_PROCESS, 0)  # the suite may run niced itself, even at 19
        assert seen["shadow"] == 19 and seen["training"] == suite, (seen, suite)
        assert seen["group"] and set(seen["group"]) == {19}, seen  # gloo's loop and workers of its group
        assert seen["rounds"] >= 5, seen


def rounds_under_contention(rank: int, world_size: int) -> dict:
    """The default priority (adaptive) on cores kept busy by one more process per rank (two busy
    processes per core, as 4 ranks of a 2D job on 2 cores), each step 3 ms of the training thread's
    CPU, and rounds made dear (`max_step_cost` 0.001: their cost alone would space them hundreds of
    steps apart), so that the floor is what starts them: the round rate, and the steps, under
    contention. (With two more per rank, three per core, a round itself took about 20 steps on a
    quiet clone and the rate fell to 1 in 21.5.)"""
    import subprocess
    import sys

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
    try:
        model = vector_model(rank)
        optimizer = ConstantStep(list(model.parameters()), increment=1.0)
        config = SyncConfig(algo="ma", interval_ms=20.0, max_step_cost=0.001, first_round_after=0, log_interval_s=0.0)
        with ShadowSync(model, optimizer, config) as sync:
            started = time.monotonic()
            while time.monotonic() - started < 4.0:
                busy = time.thread_time()
                while time.thread_time() - busy < 0.003:
                    pass
                optimizer.step()
            metrics = sync.metrics.summary()
            restored = sync._schedule.priority.restored
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    return {"steps": metrics["steps"], "rounds": metrics["rounds"], "gap_max": metrics["sync_gap_steps_max"],
            "restored": restored}


def test_the_round_rate_never_drops_below_the_floor_under_cpu_contention(two_ranks: dict) -> None:
    """At least one round per 20 steps (the floor, `max_gap_steps`, is 10), however dear the rounds
    and busy the cores (without the floor: 4 rounds in 317 steps, three busy processes per core).
    The longest gap is not asserted: `sync_gap_steps_max` also counts the wait before the first
    round, and on oversubscribed cores (a quiet clone, as root) it reached 47 and 63 steps."""
    for result in two_ranks["contention"]:
        assert result["steps"] >= 60, result  # enough steps for the floor to matter
        assert result["rounds"] * 20 >= result["steps"] - 20, result


def step_paced_rounds(rank: int, world_size: int) -> dict:
    """Rank 0 steps every 2 ms, rank 1 five times slower; rounds every 10 steps of the fastest rank."""
    model = vector_model(rank)
    optimizer = ConstantStep(list(model.parameters()), increment=1.0)
    config = SyncConfig(algo="ma", interval_ms=0.0, interval_steps=10, max_round_share=1.0, max_step_cost=1.0,
                        first_round_after=0)
    steps = 0
    with ShadowSync(model, optimizer, config) as sync:
        started = time.monotonic()
        while time.monotonic() - started < 1.5:
            optimizer.step()
            steps += 1
            time.sleep(0.002 if rank == 0 else 0.010)
    # read once the rounds have ended on both ranks: inside the block one rank's shadow thread may
    # have recorded a round that the other's has not yet
    return {"steps": steps, "rounds": sync.metrics.rounds}


def test_step_pacing_follows_the_fastest_rank(two_ranks: dict) -> None:
    fast, slow = two_ranks["step-pacing"]
    assert fast["rounds"] == slow["rounds"]
    assert fast["steps"] > 3 * slow["steps"], (fast, slow)
    # about one round per 10 steps of the fast rank (plus the first two, before any step time is
    # known, and the one that carries the stop flags at close), and far more than one per 10 steps
    # of the slow rank, which must not set the pace
    assert 2 * slow["steps"] / 10 < fast["rounds"] <= fast["steps"] / 10 + 4, (fast, slow)


def round_costs_carried(rank: int, world_size: int) -> list[float]:
    """Two flagged sums, each rank's previous round time set as a waiting rank's would be: the one
    that came first waited for the other (rank 0 the first time, rank 1 the second)."""
    from sync_algos.base import FlaggedAllReduce

    allreduce = FlaggedAllReduce(None, torch.zeros(3))
    costs = []
    for waited in (0, 1):
        allreduce.previous_ms = 900.0 if rank == waited else 40.0 + rank
        costs.append(allreduce.sum(torch.ones(3), stop=False).round_cost_ms)
    return costs


def test_a_round_carries_its_previous_cost_without_the_ranks_waits(two_ranks: dict) -> None:
    assert two_ranks["round-costs"] == [[41.0, 40.0], [41.0, 40.0]]


def control_file_changes_pacing(rank: int, world_size: int, control: str) -> dict:
    from pathlib import Path

    model = vector_model(rank)
    optimizer = ConstantStep(list(model.parameters()), increment=1.0)

    def train_for(seconds: float) -> int:
        rounds, started = sync.metrics.rounds, time.monotonic()
        while time.monotonic() - started < seconds:
            optimizer.step()
            time.sleep(0.002)
        return sync.metrics.rounds - rounds

    config = SyncConfig(algo="ma", interval_ms=1.0, max_round_share=1.0, max_step_cost=1.0, control_file=control)
    with ShadowSync(model, optimizer, config) as sync:
        fast = train_for(1.0)
        Path(control).write_text("interval_ms: 400\ninterval_steps: 3\nmax_round_share: 0.5\nmax_step_cost: 0.25\n"
                                 "max_gap_steps: 40\nwarn_gap_steps: 500\n")
        train_for(1.5)  # picked up within a poll interval (1 s)
        slow = train_for(1.2)
        Path(control).write_text("interval_ms: -5\n")  # invalid: logged and ignored
        train_for(1.2)
        still_slow = train_for(1.2)
    schedule = sync._schedule
    return {"fast": fast, "slow": slow, "still_slow": still_slow, "interval_ms": sync.interval_ms,
            "interval_steps": sync.interval_steps, "max_round_share": sync.max_round_share,
            "cost_limits": (schedule.pacer.max_step_cost, schedule.pacer.max_gap_steps, schedule.warn_gap_steps)}


def test_control_file_changes_pacing_while_running_and_bad_edits_are_ignored(one_rank: dict) -> None:
    (result,) = one_rank["control-file"]
    assert result["fast"] > 50, result
    assert result["slow"] <= 1.2 / 0.4 + 2, result
    assert result["still_slow"] <= 1.2 / 0.4 + 2 and result["interval_ms"] == 400.0, result
    assert result["interval_steps"] == 3 and result["max_round_share"] == 0.5
    assert result["cost_limits"] == (0.25, 40, 500), result


def checkpoint_often(rank: int, world_size: int) -> dict:
    """What a checkpointer does every few steps: read the state, then meet the peers in a collective
    of the training thread's own group, while shadow rounds run on the shadow group unpaced and at
    the training threads' priority (steps of microseconds: niced or paced by cost, the rounds of
    this sub-second job would be a handful, and the test is about reads meeting rounds)."""
    import torch.distributed as dist

    model = vector_model(rank)
    optimizer = ConstantStep(list(model.parameters()), increment=1.0)
    reads = 0
    with ShadowSync(model, optimizer, SyncConfig(algo="easgd", interval_ms=0.0, max_round_share=1.0, max_step_cost=1.0,
                                               rounds_nice=0, first_round_after=0)) as sync:
        for step in range(1, 301):
            optimizer.step()
            if step % 3 == 0:
                state = sync.state_dict()
                reads += 1
                dist.barrier()  # the checkpoint's collective: a peer may be here, or in a round
    return {"reads": reads, "rounds": sync.metrics.summary()["rounds"], "centre": state["algorithm"]["center"]}


def test_reading_the_state_never_waits_for_a_round_that_waits_for_a_peer_in_another_collective(two_ranks: dict) -> None:
    """Before: state_dict() waited for the round in flight, whose peer's shadow thread waited for a
    snapshot from a training thread that sat in the checkpoint's barrier waiting for this one."""
    results = two_ranks["checkpoint-often"]
    for result in results:
        assert result["reads"] == 100 and result["rounds"] > 10, result
        assert torch.isfinite(result["centre"]).all()


def close_right_after_a_round(rank: int, world_size: int) -> dict:
    """Foreground BMUF, SGD on a small MLP, 60 steps with a round every 5: the weights after the last
    step's round, and after close() (its stop round and final average)."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = SyncConfig(algo="bmuf", mode="foreground", foreground_every=5, log_interval_s=0.0, first_round_after=0)
    sync = ShadowSync(model, optimizer, config)
    with sync:
        for step in range(60):
            inputs = torch.randn(16, 4, generator=torch.Generator().manual_seed(100 * rank + step))
            model(inputs).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        after_last_round = flat(model).clone()
    return {"after_last_round": after_last_round, "closed": flat(model), "rounds": sync.metrics.rounds}


def test_bmuf_close_right_after_a_round_leaves_the_model_where_training_left_it(two_ranks: dict) -> None:
    """The stop round takes the average and no outer step: a momentum step after training ended
    would move the replicas (by 5.7e-3 before the fix, on this job)."""
    results = two_ranks["bmuf-close-after-round"]
    assert results[0]["rounds"] == 60 // 5 + 1  # the 12 rounds at steps 5 ... 60, then close()'s stop round
    torch.testing.assert_close(results[0]["after_last_round"], results[1]["after_last_round"], rtol=0, atol=0)
    for result in results:
        torch.testing.assert_close(result["closed"], result["after_last_round"], rtol=0, atol=1e-7)


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list]:
    """Every 2-rank job of this file but the dead peer's (which kills its group), one after another
    in one spawned group (see `run_shared`)."""
    return run_shared(2, {
        **{f"handoff-{algo}": (train_constant_steps, (HANDOFF_STEPS, options)) for algo, options in HANDOFF_OPTIONS.items()},
        "first-round-after": (rounds_around_the_first_round_step, (19, 21)),
        "short-job": (rounds_around_the_first_round_step, (5, 0)),
        "foreground-every": (
            final_weights_after_unequal_training, ([60, 60], {"algo": "ma", "mode": "foreground", "foreground_every": 10,
                                                          "first_round_after": 25})
        ),
        "pacing": (paced_rounds, ()),
        "step-pacing": (step_paced_rounds, ()),
        "contention": (rounds_under_contention, ()),
        "checkpoint-often": (checkpoint_often, ()),
        "bmuf-close-after-round": (close_right_after_a_round, ()),
        "round-costs": (round_costs_carried, ()),
        "rounds-nice": (niced_rounds, ()),
    }, timeout_s=150)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    """The single-rank jobs in one spawned group; the one whose shadow thread fails runs last."""
    control = str(tmp_path_factory.mktemp("control") / "control.yaml")
    return run_shared(1, {
        "control-file": (control_file_changes_pacing, (control,)),
        "shadow-failure": (shadow_failure_reaches_training, ()),
    }, timeout_s=150)
