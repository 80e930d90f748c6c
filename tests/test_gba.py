"""GBA end to end over RPC and gloo: equivalence with sync training, switching both ways, a
straggler's decayed gradients, and the automatic switch policy."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from shadowgba.gba.config import GBAConfig
from shadowgba.config import from_dict
from shadowgba.errors import PeerLost, SyncError
from shadowgba.gba.runtime import GBASync, serve_dense_shard
from shadowgba.ps.transport import Transport
from shadowgba.ps.start import start_transport
from tests.multiprocess import run_shared

pytestmark = pytest.mark.timeout(240)

BATCH = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def loss_on(model: nn.Module, trainer: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * trainer + step)
    x = torch.randn(BATCH, 6, generator=generator, dtype=torch.float64)
    return nn.functional.mse_loss(model(x), x[:, :1] * 2 - x[:, 1:2])


def gba_job(rank: int, world_size: int, num_servers: int, trainer_fn, *args) -> object:  # noqa: ANN001
    """Every rank joins the PS job; servers serve a dense shard, trainers run `trainer_fn`."""
    ps = start_transport(num_servers)
    try:
        if ps.roles.is_server:
            serve_dense_shard(ps)
            return None
        return trainer_fn(ps, *args)
    finally:
        ps.stop()


def failing_gba_job(rank: int, world_size: int, num_servers: int, trainer_fn, *args) -> dict:  # noqa: ANN001
    """`gba_job` for a `trainer_fn` that fails the job (`on_nonfinite: fail`): the servers' roster
    records the failure, so every rank's `stop()` ends with `PeerLost` naming the failed trainer.
    Returns what `trainer_fn` returned (None on servers) and that error's message and ranks."""
    ps = start_transport(num_servers)
    if ps.roles.is_server:
        serve_dense_shard(ps)
        result = None
    else:
        result = trainer_fn(ps, *args)  # should it raise, the transport aborts at exit
    try:
        ps.stop()
    except PeerLost as lost:
        return {"result": result, "stopped": str(lost), "ranks": list(lost.ranks)}
    return {"result": result, "stopped": None, "ranks": []}


def train(ps: Transport, options: dict, schedule: list[str | None], lockstep: bool, sleep_s: float = 0.0) -> dict:
    """One step per schedule entry; an entry names a mode to switch to after that step."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = from_dict(GBAConfig, options)
    with GBASync(model, optimizer, config, ps.roles, local_batch_size=BATCH, transport=ps) as gba:
        for step, switch in enumerate(schedule):
            loss_on(model, ps.roles.trainer_index, step).backward()
            optimizer.step()
            optimizer.zero_grad()
            if lockstep:
                gba.wait_for_global_step(step + 1)
            if switch:
                gba.switch_mode(switch)
            time.sleep(sleep_s)
        mode, memory = gba.mode, gba.metrics.memory()
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "mode": mode, "memory": memory}


SCHEDULE = {"warmup_steps": 12, "decay_every": 8, "decay_gamma": 0.5}
"""A learning-rate schedule whose warm-up and decays both fall inside the switch test's GBA phase."""


def sync_then_state(ps: Transport, steps: int, switches: dict[int, str], options: dict | None = None) -> dict:
    """Train `steps` lockstep steps with switches at given steps; end in sync mode, return the state."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = from_dict(GBAConfig, {"initial_mode": "sync", "schedule": SCHEDULE, **(options or {})})
    gba = GBASync(model, optimizer, config, ps.roles, local_batch_size=BATCH, transport=ps)
    gba.start()
    for step in range(steps):
        loss_on(model, ps.roles.trainer_index, step).backward()
        optimizer.step()
        optimizer.zero_grad()
        gba.wait_for_global_step(step + 1)
        if step in switches:
            gba.switch_mode(switches[step])
    assert gba.mode == "sync", gba.mode
    result = {"state": gba.state_dict()["optimizer"], "switches": gba.metrics.summary()["mode_switches"]}
    gba.close()
    return {**result, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, list]:
    """The jobs of 2 trainers over 2 dense shards, one after another in one spawned group (see
    `run_shared`): each job starts and stops the PS transport, so none sees another's servers."""
    steps = [None] * 25
    return run_shared(4, {
        "gba-lockstep": (gba_job, (2, train, {"initial_mode": "gba"}, steps, True)),
        "gba-lockstep-bf16": (gba_job, (2, train, {"initial_mode": "gba", "push_dtype": "bfloat16",
                                                   "params_dtype": "bfloat16"}, steps, True)),
        "sync": (gba_job, (2, train, {"initial_mode": "sync"}, steps, False)),
        "switched": (gba_job, (2, sync_then_state, 30, {9: "gba", 19: "sync"}, {"fresh_wait": 0.5})),
    }, timeout_s=180)


