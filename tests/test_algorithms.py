"""Each algorithm's round equals its formula, computed here from every rank's snapshot."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import sync_algos
from shadowgba.metrics import GBAMetrics
from sync_algos.base import FlaggedAllReduce, RoundResult, all_finite, is_finite
from sync_algos.compressed import CompressedSum
from sync_algos.easgd import elastic_pull
from sync_algos.easgd_ps import Centre
from sync_algos.gba import Admission, AggregationConfig, GlobalBatchRule
from sync_algos.staleness import StalenessCounts, StalenessDecayConfig
from tests.multiprocess import run_shared

pytestmark = pytest.mark.timeout(120)

SIZE = 7


def snapshot_of(rank: int, round_index: int) -> torch.Tensor:
    """A deterministic, rank- and round-specific snapshot every process can recompute."""
    generator = torch.Generator().manual_seed(1000 * rank + round_index)
    return torch.randn(SIZE, generator=generator, dtype=torch.float64)


INITIAL = torch.linspace(-1.0, 1.0, SIZE, dtype=torch.float64)


def target_of(round_fn: Callable[..., RoundResult], snapshot: torch.Tensor, stop: bool = False) -> tuple[RoundResult, torch.Tensor]:
    """Run a round (`algorithm.round` or `.sync`) on a copy of `snapshot`, which the round turns into
    the delta `t - s` (or, healed, the consensus `t` itself); return its result and the target
    `s + (t - s)` (or `t`)."""
    delta = snapshot.clone()
    result = round_fn(delta, stop=stop)
    return result, delta if result.healed else snapshot + delta


def run_rounds(rank: int, world_size: int, name: str, options: dict, rounds: int) -> dict:
    algorithm = sync_algos.build_algorithm(name, options, None, INITIAL.clone())
    targets = [target_of(algorithm.round, snapshot_of(rank, r))[1] for r in range(rounds)]
    return {"targets": targets, "state": algorithm.state_dict()}


class RecordingGuard:
    """A `state_guard` that records, each time it is entered, how many collectives the rounds had
    finished and the state then, and the state when it is left."""

    def __init__(self, algorithm: sync_algos.SyncAlgorithm) -> None:
        self.algorithm, self.collectives, self.spans = algorithm, 0, []
        reduce = algorithm.allreduce.sum

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = reduce(*args, **kwargs)
            self.collectives += 1
            return result

        algorithm.allreduce.sum = counted

    def state(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self.algorithm, name).clone() for name in self.algorithm.state_names}

    def __enter__(self) -> None:
        self.spans.append({"collectives": self.collectives, "entered": self.state()})

    def __exit__(self, *exc: object) -> None:
        self.spans[-1]["left"] = self.state()


def guarded_rounds(rank: int, world_size: int, name: str, rounds: int) -> dict:
    """`rounds` synced rounds (the first one places the state) with a recording guard."""
    algorithm = sync_algos.build_algorithm(name, {}, None, INITIAL.clone())
    guard = RecordingGuard(algorithm)
    algorithm.state_guard = guard
    states = [guard.state()]
    for r in range(rounds):
        algorithm.sync(snapshot_of(rank, r), stop=False)
        states.append(guard.state())
    return {"spans": guard.spans, "states": states}


def snapshots(world_size: int, round_index: int) -> torch.Tensor:
    return torch.stack([snapshot_of(rank, round_index) for rank in range(world_size)])


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list]:
    """Every 2-rank job of this file in one spawned group (see `run_shared`)."""
    return run_shared(2, {
        "ma": (run_rounds, ("ma", {}, 2)),
        "bmuf-nesterov": (run_rounds, ("bmuf", {"nesterov": True}, 3)),
        "bmuf-classic": (run_rounds, ("bmuf", {"nesterov": False}, 3)),
        **{f"synced-{name}": (run_synced_rounds, (name, None)) for name in ("ma", "easgd", "bmuf")},
        "restored-easgd": (run_synced_rounds, ("easgd", {"center": torch.full((SIZE,), 3.0, dtype=torch.float64)})),
        **{f"guarded-{name}": (guarded_rounds, (name, 3)) for name in ("easgd", "bmuf")},
        "easgd_ps": (easgd_ps_rounds, ([False, True],)),
        "easgd_ps-poisoned": (easgd_ps_poisoned_round, ()),
    }, timeout_s=150)


@pytest.fixture(scope="module")
def three_ranks() -> dict[str, list]:
    """Every 3-rank job of this file in one spawned group; the abort job runs last."""
    return run_shared(3, {
        "ma": (run_rounds, ("ma", {}, 2)),
        "bmuf-zero-momentum": (run_rounds, ("bmuf", {"block_momentum": 0.0, "block_lr": 1.0}, 3)),
        "easgd": (run_rounds, ("easgd", {}, 1)),
        **{f"stop-{name}": (stop_at, (name, {0: 99, 1: 2, 2: 5})) for name in COLLECTIVE_ALGORITHMS},
        **{f"compressed-{kind}": (compressed_rounds, (kind,)) for kind in ("bf16", "int8")},
        "nonfinite-and-abort": (nonfinite_and_aborted_rounds, (["ma", "easgd", "bmuf"],)),
    }, timeout_s=150)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ma_round_is_the_average(world_size: int, two_ranks: dict, three_ranks: dict) -> None:
    results = (two_ranks if world_size == 2 else three_ranks)["ma"]
    for round_index in range(2):
        expected = snapshots(world_size, round_index).mean(0)
        for result in results:
            torch.testing.assert_close(result["targets"][round_index], expected)


def test_bmuf_with_zero_momentum_and_unit_block_lr_is_ma(three_ranks: dict) -> None:
    results = three_ranks["bmuf-zero-momentum"]
    for round_index in range(3):
        expected = snapshots(3, round_index).mean(0)
        for result in results:
            torch.testing.assert_close(result["targets"][round_index], expected)


@pytest.mark.parametrize("nesterov", [True, False])
def test_bmuf_matches_block_momentum_formula(nesterov: bool, two_ranks: dict) -> None:
    world_size, rounds = 2, 3
    results = two_ranks["bmuf-nesterov" if nesterov else "bmuf-classic"]
    eta, zeta = 1.0 - 1.0 / world_size, 1.0
    global_model, momentum = INITIAL.clone(), torch.zeros(SIZE, dtype=torch.float64)
    start = INITIAL.clone()
    for round_index in range(rounds):
        block = snapshots(world_size, round_index).mean(0) - start
        momentum = eta * momentum + zeta * block
        global_model = global_model + momentum
        expected = global_model + eta * momentum if nesterov else global_model
        start = expected
        for result in results:
            torch.testing.assert_close(result["targets"][round_index], expected)
    for result in results:
        torch.testing.assert_close(result["state"]["global_model"], global_model)
        torch.testing.assert_close(result["state"]["momentum"], momentum)


def test_easgd_round_conserves_replicas_plus_centre_and_follows_formula(three_ranks: dict) -> None:
    world_size = 3
    results = three_ranks["easgd"]
    alpha = 0.9 / world_size
    s = snapshots(world_size, 0)
    pulls = alpha * (s - INITIAL)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["targets"][0], s[rank] - pulls[rank])
        torch.testing.assert_close(result["state"]["center"], INITIAL + pulls.sum(0))
    targets = torch.stack([result["targets"][0] for result in results])
    centre = results[0]["state"]["center"]
    torch.testing.assert_close(targets.sum(0) + centre, s.sum(0) + INITIAL)


def run_synced_rounds(rank: int, world_size: int, name: str, restored: dict | None) -> dict:
    """Two rounds the way the runtime runs them (`sync`), optionally after restoring a state."""
    algorithm = sync_algos.build_algorithm(name, {}, None, INITIAL.clone())
    if restored is not None:
        algorithm.load_state_dict(restored)
    targets, states = [], []
    for round_index in range(2):
        targets.append(target_of(algorithm.sync, snapshot_of(rank, round_index))[1])
        states.append(algorithm.state_dict())
    return {"targets": targets, "states": states}


@pytest.mark.parametrize("name", ["ma", "easgd", "bmuf"])
def test_the_first_synced_round_averages_and_starts_the_state_there(name: str, two_ranks: dict) -> None:
    world_size = 2
    results = two_ranks[f"synced-{name}"]
    average = snapshots(world_size, 0).mean(0)
    second = snapshots(world_size, 1)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["targets"][0], average)
        if name == "easgd":  # centre placed at the average, then EASGD's formula from there
            torch.testing.assert_close(result["states"][0]["center"], average)
            alpha = 0.9 / world_size
            torch.testing.assert_close(result["targets"][1], second[rank] - alpha * (second[rank] - average))
        if name == "bmuf":  # Wg at the average, no momentum; the next block's progress gets eta = 1/2
            torch.testing.assert_close(result["states"][0]["global_model"], average)
            torch.testing.assert_close(result["states"][0]["momentum"], torch.zeros(SIZE, dtype=torch.float64))
            block = second.mean(0) - average
            torch.testing.assert_close(result["targets"][1], average + block + 0.5 * block)


def test_a_restored_state_is_kept_by_the_first_synced_round(two_ranks: dict) -> None:
    results = two_ranks["restored-easgd"]  # restored centre: 3.0 everywhere
    s = snapshots(2, 0)
    pulls = 0.45 * (s - 3.0)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["targets"][0], s[rank] - pulls[rank])
        torch.testing.assert_close(result["states"][0]["center"], 3.0 + pulls.sum(0))


def stop_at(rank: int, world_size: int, name: str, stop_round: dict[int, int]) -> list[bool]:
    """Each rank raises its flag from its own `stop_round`; returns the flags it saw until leaving."""
    algorithm = sync_algos.build_algorithm(name, {}, None, INITIAL.clone())
    seen = []
    for round_index in range(10):
        result = algorithm.round(snapshot_of(rank, round_index), stop=round_index >= stop_round[rank])
        seen.append(result.stop)
        if result.stop:
            break
    return seen


COLLECTIVE_ALGORITHMS = [
    name for name in sync_algos.algorithm_names()
    if sync_algos.get_algorithm(name).kind == "model" and sync_algos.get_algorithm(name).uses_collectives
]


@pytest.mark.parametrize("name", COLLECTIVE_ALGORITHMS)
def test_one_rank_raising_the_stop_flag_stops_every_rank_in_the_same_round(name: str, three_ranks: dict) -> None:
    seen = three_ranks[f"stop-{name}"]  # rank 1 stops from round 2, rank 2 from round 5, rank 0 never
    assert seen == [[False, False, True]] * 3


@pytest.mark.parametrize("name", ["easgd", "bmuf"])
def test_rounds_change_the_state_only_under_the_guard_and_only_after_their_collective(name: str, two_ranks: dict) -> None:
    """What lets a checkpoint copy the state from another thread without waiting for a collective."""
    for result in two_ranks[f"guarded-{name}"]:
        spans, states = result["spans"], result["states"]
        assert [span["collectives"] for span in spans] == [1, 2, 3]  # one change per round, after its collective
        for before, span, after in zip(states, spans, states[1:]):
            for key in before:  # nothing changed before the guard was taken, nor after it was left
                assert torch.equal(span["entered"][key], before[key]) and torch.equal(span["left"][key], after[key])
            assert any(not torch.equal(before[key], after[key]) for key in before)


def test_state_dict_copies_under_the_guard() -> None:
    cls = sync_algos.get_algorithm("easgd")
    algorithm = cls.__new__(cls)
    algorithm.center = torch.zeros(4)
    lock = threading.Lock()
    algorithm.state_guard = lock
    copies: list[dict] = []
    with lock:  # a round halfway through changing the state
        reader = threading.Thread(target=lambda: copies.append(algorithm.state_dict()))
        reader.start()
        reader.join(timeout=0.3)
        assert reader.is_alive() and not copies
        algorithm.center += 1.0
    reader.join(timeout=5)
    assert torch.equal(copies[0]["center"], torch.ones(4))


def test_state_dict_round_trip_and_refusal_of_a_foreign_checkpoint() -> None:
    def build() -> sync_algos.SyncAlgorithm:
        cls = sync_algos.get_algorithm("bmuf")
        algorithm = cls.__new__(cls)
        algorithm.global_model = torch.zeros(4)
        algorithm.momentum = torch.zeros(4)
        algorithm.name = "bmuf"
        return algorithm

    algorithm = build()
    state = {"global_model": torch.arange(4.0), "momentum": torch.ones(4)}
    algorithm.load_state_dict(state)
    torch.testing.assert_close(algorithm.state_dict()["global_model"], torch.arange(4.0))
    with pytest.raises(ValueError, match=r"'momentum' has shape \(5,\), expected \(4,\)"):
        algorithm.load_state_dict({"global_model": torch.zeros(4), "momentum": torch.zeros(5)})
    torch.testing.assert_close(algorithm.state_dict()["global_model"], torch.arange(4.0))
    with pytest.raises(ValueError, match="missing \\['momentum'\\]"):
        algorithm.load_state_dict({"global_model": torch.zeros(4)})


def test_unknown_algorithm_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown sync algorithm 'sgdx'; allowed: \['bmuf', 'easgd', 'easgd_ps', 'gba', 'ma'\]"):
        sync_algos.get_algorithm("sgdx")


class ScriptedCentre(Centre):
    """A centre that answers each exchange with a pull fixed in advance and records the calls."""

    def __init__(self, pulls: list[torch.Tensor], running: torch.Tensor | None = None) -> None:
        self.pulls = pulls
        self.running = running
        """A centre that other trainers have moved already (None: it starts at the first `init`)."""
        self.initial: torch.Tensor | None = None
        self.exchanges: list[tuple[torch.Tensor, float]] = []

    def init(self, initial: torch.Tensor) -> torch.Tensor:
        self.initial = initial.clone()
        return initial.clone() if self.running is None else self.running.clone()

    def exchange(self, snapshot: torch.Tensor, alpha: float) -> torch.Tensor:
        self.exchanges.append((snapshot.clone(), alpha))
        return self.pulls[len(self.exchanges) - 1]

    def read(self) -> torch.Tensor:
        return self.running.clone() if self.running is not None else self.initial.clone()


def easgd_ps_rounds(rank: int, world_size: int, stops: list[bool]) -> dict:
    """S-EASGD against a scripted centre: the algorithm only talks to its `Centre`."""
    pulls = [torch.full((SIZE,), 0.1 * (r + 1), dtype=torch.float64) for r in range(len(stops))]
    centre = ScriptedCentre(pulls)
    algorithm = sync_algos.build_algorithm("easgd_ps", {"beta": 0.6}, None, INITIAL.clone(), centre=centre)
    results = [target_of(algorithm.sync, snapshot_of(rank, r), stop) for r, stop in enumerate(stops)]
    return {"results": results, "pulls": pulls, "initial": centre.initial, "exchanges": centre.exchanges}


def test_easgd_ps_targets_its_centres_pull_with_alpha_beta_over_n_and_no_agreement_on_stop(two_ranks: dict) -> None:
    stops = [False, True]
    for rank, result in enumerate(two_ranks["easgd_ps"]):
        torch.testing.assert_close(result["initial"], INITIAL)
        for r, ((round_result, target), pull) in enumerate(zip(result["results"], result["pulls"])):
            snapshot, alpha = result["exchanges"][r]
            torch.testing.assert_close(snapshot, snapshot_of(rank, r))
            assert alpha == 0.6 / 2
            torch.testing.assert_close(target, snapshot - pull)  # no averaging first round
            assert round_result.stop == stops[r]  # each trainer's own flag: no collective
            assert round_result.bytes_moved == 2 * SIZE * 8


def test_easgd_ps_without_a_group_starts_at_a_running_centre_with_alpha_over_its_trainers() -> None:
    """A trainer that joins a job already running, with no process group (torch.distributed not
    initialised here): it starts at the centre, not at its own weights, and `trainers` sets alpha."""
    assert not dist.is_initialized()
    running = torch.full((SIZE,), 3.0, dtype=torch.float64)
    centre = ScriptedCentre([torch.full((SIZE,), 0.5, dtype=torch.float64)], running=running)
    initial = INITIAL.clone()
    algorithm = sync_algos.build_algorithm("easgd_ps", {"beta": 0.6}, None, initial, centre=centre, trainers=3)
    torch.testing.assert_close(centre.initial, INITIAL)  # offered its own weights
    torch.testing.assert_close(initial, running)  # and starts where the centre is
    result, target = target_of(algorithm.sync, snapshot_of(0, 0), True)
    assert centre.exchanges[0][1] == pytest.approx(0.6 / 3)
    torch.testing.assert_close(target, snapshot_of(0, 0) - 0.5)
    assert (result.stop, result.last, result.kept_local) == (True, True, False)


def test_elastic_pull_conserves_replica_plus_centre() -> None:
    snapshot, centre = snapshot_of(0, 0), INITIAL.clone()
    pull = elastic_pull(snapshot, centre, 0.25)
    torch.testing.assert_close(pull, 0.25 * (snapshot - centre))
    torch.testing.assert_close((snapshot - pull) + (centre + pull), snapshot + centre)


def test_gba_rule_refuses_bad_tokens_and_closes_a_global_batch_on_the_sample_count() -> None:
    rule = GlobalBatchRule(AggregationConfig(decay=StalenessDecayConfig(kind="drop", threshold=0)), global_batch=5)
    for token, message in ((1, r"token 1 is from the future \(global step is 0\)"), (-1, "token must be >= 0")):
        with pytest.raises(ValueError, match=message):
            rule.admit(token, 1)
    assert (rule.global_step, rule.buffered_samples) == (0, 0)
    assert rule.admit(0, 3) == Admission(staleness=0, weight=1.0, scale=3.0, completed_samples=0, buffered_samples=3)
    assert rule.admit(0, 4) == Admission(staleness=0, weight=1.0, scale=4.0, completed_samples=7, buffered_samples=0)
    assert (rule.global_step, rule.buffered_samples) == (1, 0)
    dropped = rule.admit(0, 9)  # staleness 1 > threshold 0: dropped, counts nothing
    assert dropped.dropped and (dropped.scale, dropped.completed_samples, rule.buffered_samples) == (0.0, 0, 0)
    rule.admit(1, 2)
    assert rule.discard() == 2 and rule.buffered_samples == 0
    with pytest.raises(ValueError, match="global_batch must be >= 1"):
        GlobalBatchRule(AggregationConfig(), global_batch=0)


def test_gba_rule_without_aggregation_completes_a_step_on_every_kept_push() -> None:
    rule = GlobalBatchRule(AggregationConfig(aggregation="none"), global_batch=100)
    assert [rule.admit(k, 2).completed_samples for k in range(3)] == [2, 2, 2]
    assert rule.global_step == 3


def test_staleness_counts_classify_weights_for_servers_and_trainers_alike() -> None:
    counts = StalenessCounts()
    for staleness, weight in ((0, 1.0), (3, 0.5), (20, 0.0)):
        counts.add(staleness, weight)
    assert counts.summary() == {"decayed": 1, "dropped": 1, "staleness_histogram": {"0": 1, "3": 1, "16+": 1}}
    trainer = GBAMetrics()
    for weight in (1.0, 0.5, 0.0, 0.0):
        trainer.record_push(weight)
    assert (trainer.summary()["decayed"], trainer.summary()["stale_dropped"]) == (1, 2)


def test_every_entry_has_a_kind_and_only_model_algorithms_are_built_here() -> None:
    kinds = {name: sync_algos.get_algorithm(name).kind for name in sync_algos.algorithm_names()}
    assert kinds == {"bmuf": "model", "easgd": "model", "easgd_ps": "model", "gba": "gradient", "ma": "model"}
    with pytest.raises(ValueError, match="'gba' is a gradient algorithm: no round to build; its rule runs on the"):
        sync_algos.build_algorithm("gba", {}, None, INITIAL.clone())


def poisoned(rank: int, round_index: int) -> torch.Tensor:
    """`snapshot_of` with NaN / Inf in two places: what a diverged replica sends."""
    snapshot = snapshot_of(rank, round_index)
    snapshot[1], snapshot[4] = float("nan"), float("inf")
    return snapshot


NONFINITE_SCRIPT = [  # per round: which ranks send a poisoned snapshot; rank 2 aborts in round 3
    {1},
    {0, 1, 2},
    {1},
    set(),
]


def nonfinite_and_aborted_rounds(rank: int, world_size: int, names: list[str]) -> dict:
    """Every algorithm of `names` through NONFINITE_SCRIPT, the way the runtime runs rounds (`sync`)."""
    out = {}
    for name in names:
        algorithm = sync_algos.build_algorithm(name, {}, None, INITIAL.clone())
        rounds = []
        for r, bad in enumerate(NONFINITE_SCRIPT):
            if r == 3 and rank == 2:
                algorithm.abort_round()
                rounds.append(None)
                continue
            snapshot = poisoned(rank, r) if rank in bad else snapshot_of(rank, r)
            result, target = target_of(algorithm.sync, snapshot)
            rounds.append({"result": result, "target": target, "state": algorithm.state_dict()})
        out[name] = rounds
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_is_finite_finds_every_nan_and_infinity_and_passes_finite_values_whose_sum_overflows(dtype: torch.dtype) -> None:
    """The sum is the fast test; finite values too large to sum must not be taken for infinities."""
    big = torch.finfo(dtype).max
    finite_cases = [torch.zeros(0, dtype=dtype), torch.randn(1000).to(dtype), torch.full((64,), big, dtype=dtype),
                    torch.tensor([big, big, -big], dtype=dtype)]
    assert all(is_finite(case) for case in finite_cases)
    assert not torch.isfinite(finite_cases[2].sum())  # the fallback path really ran
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 500, 999):
            values = torch.randn(1000).to(dtype)
            values[where] = bad
            assert not is_finite(values), (bad, where)
        assert not is_finite(torch.tensor([big, bad, big], dtype=dtype)), bad  # an overflowing sum with a real one
    assert not is_finite(torch.tensor([float("inf"), -float("inf")], dtype=dtype))  # sums to NaN
    assert is_finite(torch.tensor([1, 2, 3]))  # integers have no NaN


def test_all_finite_finds_one_bad_value_among_many_tensors_of_mixed_dtypes_and_passes_sums_that_overflow() -> None:
    """A step's gradients are checked together (one read of the sums): one NaN / Inf in any tensor
    fails them all; finite tensors whose sums, or the sum of whose sums, overflow pass (the exact
    fallback); integers and empty tensors are skipped."""
    big32 = torch.finfo(torch.float32).max
    good = [torch.randn(100), torch.randn(7, dtype=torch.float64), torch.randn(9).to(torch.bfloat16),
            torch.zeros(0), torch.tensor([1, 2])]
    assert all_finite(good) and all_finite([]) and all_finite(iter(good))  # a generator is read once
    overflowing = [torch.full((2,), big32), torch.full((2,), big32), torch.tensor([1e300], dtype=torch.float64)]
    assert all(bool(torch.isfinite(tensor.sum())) for tensor in overflowing[2:])
    assert not bool(torch.isfinite(torch.stack([t.sum().float() for t in overflowing]).sum()))  # the fallback ran
    assert all_finite(overflowing)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for index in range(3):
            tensors = [tensor.clone() for tensor in good]
            tensors[index].view(-1)[-1] = bad
            assert not all_finite(tensors), (bad, index)
            assert not all_finite([*overflowing, tensors[index]]), (bad, index)  # behind an overflow too


def test_a_nonfinite_contribution_is_left_out_and_an_aborting_rank_stops_its_peers(three_ranks: dict) -> None:
    """3 ranks: rank 1's snapshot holds NaN / Inf in rounds 0 and 2, every rank's in round 1, and rank 2
    aborts in round 3. Good ranks follow each formula over the good ranks only (n_good for n); the bad
    rank is offered the good ranks' consensus (healed: the average, BMUF's block start, EASGD's
    centre); a round with no good rank changes nothing and heals nobody; the abort round stops
    everyone and names rank 2, its peers averaging without it. Nothing non-finite reaches any state."""
    names = ["ma", "easgd", "bmuf"]
    results = three_ranks["nonfinite-and-abort"]
    for name in names:
        runs = [result[name] for result in results]
        for r, bad in enumerate(NONFINITE_SCRIPT[:3]):
            for rank in range(3):
                result = runs[rank][r]["result"]
                assert result.nonfinite_ranks == tuple(sorted(bad)) and not result.stop and result.aborted_ranks == ()
                assert result.kept_local == (rank in bad) and result.healed == (rank in bad and len(bad) < 3)
                if rank in bad and not result.healed:  # its own weights, untouched (NaN where they were NaN)
                    torch.testing.assert_close(runs[rank][r]["target"], poisoned(rank, r), equal_nan=True)
                for value in runs[rank][r]["state"].values():
                    assert torch.isfinite(value).all(), (name, r, rank)
            states = [runs[rank][r]["state"] for rank in range(3)]
            for state in states[1:]:
                for key, value in state.items():
                    torch.testing.assert_close(value, states[0][key])
        good = [0, 2]
        first_average = snapshots(3, 0)[good].mean(0)
        for rank in range(3):  # round 0: the consensus start over ranks 0 and 2, which heals rank 1
            torch.testing.assert_close(runs[rank][0]["target"], first_average)
        for key, value in runs[0][1]["state"].items():  # round 1: nobody good, nothing changed
            torch.testing.assert_close(value, runs[0][0]["state"][key])
        second = snapshots(3, 2)
        if name == "ma":
            expected = {rank: second[good].mean(0) for rank in good}
        elif name == "easgd":
            alpha = 0.9 / 3
            pulls = alpha * (second - first_average)
            expected = {rank: second[rank] - pulls[rank] for rank in good}
            torch.testing.assert_close(runs[0][2]["state"]["center"], first_average + pulls[good].sum(0))
        else:  # bmuf: eta = 1 - 1/3, the block measured over the good ranks only
            block = second[good].mean(0) - first_average
            expected = {rank: first_average + block + (2 / 3) * block for rank in good}
        for rank in good:
            torch.testing.assert_close(runs[rank][2]["target"], expected[rank])
        consensus = runs[0][2]["state"]["center"] if name == "easgd" else expected[0]  # ma, bmuf: every target alike
        torch.testing.assert_close(runs[1][2]["target"], consensus)  # rank 1 healed
        for rank in (0, 1):  # round 3: rank 2 aborted; ranks 0 and 1 stop, and average without it
            result = runs[rank][3]["result"]
            assert result.stop and result.aborted_ranks == (2,) and result.nonfinite_ranks == () and not result.kept_local
        if name == "ma":
            torch.testing.assert_close(runs[0][3]["target"], snapshots(3, 3)[:2].mean(0))


def test_easgd_ps_never_sends_a_nonfinite_snapshot_to_its_centre_and_is_healed_by_it(two_ranks: dict) -> None:
    """Each trainer's own centre: a trainer reports only itself (there is no collective to tell the
    others), and is offered the centre, read without an exchange."""
    for rank, result in enumerate(two_ranks["easgd_ps-poisoned"]):
        assert result["exchanges"] == 1  # only the finite snapshot reached the centre
        bad, target = result["bad"]
        assert bad.kept_local and bad.healed and bad.nonfinite_ranks == (rank,)
        torch.testing.assert_close(target, INITIAL)  # the centre, still where the trainer started it


def easgd_ps_poisoned_round(rank: int, world_size: int) -> dict:
    centre = ScriptedCentre([torch.zeros(SIZE, dtype=torch.float64)])
    algorithm = sync_algos.build_algorithm("easgd_ps", {}, None, INITIAL.clone(), centre=centre)
    bad = target_of(algorithm.sync, poisoned(rank, 0))
    algorithm.sync(snapshot_of(rank, 1), stop=False)
    return {"bad": bad, "exchanges": len(centre.exchanges)}


def test_algorithm_state_holding_nan_is_refused_and_changes_nothing() -> None:
    cls = sync_algos.get_algorithm("easgd")
    algorithm = cls.__new__(cls)
    algorithm.center, algorithm.started = torch.ones(4), False
    with pytest.raises(ValueError, match="easgd state 'center' holds NaN or Inf values"):
        algorithm.load_state_dict({"center": torch.tensor([0.0, float("nan"), 0.0, 0.0])})
    with pytest.raises(ValueError, match="easgd state must be a mapping"):
        algorithm.load_state_dict([torch.zeros(4)])  # type: ignore[arg-type]
    torch.testing.assert_close(algorithm.center, torch.ones(4))
    assert not algorithm.started


COMPRESSED_ROUNDS, NAN_ROUND = 12, 6
"""Rounds of `compressed_rounds`; in NAN_ROUND rank 1's snapshot holds NaN / Inf."""


