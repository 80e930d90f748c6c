"""Durable jobs under the shadow runtime: NaN / Inf never spreads, bad checkpoints change nothing,
and a user's exception on one trainer wins there and ends its peers' rounds within seconds."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from shadowgba import SyncConfig, SyncError
from shadowgba.errors import CheckpointError
from shadowgba.shadow.runtime import ShadowSync
from tests.multiprocess import free_port, run_ranks
from tests.test_runtime import ConstantStep, flat, vector_model

pytestmark = pytest.mark.timeout(120)

NONFINITE_CASES = [(algo, mode, "skip") for algo in ("ma", "easgd", "bmuf") for mode in ("shadow", "foreground")] + [
    ("ma", "shadow", "fail"),
    ("bmuf", "foreground", "fail"),
]
INJECT_AT = 20


def poison(model: torch.nn.Module) -> None:
    """Fault injection: NaN in 5 dense weights, as a diverged batch would leave them."""
    with torch.no_grad():
        model.weight.view(-1)[:5] = float("nan")


def nonfinite_cases(rank: int, world_size: int, cases: list[tuple[str, str, str]]) -> list[dict]:
    """Every case in turn on the same two ranks: rank 1's weights get NaN at step INJECT_AT."""
    records = []
    for algo, mode, policy in cases:
        model = vector_model(rank)
        optimizer = ConstantStep(list(model.parameters()), increment=0.01 * (rank + 1))
        config = SyncConfig(algo=algo, mode=mode, on_nonfinite=policy, interval_ms=1.0, foreground_every=5,
                            first_round_after=5, log_interval_s=0.0, timeout_s=60.0)
        sync = ShadowSync(model, optimizer, config)
        record: dict = {"error": None, "rank0_nonfinite_at": None, "finite_again_at": None}
        try:
            with sync:
                for step in range(1, 3000):
                    optimizer.step()
                    if rank == 1 and step == INJECT_AT:
                        poison(model)
                    if rank == 0 and record["rank0_nonfinite_at"] is None and not torch.isfinite(flat(model)).all():
                        record["rank0_nonfinite_at"] = step
                    if rank == 1 and step > INJECT_AT and record["finite_again_at"] is None \
                            and torch.isfinite(flat(model)).all():
                        record["finite_again_at"] = step
                    if step >= 3 * INJECT_AT and sync.metrics.nonfinite_rounds_skipped >= 1:
                        break
                    time.sleep(0.001)
        except SyncError as error:
            record["error"] = str(error)
        record.update(final=flat(model), skipped=sync.metrics.nonfinite_rounds_skipped, steps=sync.metrics.steps,
                      healed=sync.metrics.nonfinite_replicas_healed)
        records.append(record)
    return records


def test_nan_in_one_replica_never_reaches_another_and_skip_heals_it_under_any_algorithm_or_mode() -> None:
    """ma / easgd / bmuf x shadow / foreground under skip, then ma-shadow and bmuf-foreground under fail,
    in one job. skip: rank 0 stays finite at every step and after the final average; the first round
    that sees rank 1's NaN leaves it out on both ranks and heals it (rank 1 takes the consensus), so
    it is finite again by the next step boundary and trains on. fail: both ranks raise SyncError
    naming rank 1."""
    results = run_ranks(nonfinite_cases, 2, NONFINITE_CASES, timeout_s=110)
    for index, (algo, mode, policy) in enumerate(NONFINITE_CASES):
        case = f"{algo}-{mode}-{policy}"
        rank0, rank1 = results[0][index], results[1][index]
        assert rank0["rank0_nonfinite_at"] is None, (case, rank0)
        assert torch.isfinite(rank0["final"]).all(), case
        if policy == "skip":
            assert rank0["error"] is None and rank1["error"] is None, (case, rank0["error"], rank1["error"])
            assert torch.isfinite(rank1["final"]).all(), case
            # one round left rank 1 out, on both ranks alike, and healed it: no later round or the final average saw NaN
            assert rank0["skipped"] == rank1["skipped"] == 1, (case, rank0["skipped"], rank1["skipped"])
            assert rank1["healed"] == 1 and rank0["healed"] == 0, case
            if mode == "foreground":  # the round of step 25 (every 5) healed it in place
                assert rank1["finite_again_at"] == INJECT_AT + 5, (case, rank1["finite_again_at"])
            else:  # at the step boundary after its round
                assert rank1["finite_again_at"] is not None, case
        else:
            for record in (rank0, rank1):
                assert record["error"] is not None and "rank 1 sent NaN / Inf" in record["error"], (case, record)
                assert record["steps"] < 3000 and record["skipped"] == 0, (case, record)
            assert rank1["steps"] >= INJECT_AT, (case, rank1)  # rank 0 may be a few steps behind it in shadow mode