@pytest.fixture(scope="module")
def three_ranks() -> dict[str, list]:
    """The jobs of 2 trainers and 1 server, then the one of 1 trainer and 2 servers whose job fails
    (last), in one spawned group; the timed jobs run one after another as they did alone."""
    decay = {"decay": {"kind": "exponential", "threshold": 1}, "fresh_wait": 0}
    return run_shared(3, {
        "never-switched": (gba_job, (1, sync_then_state, 30, {})),
        "slowed-trainer": (gba_job, (1, timed_run, 2.0, (0.004, 0.080), decay)),
        "equal-speed": (gba_job, (1, timed_run, 3.0, (0.025, 0.025), {"fresh_wait": 0})),
        "equal-speed-fresh": (gba_job, (1, timed_run, 4.0, (0.060, 0.060), {"fresh_wait": 0.5})),
        "switch-policy": (gba_job, (1, policy_run)),
        "abort": (gba_job, (2, user_error_aborts)),
        "close-after-failure": (failing_gba_job, (2, fail_then_close)),
    }, timeout_s=180)


def test_gba_with_zero_staleness_equals_sync_allreduce_training(four_ranks: dict) -> None:
    """2 trainers, 2 dense shards, Adam, 25 steps: GBA in lockstep vs the sync all-reduce mode."""
    results, reference = four_ranks["gba-lockstep"], four_ranks["sync"]
    for trainer in (0, 1):
        assert results[trainer]["mode"] == "gba" and reference[trainer]["mode"] == "sync"
        torch.testing.assert_close(results[trainer]["params"], reference[trainer]["params"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(results[0]["params"], results[1]["params"], rtol=0, atol=0)
    assert not torch.equal(results[0]["params"], torch.cat([p.detach().reshape(-1) for p in make_model().parameters()]))


def test_gba_with_bf16_pushes_is_sync_training_on_gradients_rounded_to_bf16(four_ranks: dict) -> None:
    """The same lockstep job with `push_dtype` and `params_dtype: bfloat16`: the trainers queue and
    push bf16 gradients (a quarter of the float64 model's bytes), the replicas stay identical, the
    result is the sync run's up to bf16's rounding of the gradients, which did happen, and the
    replicas end at the shards' exact parameters, not at bf16's rounding of them. (Lockstep pulls
    each step's parameters exactly, so the rounded replies' effect is not what this run shows:
    `test_gba_server` checks which replies are rounded.)"""
    results, reference = four_ranks["gba-lockstep-bf16"], four_ranks["sync"]
    numel = reference[0]["params"].numel()
    for trainer in (0, 1):
        queue = [name for name in results[trainer]["memory"] if name.startswith("queue_")]
        assert queue and all(results[trainer]["memory"][name] == 2 * numel for name in queue)
        difference = (results[trainer]["params"] - reference[trainer]["params"]).abs().max().item()
        assert 1e-6 < difference < 1e-2, difference
        params = results[trainer]["params"]
        assert not torch.equal(params, params.bfloat16().double())
    torch.testing.assert_close(results[0]["params"], results[1]["params"], rtol=0, atol=0)


def test_switching_sync_gba_sync_with_zero_staleness_stays_bit_equal_to_sync_all_the_way(
    four_ranks: dict, three_ranks: dict
) -> None:
    """The switch costs nothing: sync -> GBA (over 2 dense shards, which must both hand back the same
    global step) -> sync, every GBA step in lockstep (staleness 0), ends bit for bit where the same
    job ends that never left sync: parameters, Adam's moments and step count (its bias corrections),
    the global step, and the learning-rate schedule, whose warm-up and two decays fall in the GBA
    phase (steps 10-19). Bit-equal because with 2 trainers and a power-of-two batch the shard's
    sample-weighted mean rounds as the all-reduce's mean does. The GBA phase waits for fresh
    parameters (`fresh_wait`): a wait may bring the switch request back sooner on one trainer than
    on the other, and it must not make that one leave GBA a step earlier (it did, in about half
    the runs: the two then took unequal counts of sync steps and the job hung at close)."""
    switched, reference = four_ranks["switched"], three_ranks["never-switched"]
    for trainer in (0, 1):
        got, want = switched[trainer]["state"], reference[trainer]["state"]
        assert switched[trainer]["switches"] == 2 and reference[trainer]["switches"] == 0
        assert got["global_step"] == want["global_step"] == 30
        assert torch.equal(got["param"], want["param"])
        assert torch.equal(switched[trainer]["params"], reference[trainer]["params"])
        assert set(got["state"]) == set(want["state"]) == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][key], want["state"][key]), key
        assert float(got["state"]["step"]) == float(want["state"]["step"]) == 30
    assert not torch.equal(switched[0]["params"], torch.cat([p.detach().reshape(-1) for p in make_model().parameters()]))