def compressed_rounds(rank: int, world_size: int, kind: str) -> dict:
    """ma, bmuf and easgd with `compress=kind`, fed snapshots that move a little (0.01 x N(0, 1)) from
    the last target each round, as local training would; beside each round, the exact average of the
    same snapshots."""
    out = {}
    for name in ("ma", "bmuf", "easgd"):
        algorithm = sync_algos.build_algorithm(name, {}, None, INITIAL.clone(), compress=kind)
        exact = FlaggedAllReduce(None, INITIAL)
        current, rounds = INITIAL.clone(), []
        for r in range(COMPRESSED_ROUNDS):
            snapshot = current + 0.01 * snapshot_of(rank, r)
            if r == NAN_ROUND and rank == 1:
                snapshot[2] = float("nan")
            mean = exact.sum(snapshot, stop=False).mean_().clone()
            result, target = target_of(algorithm.sync, snapshot)
            rounds.append({"target": target, "mean": mean, "result": result, "state": algorithm.state_dict()})
            current = target
        out[name] = rounds
    return out


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_compressed_rounds_agree_everywhere_and_stay_within_rounding_of_the_exact_ones(three_ranks: dict, kind: str) -> None:
    """The first round is exact; each later one's consensus is the same on every rank, and MA's is the
    exact average of the same snapshots but for rounding of the replicas' small differences (error
    feedback keeps the rounding of all rounds together that small too); a NaN snapshot is left out."""
    runs = three_ranks[f"compressed-{kind}"]
    bound = 0.02 * 0.01 * 4  # 2% of the largest difference a replica sends (|N(0, 1)| < 4 here)
    for name in ("ma", "bmuf", "easgd"):
        for r in range(COMPRESSED_ROUNDS):
            states = [runs[rank][name][r]["state"] for rank in range(3)]
            for state in states[1:]:  # centre, global model and momentum alike on every rank
                assert all(torch.equal(state[key], states[0][key]) for key in state), (name, r)
            if name != "easgd":  # every replica's target is the consensus (up to s + (t - s) != t in the last bit)
                targets = [runs[rank][name][r]["target"] for rank in range(3)]
                for target in targets[1:]:
                    torch.testing.assert_close(target, targets[0], rtol=0, atol=1e-12)
            assert all(torch.isfinite(runs[rank][name][r]["target"]).all() for rank in range(3)), (name, r)
        ma = runs[0][name]
        if name == "ma":
            assert torch.equal(ma[0]["target"], ma[0]["mean"])  # exact: the reference is not agreed yet
            errors = [ma[r]["target"] - ma[r]["mean"] for r in range(1, COMPRESSED_ROUNDS) if r != NAN_ROUND]
            assert 0 < max(error.abs().max().item() for error in errors) <= bound, kind
            assert sum(errors).abs().max().item() <= bound, kind  # no drift over the rounds
        assert runs[0][name][NAN_ROUND]["result"].nonfinite_ranks == (1,), name


@pytest.mark.parametrize(("kind", "at_least"), [("bf16", 2.0), ("int8", 3.9)])
def test_compressed_rounds_send_at_most_a_half_or_a_quarter_of_the_bytes(kind: str, at_least: float) -> None:
    """At the production dense size (1.9M values) over 2 ranks: the payload as sent, against fp32."""
    numel = 1_900_000
    compressed = CompressedSum(kind, None, numel, 2, torch.device("cpu"))
    assert 4 * numel / compressed.bytes_per_call >= at_least