HEAL_OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                   "adam": lambda params: torch.optim.Adam(params, lr=0.1)}
BURST_AT, HEALED_AT, GRADIENT = (8, 9), 10, 0.01
"""Rank 1's bad steps (huge finite gradients, -1e18), after which its weights turn NaN; the round
of step 10 (foreground, every 5) heals it; every other gradient is GRADIENT."""


def heal_after_a_burst(rank: int, world_size: int) -> dict[str, dict]:
    """Per optimizer of HEAL_OPTIMIZERS, ma in foreground mode on two ranks: rank 1 diverges (BURST_AT,
    then NaN) and is healed at HEALED_AT. Records rank 1's weights right after the heal and after its
    next step, the step a new optimizer would take from the healed weights, and each rank's weights
    at the end."""
    records = {}
    for name, make in HEAL_OPTIMIZERS.items():
        torch.manual_seed(rank)
        model = torch.nn.Linear(4, 3)
        optimizer = make(model.parameters())
        config = SyncConfig(algo="ma", mode="foreground", foreground_every=5, first_round_after=5,
                            interval_ms=1.0, log_interval_s=0.0, timeout_s=60.0)
        record: dict = {}
        with ShadowSync(model, optimizer, config) as sync:
            for step in range(1, 31):
                for param in model.parameters():
                    param.grad = torch.full_like(param, GRADIENT)
                if rank == 1 and step in BURST_AT:
                    model.weight.grad.view(-1)[1:5] = -1e18
                optimizer.step()
                if rank == 1 and step == BURST_AT[-1]:
                    poison(model)
                if step == HEALED_AT:
                    record["healed"] = flat(model).clone()
                    fresh = torch.nn.Linear(4, 3)
                    fresh.load_state_dict(model.state_dict())
                    for param in fresh.parameters():
                        param.grad = torch.full_like(param, GRADIENT)
                    make(fresh.parameters()).step()
                    record["fresh_step"] = flat(fresh) - record["healed"]
                if step == HEALED_AT + 1:
                    record["next_step"] = flat(model) - record["healed"]
        record.update(final=flat(model), healed_count=sync.metrics.nonfinite_replicas_healed)
        records[name] = record
    return records


def test_a_healed_replicas_optimizer_starts_afresh_so_its_next_step_is_a_normal_one() -> None:
    """Rank 1's bad steps leave its optimizer state finite but exploded (SGD's momentum, Adam's
    moments, about 1e18) before its weights turn NaN. The heal replaces its weights with rank 0's and
    its optimizer state for them with a new one: its next step is the step a new optimizer takes
    from those weights, not a 1e17 jump (SGD) or a step against the gradient (Adam), and no later
    round brings any of it to rank 0."""
    results = run_ranks(heal_after_a_burst, 2, timeout_s=60)
    for name in HEAL_OPTIMIZERS:
        rank0, rank1 = results[0][name], results[1][name]
        assert rank1["healed_count"] == 1 and rank0["healed_count"] == 0, name
        assert torch.equal(rank1["healed"], rank0["healed"]), name  # the heal: rank 0's weights
        assert torch.allclose(rank1["next_step"], rank1["fresh_step"], rtol=1e-4, atol=1e-7), (
            name, rank1["next_step"], rank1["fresh_step"])
        assert rank0["final"].abs().max() < 10 and torch.equal(rank0["final"], rank1["final"]), (name, rank0["final"])


ABORT_CASES = [("ma", "shadow", {}), ("bmuf", "foreground", {}),
               # compressed rounds whose first (exact) round comes after the abort (step 40 > 30)
               ("ma", "shadow", {"compress": "bf16", "first_round_after": 40}),
               ("easgd", "foreground", {"compress": "int8", "first_round_after": 40})]


def user_bug_on_rank_1(rank: int, world_size: int, cases: list[tuple[str, str, dict]]) -> list[dict]:
    """Rank 1's loop raises ValueError at step 30; rank 0 would train 60 s. timeout_s stays 300."""
    records = []
    for algo, mode, options in cases:
        model = vector_model(rank)
        optimizer = ConstantStep(list(model.parameters()), increment=1.0)
        config = SyncConfig(**{"algo": algo, "mode": mode, "interval_ms": 1.0, "foreground_every": 5,
                               "log_interval_s": 0.0, "timeout_s": 300.0, **options})
        started = time.monotonic()
        try:
            with ShadowSync(model, optimizer, config):
                step = 0
                while time.monotonic() - started < 60:
                    optimizer.step()
                    step += 1
                    if rank == 1 and step == 30:
                        raise ValueError("user bug")
                    time.sleep(0.001)
            records.append({"error": None})
        except Exception as error:  # noqa: BLE001 (recorded for the test's assertions)
            records.append({"type": type(error).__name__, "message": str(error), "notes": getattr(error, "__notes__", []),
                            "elapsed_s": time.monotonic() - started})
    return records


