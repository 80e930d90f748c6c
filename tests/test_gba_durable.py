"""GBA for long jobs: one global step over several dense shards, NaN / Inf never spreads, checkpoints
in every mode. Three spawned jobs, each shared by the assertions about one rule; the malformed
checkpoints are refused without any process."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
from torch import nn

from shadowgba.config import from_dict
from shadowgba.errors import CheckpointError, ConfigError, SetupError, SyncError
from shadowgba.flat_optimizer import FlatOptimizer
from shadowgba.gba.config import GBAConfig
from shadowgba.gba.runtime import GBASync
from shadowgba.job.roles import Roles
from shadowgba.ps.transport import Transport
from tests.multiprocess import run_ranks
from tests.test_gba import BATCH, failing_gba_job, gba_job, loss_on, make_model

pytestmark = pytest.mark.timeout(240)

ROUND_TRIPS = 3


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def step(gba: GBASync, model: nn.Module, optimizer: torch.optim.Optimizer, data_step: int,
         trainer: int | None = None, poison: bool = False, lockstep: bool = False) -> None:
    """One training step on `data_step`'s batch (NaN gradient with `poison`); with `lockstep`, wait
    in GBA mode until the global step this push belongs to is complete (zero staleness)."""
    target = gba.global_step + 1
    loss = loss_on(model, gba.roles.trainer_index if trainer is None else trainer, data_step)
    (loss * float("nan") if poison else loss).backward()
    optimizer.step()
    optimizer.zero_grad()
    if lockstep:
        gba.wait_for_global_step(target)


# ------------------------------------------------------------------- one global step for all shards
def round_trips(ps: Transport) -> dict:
    """3 trainers over 2 shards, trainer 2 ten times slower, stale pushes dropped (threshold 0): the
    shards' keep / drop decisions would differ if each took them. Trainer 0 asks for sync after 8 of
    its GBA steps and for GBA after 3 sync steps, ROUND_TRIPS times; the shards' global steps are
    read (a spy on trainer 0's export) at every GBA -> sync switch, when every push has landed."""
    roles = ps.roles
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = from_dict(GBAConfig, {"initial_mode": "gba",
                                   "decay": {"kind": "drop", "threshold": 0, "max_staleness": 4}})
    gba = GBASync(model, optimizer, config, roles, local_batch_size=BATCH, transport=ps)
    steps_at_switch: list[list[int]] = []
    if roles.trainer_index == 0:
        export = gba._shards.export

        def spying_export() -> dict[str, Any]:
            steps_at_switch.append([stats["global_step"] for stats in gba._shards.stats()])
            return export()

        gba._shards.export = spying_export
    with gba:
        data_step, in_mode, mode = 0, 0, gba.mode
        while gba.metrics.summary()["mode_switches"] < 2 * ROUND_TRIPS:
            assert data_step < 3000, f"only {gba.metrics.summary()['mode_switches']} switches in {data_step} steps"
            time.sleep(0.03 if roles.trainer_index == 2 else 0.003)
            step(gba, model, optimizer, data_step)
            data_step += 1
            in_mode = in_mode + 1 if gba.mode == mode else 1
            mode = gba.mode
            if roles.trainer_index == 0 and (mode, in_mode) in (("gba", 8), ("sync", 3)):
                gba.switch_mode("sync" if mode == "gba" else "gba")
        final_mode = gba.mode
    after_close = [stats["global_step"] for stats in gba.server_stats()]
    return {"params": flat(model), "mode": final_mode, "steps_at_switch": steps_at_switch,
            "after_close": after_close, "metrics": gba.metrics.summary()}


def test_shards_share_one_global_step_through_repeated_switches_with_a_slow_trainer() -> None:
    trainers = run_ranks(gba_job, 5, 2, round_trips, timeout_s=200)[:3]
    switches = trainers[0]["steps_at_switch"]
    assert len(switches) == ROUND_TRIPS, switches
    assert all(len(set(steps)) == 1 for steps in switches), switches  # both shards, the same k
    assert switches == sorted(switches) and switches[0][0] > 0, switches
    assert len(set(trainers[0]["after_close"])) == 1, trainers[0]["after_close"]
    assert sum(result["metrics"]["stale_dropped"] for result in trainers) > 0  # drops happened
    for result in trainers:
        assert result["mode"] == "gba" and result["metrics"]["mode_switches"] == 2 * ROUND_TRIPS, result["metrics"]
        torch.testing.assert_close(result["params"], trainers[0]["params"], rtol=0, atol=0)
    assert torch.isfinite(trainers[0]["params"]).all()


# ----------------------------------------------------------------------------------- NaN / Inf
def nonfinite_rule(ps: Transport) -> dict:
    """2 trainers over 2 shards; trainer 1's gradient is NaN once per phase.
    skip, sync mode: everyone applies trainer 0's gradient alone and counts it; skip, GBA mode:
    shard 0 drops and counts the push, training goes on; fail, sync mode: both trainers raise at
    the same step, naming trainer 1; fail, GBA mode: trainer 1 raises at once, trainer 0 at a
    later push, both naming trainer 1."""
    roles = ps.roles
    trainer = roles.trainer_index
    out: dict[str, Any] = {}
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = from_dict(GBAConfig, {"initial_mode": "sync"})
    with GBASync(model, optimizer, config, roles, local_batch_size=BATCH, on_nonfinite="skip", transport=ps) as gba:
        for data_step in range(4):
            step(gba, model, optimizer, data_step, poison=trainer == 1 and data_step == 2)
        out["sync_skip"] = {"params": flat(model), "global_step": gba.global_step,
                            "skipped": gba.metrics.summary()["nonfinite_skipped"]}
        gba.switch_mode("gba")
        step(gba, model, optimizer, 4)  # the switch flag rides in this all-reduce
        assert gba.mode == "gba", gba.mode
        for data_step in range(5, 15):
            step(gba, model, optimizer, data_step, poison=trainer == 1 and data_step == 7)
            time.sleep(0.01)
    stats = gba.server_stats()  # closed: every trainer's pushes have landed
    out["gba_skip"] = {"params": flat(model), "skipped": gba.metrics.summary()["nonfinite_skipped"],
                       "nonfinite_dropped": [shard["nonfinite_dropped"] for shard in stats],
                       "global_steps": [shard["global_step"] for shard in stats]}

    with pytest.raises(SyncError) as failed:
        with GBASync(model, optimizer, config, roles, local_batch_size=BATCH, on_nonfinite="fail", transport=ps) as gba:
            for data_step in range(20, 24):
                before = flat(model)
                step(gba, model, optimizer, data_step, poison=trainer == 1 and data_step == 22)
    out["sync_fail"] = {"error": str(failed.value), "failed_at": data_step, "params": flat(model),
                        "unchanged": torch.equal(before, flat(model))}

    optimizer.zero_grad()  # the failed step never reached it: trainer 1's NaN gradient is still there
    gba_config = from_dict(GBAConfig, {"initial_mode": "gba"})
    with pytest.raises(SyncError) as failed:
        with GBASync(model, optimizer, gba_config, roles, local_batch_size=BATCH, on_nonfinite="fail", transport=ps) as gba:
            for data_step in range(30, 230):
                step(gba, model, optimizer, data_step, poison=trainer == 1 and data_step == 32)
                time.sleep(0.01)
    out["gba_fail"] = {"error": str(failed.value), "failed_at": data_step}
    return out


def test_a_non_finite_gradient_is_skipped_or_fails_every_trainer_but_never_spreads() -> None:
    ranks = run_ranks(failing_gba_job, 4, 2, nonfinite_rule, timeout_s=200)
    for rank in ranks[:3]:  # the last phase failed the job: ps0's roster names trainer 1 to the trainers and ps0
        assert rank["ranks"] == [1] and "trainer 1 (rank 1)" in rank["stopped"], rank  # (trainer 1 told shard 0)
    trainers = [rank["result"] for rank in ranks[:2]]
    sync_skip = [result["sync_skip"] for result in trainers]
    assert [result["skipped"] for result in sync_skip] == [1, 1]  # every trainer counts trainer 1's
    assert [result["global_step"] for result in sync_skip] == [4, 4]  # the round still stepped
    torch.testing.assert_close(sync_skip[0]["params"], sync_skip[1]["params"], rtol=0, atol=0)
    assert torch.isfinite(sync_skip[0]["params"]).all()
    gba_skip = [result["gba_skip"] for result in trainers]
    assert [result["skipped"] for result in gba_skip] == [1, 2]  # GBA mode: only trainer 1 counts its own
    assert gba_skip[0]["nonfinite_dropped"] == [1, 0]  # shard 0 dropped it; shard 1 never saw it
    assert len(set(gba_skip[0]["global_steps"])) == 1 and gba_skip[0]["global_steps"][0] > 4
    torch.testing.assert_close(gba_skip[0]["params"], gba_skip[1]["params"], rtol=0, atol=0)  # final pull
    assert torch.isfinite(gba_skip[0]["params"]).all()
    for result in trainers:
        sync_fail = result["sync_fail"]
        assert sync_fail["failed_at"] == 22 and sync_fail["unchanged"], sync_fail
        assert "gradient from trainer 1 (rank 1)" in sync_fail["error"] and "on_nonfinite: fail" in sync_fail["error"]
        assert "trainer 1 (rank 1)" in result["gba_fail"]["error"], result["gba_fail"]
    torch.testing.assert_close(trainers[0]["sync_fail"]["params"], trainers[1]["sync_fail"]["params"], rtol=0, atol=0)
    assert trainers[1]["gba_fail"]["failed_at"] == 32  # at once
    assert "the job failed" in trainers[0]["gba_fail"]["error"]  # trainer 0: its next push was refused


# ---------------------------------------------------------------------------------- checkpoints
def assert_same_state(got: dict, want: dict) -> None:
    """Exactly the same parameters, optimizer state, global step and policy state."""
    assert got["param_names"] == want["param_names"] and got["switch_policy"] == want["switch_policy"]
    got_opt, want_opt = got["optimizer"], want["optimizer"]
    assert got_opt["global_step"] == want_opt["global_step"]
    assert torch.equal(got_opt["param"], want_opt["param"])
    assert set(got_opt["state"]) == set(want_opt["state"])
    for key, value in want_opt["state"].items():
        assert torch.equal(torch.as_tensor(got_opt["state"][key]), torch.as_tensor(value)), key


def checkpoint_round_trips(ps: Transport) -> dict:
    """2 trainers over 2 shards, Adam, lockstep (zero staleness). In GBA mode and then in sync mode:
    save, train 3 steps, load, and the state is the saved one exactly; 3 more steps on the same
    batches land where the first 3 did. Malformed loads change nothing; a GBA-mode checkpoint
    loads in sync mode."""
    roles = ps.roles
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = from_dict(GBAConfig, {"initial_mode": "gba"})
    with GBASync(model, optimizer, config, roles, local_batch_size=BATCH, transport=ps) as gba:
        for data_step in range(4):
            step(gba, model, optimizer, data_step, lockstep=True)
        saved_gba = copy.deepcopy(gba.state_dict())
        assert saved_gba["mode"] == "gba" and saved_gba["optimizer"]["global_step"] == 4, saved_gba["mode"]
        for data_step in range(4, 7):
            step(gba, model, optimizer, data_step, lockstep=True)
        trained = gba.state_dict()
        gba.load_state_dict(saved_gba)  # collective in GBA mode: into every shard, at one k
        assert_same_state(gba.state_dict(), saved_gba)
        assert torch.equal(flat(model), saved_gba["optimizer"]["param"])
        assert [stats["global_step"] for stats in gba.server_stats()] == [4, 4]
        for bad in (None, {**saved_gba, "param_names": ["other"]}, {"mode": "gba"}):
            with pytest.raises(CheckpointError):
                gba.load_state_dict(bad)
        assert_same_state(gba.state_dict(), saved_gba)
        for data_step in range(4, 7):
            step(gba, model, optimizer, data_step, lockstep=True)
        resumed = gba.state_dict()
        assert resumed["optimizer"]["global_step"] == trained["optimizer"]["global_step"] == 7
        torch.testing.assert_close(resumed["optimizer"]["param"], trained["optimizer"]["param"], rtol=1e-12, atol=1e-15)

        gba.switch_mode("sync")
        data_step = 7
        while gba.mode != "sync":
            assert data_step < 20, "no switch to sync"
            step(gba, model, optimizer, data_step, lockstep=True)
            data_step += 1
        saved_sync = copy.deepcopy(gba.state_dict())
        assert saved_sync["mode"] == "sync"
        for data_step in range(100, 103):
            step(gba, model, optimizer, data_step)
        trained = gba.state_dict()
        gba.load_state_dict(saved_sync)
        assert_same_state(gba.state_dict(), saved_sync)
        assert torch.equal(flat(model), saved_sync["optimizer"]["param"])
        for data_step in range(100, 103):
            step(gba, model, optimizer, data_step)
        assert_same_state(gba.state_dict(), trained)
        gba.load_state_dict(saved_gba)  # taken in GBA mode, loaded in sync mode
        assert_same_state(gba.state_dict(), saved_gba)
        gba.load_state_dict(trained)
    return {"params": flat(model)}


def test_checkpoints_round_trip_exactly_in_gba_and_in_sync_mode() -> None:
    trainers = run_ranks(gba_job, 4, 2, checkpoint_round_trips, timeout_s=200)[:2]
    torch.testing.assert_close(trainers[0]["params"], trainers[1]["params"], rtol=0, atol=0)


def unstarted(optimizer_name: str = "Adam") -> tuple[GBASync, dict]:
    """A GBASync that was never started (no process group needed), and a valid state for it whose
    optimizer has stepped once (so its state holds Adam's tensors)."""
    model = make_model()
    optimizer = getattr(torch.optim, optimizer_name)(model.parameters(), lr=0.01)
    roles = Roles.assign(0, 3, num_servers=1)
    gba = GBASync(model, optimizer, from_dict(GBAConfig, {"initial_mode": "sync"}), roles, BATCH)
    stepped = FlatOptimizer(gba.spec, flat(model))
    stepped.step(torch.linspace(-1, 1, gba.dense.numel, dtype=torch.float64))
    state = {**gba.state_dict(), "optimizer": stepped.export()}
    return gba, state


def malformed(state: dict) -> dict[str, Any]:
    """Every way the brief's checkpoint can be wrong, each a copy of `state` broken in one place."""
    optimizer = state["optimizer"]
    numel = optimizer["param"].numel()

    def with_optimizer(**changes: Any) -> dict:
        return {**state, "optimizer": {**optimizer, **changes}}

    def with_state(**changes: Any) -> dict:
        return with_optimizer(state={**optimizer["state"], **changes})

    nan_param = optimizer["param"].clone()
    nan_param[3] = float("nan")
    return {
        "none": None,
        "list": [state],
        "empty dict": {},
        "missing optimizer": {key: value for key, value in state.items() if key != "optimizer"},
        "missing global_step": {**state, "optimizer": {"param": optimizer["param"], "state": optimizer["state"]}},
        "unknown mode": {**state, "mode": "hogwild"},
        "other param names": {**state, "param_names": [*state["param_names"][:-1], "head.bias"]},
        "other numel": with_optimizer(param=torch.zeros(numel + 1, dtype=torch.float64)),
        "other dtype": with_optimizer(param=optimizer["param"].float()),
        "NaN parameter": with_optimizer(param=nan_param),
        "Inf optimizer state": with_state(exp_avg_sq=torch.full((numel,), float("inf"), dtype=torch.float64)),
        "state of another size": with_state(exp_avg=torch.zeros(numel - 1, dtype=torch.float64)),
        "another optimizer's state": with_optimizer(state={"momentum_buffer": torch.zeros(numel, dtype=torch.float64)}),
        "negative global step": with_optimizer(global_step=-1),
        "fractional global step": with_optimizer(global_step=2.5),
        "bad policy state": {**state, "switch_policy": {"streak": -3}},
    }


@pytest.mark.parametrize("case", list(malformed(unstarted()[1])))
def test_a_malformed_checkpoint_is_refused_and_changes_nothing(case: str) -> None:
    gba, good = unstarted()
    gba.load_state_dict(good)
    before = gba.state_dict()
    with pytest.raises(CheckpointError):
        gba.load_state_dict(malformed(good)[case])
    assert_same_state(gba.state_dict(), before)
    assert_same_state(before, good)


def test_a_checkpoint_loaded_before_start_is_what_state_dict_returns() -> None:
    gba, good = unstarted()
    fresh = gba.state_dict()
    assert fresh["optimizer"]["global_step"] == 0 and fresh["optimizer"]["state"] == {} and fresh["mode"] == "sync"
    assert set(fresh) == {"mode", "param_names", "optimizer", "switch_policy"}
    gba.load_state_dict({**good, "mode": "gba", "switch_policy": {"streak": 4}})
    loaded = gba.state_dict()
    assert loaded["switch_policy"] == {"streak": 4}
    assert_same_state({**loaded, "switch_policy": None}, {**good, "switch_policy": None})


def test_on_nonfinite_and_local_batch_size_are_checked_at_construction() -> None:
    model, roles = make_model(), Roles.assign(0, 2, num_servers=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = from_dict(GBAConfig, {"initial_mode": "sync"})
    with pytest.raises(ConfigError, match=r"sync.on_nonfinite must be one of \['skip', 'fail'\], got 'ignore'"):
        GBASync(model, optimizer, config, roles, BATCH, on_nonfinite="ignore")
    for bad in (0, 2.5, True):
        with pytest.raises(SetupError, match="local_batch_size must be an integer >= 1"):
            GBASync(model, optimizer, config, roles, bad)