def timed_run(ps: Transport, seconds: float, sleeps_s: tuple[float, float], options: dict) -> dict:
    """Free-running GBA for `seconds`; trainer i sleeps `sleeps_s[i]` per step."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = from_dict(GBAConfig, options)
    with GBASync(model, optimizer, config, ps.roles, local_batch_size=BATCH, transport=ps) as gba:
        started, step = time.monotonic(), 0
        while time.monotonic() - started < seconds:
            loss_on(model, ps.roles.trainer_index, step).backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(sleeps_s[ps.roles.trainer_index])
            step += 1
        stats = gba.server_stats()[0] if ps.roles.trainer_index == 0 else None
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "metrics": gba.metrics.summary(),
        "server": stats,
    }


def test_a_slowed_trainer_contributes_fewer_gradients_and_its_stale_ones_are_decayed(three_ranks: dict) -> None:
    """Trainer 1 sleeps 20x as long per step (4 vs 80 ms): on a loaded machine every step also
    costs tens of ms of starved compute (seen: 71 vs 32 pushes with a 4 / 40 ms split)."""
    fast, slow, _ = three_ranks["slowed-trainer"]
    pushes = fast["server"]["pushes_by_trainer"]
    assert pushes[0] > 3 * pushes[1] > 0, pushes
    assert slow["metrics"]["decayed"] + slow["metrics"]["stale_dropped"] > 0, slow["metrics"]
    assert fast["server"]["global_step"] > 10
    assert set(fast["server"]["staleness_histogram"]) - {"0", "1"}, fast["server"]["staleness_histogram"]
    torch.testing.assert_close(fast["params"], slow["params"], rtol=0, atol=0)  # final pull: identical


def test_equal_speed_trainers_compute_on_parameters_about_one_global_step_old(three_ranks: dict) -> None:
    """Without `fresh_wait` (set to 0: the default waits), a gradient spans one step of its trainer, during which the other
    trainer pushes once: about one global step of staleness is the floor without waiting. The watcher's long poll keeps the
    newest parameters at hand for the next step; installing only the reply to the previous push
    (fetched a whole step earlier) made it about two."""
    first, _, _ = three_ranks["equal-speed"]
    histogram = {int(key.rstrip("+")): count for key, count in first["server"]["staleness_histogram"].items()}
    mean = sum(staleness * count for staleness, count in histogram.items()) / sum(histogram.values())
    assert first["server"]["global_step"] > 40
    # about 1.1-1.3 on a quiet machine, up to 1.48 with the suite's other jobs on the 2 cores: the bound
    # separates "about one" from the "about two" it guards against, not the machine's load
    assert mean < 1.6, histogram


def test_with_fresh_wait_equal_speed_trainers_compute_on_the_global_step_their_last_gradient_entered(
    three_ranks: dict,
) -> None:
    """`fresh_wait` 0.5: after each push a trainer waits (at most half its compute time,
    30 ms here: long enough for a loaded machine's push, apply and watch reply) for the global step
    its gradient entered, so equal-speed trainers push fresh gradients, as sync all-reduce computes
    them: staleness 0 where the run without the wait had about one. (Waiting instead for parameters
    newer than the gradient's token settled, after a few steps, at 97% one step stale.)"""
    first, second, _ = three_ranks["equal-speed-fresh"]
    histogram = {int(key.rstrip("+")): count for key, count in first["server"]["staleness_histogram"].items()}
    assert first["server"]["global_step"] > 30
    assert histogram.get(0, 0) >= 0.8 * sum(histogram.values()), histogram  # 100% on a quiet machine
    for trainer in (first, second):
        metrics = trainer["metrics"]
        assert metrics["fresh_waits"] > 30 and metrics["fresh_timeouts"] <= 0.2 * metrics["fresh_waits"], metrics
        assert metrics["fresh_wait_s"] < 0.5 * 0.080 * metrics["fresh_waits"], metrics  # half a step (60 ms + work)


def policy_run(ps: Transport) -> dict:
    """Trainer 1 straggles for the first phase, then recovers; the policy goes to GBA and back.

    Steps are long enough (10 ms healthy, 60 ms straggling for 2 s) that a loaded machine's scheduling
    jitter does not decide the slowest / median ratio, and the healthy phase lasts until the policy
    has switched back (at most 20 s): under load the 5 healthy global steps in a row it needs
    take longer to come (seen with 3 ms steps and a 2.5 s healthy phase)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    policy = {"enabled": True, "to_gba_ratio": 1.5, "to_sync_ratio": 1.2, "window": 5}
    config = from_dict(GBAConfig, {"initial_mode": "sync", "switch_policy": policy})
    modes = []
    with GBASync(model, optimizer, config, ps.roles, local_batch_size=BATCH, transport=ps) as gba:
        started = time.monotonic()
        step = 0
        while time.monotonic() - started < 20.0:
            straggling = time.monotonic() - started < 2.0
            time.sleep(0.060 if straggling and ps.roles.trainer_index == 1 else 0.010)
            loss_on(model, ps.roles.trainer_index, step).backward()
            optimizer.step()
            optimizer.zero_grad()
            if not modes or modes[-1] != gba.mode:
                modes.append(gba.mode)
            step += 1
            if gba.mode == "sync" and len(modes) >= 3:
                break
    return {"modes": modes, "switches": gba.metrics.summary()["mode_switches"]}


def test_switch_policy_goes_to_gba_under_a_straggler_and_back_when_healthy(three_ranks: dict) -> None:
    for result in three_ranks["switch-policy"][:2]:
        assert result["modes"][:3] == ["sync", "gba", "sync"], result


def gba_threads() -> list[str]:
    """The GBA client's threads alive in this process."""
    return [thread.name for thread in threading.enumerate() if thread.name.startswith("shadowgba-gba")]


def fail_then_close(ps: Transport) -> dict:
    """One trainer in GBA over 2 shards, `on_nonfinite: fail`: a NaN gradient raises at once, and
    shard 0's server then refuses every call (its roster holds the job's failure), so close()'s
    drain raises, naming this trainer's rank."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = from_dict(GBAConfig, {"initial_mode": "gba"})
    gba = GBASync(model, optimizer, config, ps.roles, local_batch_size=BATCH, on_nonfinite="fail", transport=ps)
    gba.start()
    running = gba_threads()
    (loss_on(model, 0, 0) * float("nan")).backward()
    with pytest.raises(SyncError, match=r"non-finite \(NaN / Inf\) gradient from trainer 0 \(rank 0\)"):
        optimizer.step()
    optimizer.zero_grad()
    loss_on(model, 0, 1).backward()
    optimizer.step()  # queued; shard 0 refuses it: the job has failed
    with pytest.raises(SyncError, match=r"the job failed: non-finite .* trainer 0 \(rank 0\)") as refused:
        gba.close()
    return {"running": running, "after_close": gba_threads(), "ranks": list(refused.value.ranks)}


def user_error_aborts(ps: Transport) -> dict:
    """One trainer in GBA over 2 shards leaves its `with` block by the user's exception (abort)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = from_dict(GBAConfig, {"initial_mode": "gba"})
    with pytest.raises(KeyError, match="the user's error"):
        with GBASync(model, optimizer, config, ps.roles, local_batch_size=BATCH, transport=ps):
            loss_on(model, 0, 1).backward()
            optimizer.step()
            raise KeyError("the user's error")
    return {"after_abort": gba_threads()}


def test_close_and_abort_stop_and_join_the_threads_whatever_raises(three_ranks: dict) -> None:
    trainer = three_ranks["close-after-failure"][0]
    assert sorted(trainer["result"]["running"]) == ["shadowgba-gba", "shadowgba-gba-watch"], trainer
    assert trainer["result"]["after_close"] == [] and trainer["result"]["ranks"] == [0], trainer
    trainer_and_ps0 = three_ranks["close-after-failure"][:2]  # ps1 never heard: the trainer told shard 0's
    for rank in trainer_and_ps0:  # server alone (a job's abort notice, `Job.announce_failure`, tells every one)
        assert rank["ranks"] == [0] and "non-finite" in rank["stopped"], rank
    assert three_ranks["abort"][0]["after_abort"] == [], three_ranks["abort"]