def test_a_user_exception_wins_on_its_rank_and_ends_the_peers_rounds_within_seconds() -> None:
    """ma in shadow mode and bmuf in foreground mode, timeout_s=300: rank 1's ValueError propagates as
    itself (no note of a failed abort), rank 0 gets PeerLost naming rank 1, both well within 20 s.
    The same under `sync.compress` where the abort comes before the first round, which runs exact
    (the reference is not agreed yet): the aborted round pairs with it, collective for collective."""
    results = run_ranks(user_bug_on_rank_1, 2, ABORT_CASES, timeout_s=110)
    for index, case in enumerate(ABORT_CASES):
        rank0, rank1 = results[0][index], results[1][index]
        assert (rank1["type"], rank1["message"], rank1["notes"]) == ("ValueError", "user bug", []), (case, rank1)
        assert rank0["type"] == "PeerLost" and rank0["message"].startswith("rank 1 aborted"), (case, rank0)
        assert rank0["elapsed_s"] < 20 and rank1["elapsed_s"] < 20, (case, rank0, rank1)


# ------------------------------------------------------------------------------- checkpoints (1 rank)
@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo world of one in this process: ShadowSync starts without spawning a job."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def started_sync(algo: str) -> ShadowSync:
    model = vector_model(0)
    optimizer = ConstantStep(list(model.parameters()), increment=1.0)
    sync = ShadowSync(model, optimizer, SyncConfig(algo=algo, mode="foreground", foreground_every=10**6,
                                                   log_interval_s=0.0))
    sync.start()
    return sync


def nan_like(state: dict) -> dict:
    poisoned = {key: value.clone() for key, value in state["algorithm"].items()}
    next(iter(poisoned.values()))[2] = float("nan")
    return {**state, "algorithm": poisoned}


def resized(state: dict) -> dict:
    return {**state, "algorithm": {key: torch.zeros(value.numel() + 1, dtype=value.dtype)
                                   for key, value in state["algorithm"].items()}}


BAD_STATES = {
    "none": (lambda state: None, r"ShadowSync state is a mapping .*got NoneType"),
    "list": (lambda state: [state], r"ShadowSync state is a mapping .*got list"),
    "no keys": (lambda state: {"step": 3}, r"ShadowSync state lacks \['algo', 'param_names', 'algorithm'\]"),
    "other algorithm": (lambda state: {**state, "algo": "ma" if state["algo"] != "ma" else "bmuf"},
                        r"checkpoint is for sync algo '\w+', this job runs"),
    "other names": (lambda state: {**state, "param_names": ["weight", "head.bias"]},
                    r"different dense parameters: 2 names vs 2 here; differing: \['bias', 'head\.bias'\]"),
    "not a mapping": (lambda state: {**state, "algorithm": None}, r"checkpoint refused: \w+ state must be a mapping"),
    "other shapes": (resized, r"checkpoint refused: \w+ state '\w+' has shape \(16,\), expected \(15,\)"),
    "nan": (nan_like, r"checkpoint refused: \w+ state '\w+' holds NaN or Inf values"),
}


@pytest.mark.parametrize("algo", ["ma", "easgd", "bmuf"])
def test_a_checkpoint_that_does_not_fit_is_refused_naming_why_and_changes_nothing(one_rank_group, algo: str) -> None:  # noqa: ANN001
    sync = started_sync(algo)
    try:
        with torch.no_grad():
            for value in sync._algorithm.state_dict():
                getattr(sync._algorithm, value).add_(0.5)  # a live state that is not the initial one
        live = sync.state_dict()
        for name, (make, message) in BAD_STATES.items():
            if not live["algorithm"] and name in ("other shapes", "nan"):
                continue  # MA keeps no state to resize or poison
            with pytest.raises(CheckpointError, match=message):
                sync.load_state_dict(make(live))
            after = sync.state_dict()
            assert after["algo"] == live["algo"] and after["param_names"] == live["param_names"], name
            for key, value in live["algorithm"].items():
                torch.testing.assert_close(after["algorithm"][key], value, rtol=0, atol=0, msg=name)
        sync.load_state_dict(live)  # its own state still loads
    finally:
        sync.close()
