"""GBA's server side in-process: tokens, staleness decay, global-batch aggregation, validation,
the flat optimizer's exact slicing, and the switch policy's hysteresis."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from shadowgba.errors import ConfigError, PeerLost, SyncError

from shadowgba.flat_optimizer import (SHARD_ALIGN, FlatOptimizer, LRSchedule, OptimizerSpec, concat_exports, shard_bounds,
                                      slice_export)
from shadowgba.config import from_dict
from shadowgba.gba.client import entered_step
from shadowgba.gba.config import GBAConfig
from shadowgba.dense import DenseParams
from shadowgba.gba.fresh import FreshWaitPolicy
from shadowgba.gba.lookahead import LONGEST_GAP, Lookahead
from shadowgba.gba.switch_policy import SwitchPolicy, SwitchPolicyConfig
from shadowgba.gba.server import WATCHERS, DenseShard
from shadowgba.gba.shards import DenseShardClient, PushRequest
from shadowgba.job.roster import Roster
from shadowgba.ps.server_state import CheckpointWriter, ServerCheckpoints
from shadowgba.job.roles import Roles
from sync_algos.gba import GlobalBatchAggregator
from sync_algos.staleness import StalenessDecayConfig


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("drop", [1, 1, 1, 0, 0, 0]),
        ("exponential", [1, 1, 1, 0.5, 0.25, 0.125]),
        ("inverse_power", [1, 1, 1, 1 / 2, 1 / 3, 1 / 4]),
        ("none", [1, 1, 1, 1, 1, 1]),
    ],
)
def test_decay_functions_on_constructed_staleness(kind: str, expected: list[float]) -> None:
    decay = StalenessDecayConfig(kind=kind, threshold=2, rate=0.5, power=1.0, max_staleness=5)
    assert [decay.weight(s) for s in range(6)] == pytest.approx(expected)
    assert decay.weight(6) == 0.0  # beyond max_staleness: dropped whatever the kind


def test_decay_config_validation() -> None:
    with pytest.raises(ValueError, match="rate must be in"):
        StalenessDecayConfig(rate=0.0)
    with pytest.raises(ValueError, match="max_staleness .* must be >= threshold"):
        StalenessDecayConfig(threshold=5, max_staleness=3)


def aggregator(global_batch: int, **decay: object) -> GlobalBatchAggregator:
    return GlobalBatchAggregator(GBAConfig(decay=StalenessDecayConfig(**decay)), 3, torch.float64, global_batch)


def test_aggregator_applies_the_sample_weighted_mean_once_a_global_batch_is_full() -> None:
    agg = aggregator(global_batch=8)
    g1, g2 = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    assert agg.add(g1, token=0, num_samples=4) == (0, 1.0, None)
    staleness, weight, mean = agg.add(g2, token=0, num_samples=4)
    assert (staleness, weight, agg.global_step) == (0, 1.0, 1)
    torch.testing.assert_close(mean, (g1 + g2) / 2)
    assert agg.buffered_samples == 0
    # the next global batch starts from nothing: neither this mean nor a discarded part leaks into it
    agg.add(g1, token=1, num_samples=4)
    assert agg.discard() == 4
    agg.add(g2, token=1, num_samples=4)
    torch.testing.assert_close(agg.add(g2, token=1, num_samples=4)[2], g2)


def test_stale_gradients_are_decayed_and_dropped_ones_do_not_fill_the_batch() -> None:
    agg = aggregator(global_batch=2, kind="drop", threshold=0, max_staleness=4)
    ones = torch.ones(3, dtype=torch.float64)
    agg.add(ones, 0, 1)
    agg.add(ones, 0, 1)  # k = 1
    assert agg.add(ones, token=0, num_samples=1) == (1, 0.0, None)  # staleness 1 > threshold 0: dropped
    assert agg.buffered_samples == 0
    decayed = aggregator(global_batch=2, kind="exponential", threshold=0, rate=0.5)
    decayed.add(ones, 0, 1)
    decayed.add(ones, 0, 1)  # k = 1
    decayed.add(ones, token=1, num_samples=1)
    _, weight, mean = decayed.add(ones, token=0, num_samples=1)
    assert weight == 0.5
    torch.testing.assert_close(mean, ones * 0.75)  # (1 + 0.5) / 2 samples


def test_token_from_the_future_is_refused() -> None:
    agg = aggregator(global_batch=4)
    with pytest.raises(ValueError, match="token 3 is from the future"):
        agg.add(torch.ones(3, dtype=torch.float64), token=3, num_samples=1)
    assert agg.buffered_samples == 0


@pytest.mark.parametrize("numel", [3 * SHARD_ALIGN + 77, 10])
@pytest.mark.parametrize("name", ["SGD", "Adagrad", "Adam", "AdamW"])
def test_flat_optimizer_state_slices_and_concatenates_exactly(name: str, numel: int) -> None:
    """Stepping slices on 'servers' equals stepping the whole vector on a 'trainer': bit for bit when
    the shard edges are aligned (`SHARD_ALIGN`), to an ulp for a vector too short to align."""
    torch.manual_seed(0)
    cls = getattr(torch.optim, name)
    kwargs = {"lr": 0.1, "momentum": 0.9} if name == "SGD" else {"lr": 0.1}
    spec = OptimizerSpec.of(cls([torch.nn.Parameter(torch.zeros(1))], **kwargs), LRSchedule(warmup_steps=3))
    whole = FlatOptimizer(spec, torch.randn(numel))
    grads = [torch.randn(numel) for _ in range(5)]
    for grad in grads[:2]:
        whole.step(grad)
    bounds = shard_bounds(numel, 3)
    aligned = all(start % SHARD_ALIGN == 0 for start, _ in bounds)
    assert aligned == (numel >= 3 * SHARD_ALIGN), bounds
    same = torch.equal if aligned else lambda got, want: torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    shards = []
    for start, end in bounds:
        shard = FlatOptimizer(spec, torch.zeros(end - start))
        shard.load(slice_export(whole.export(), start, end))
        shards.append(shard)
    for grad in grads[2:]:
        whole.step(grad)
        for shard, (start, end) in zip(shards, bounds):
            shard.step(grad[start:end])
    merged = concat_exports([shard.export() for shard in shards])
    reference = whole.export()
    assert merged["global_step"] == reference["global_step"] == 5
    assert same(merged["param"], reference["param"])
    for key, value in reference["state"].items():
        assert same(torch.as_tensor(merged["state"][key]), torch.as_tensor(value)), key


def test_a_one_element_vector_slices_and_concatenates_with_its_scalar_step_kept_whole() -> None:
    """Adam's moments of a 1-element vector have as many values as its scalar `step`: only the
    moments are sliced (slicing the 0-dim step raised IndexError)."""
    spec = OptimizerSpec.of(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.1), LRSchedule())
    whole = FlatOptimizer(spec, torch.ones(1))
    whole.step(torch.full((1,), 0.5))
    exported = whole.export()
    part = slice_export(exported, 0, 1)
    assert part["state"]["step"].dim() == 0 and part["state"]["exp_avg"].shape == (1,)
    merged = concat_exports([part])
    for key, value in exported["state"].items():
        assert torch.equal(merged["state"][key], value), key


def test_unsupported_optimizer_is_refused_by_name() -> None:
    optimizer = torch.optim.RMSprop([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match="RMSprop is not supported .* supported: \\['Adagrad', 'Adam', 'AdamW', 'SGD'\\]"):
        OptimizerSpec.of(optimizer, LRSchedule())


def configured_shard(numel: int = 4, on_nonfinite: str = "fail") -> DenseShard:
    spec = OptimizerSpec.of(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), LRSchedule())
    shard = DenseShard()
    initial = FlatOptimizer(spec, torch.zeros(numel)).export()
    shard.configure(0, numel, 2, spec, initial, GBAConfig(), global_batch=2, on_nonfinite=on_nonfinite)
    return shard


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, 0, 4, torch.ones(5), 0, 1, 0.0), r"gradient shape \(5,\), expected \(4,\)"),
        ((0, 0, 4, torch.ones(4, dtype=torch.float64), 0, 1, 0.0), "gradient dtype torch.float64, expected torch.float32"),
        ((0, 4, 8, torch.ones(4), 0, 1, 0.0), r"unknown parameter slice \[4, 8\)"),
        ((5, 0, 4, torch.ones(4), 0, 1, 0.0), "unknown trainer 5"),
        ((0, 0, 4, torch.ones(4), 7, 1, 0.0), "token 7 is from the future"),
        ((0, 0, 4, torch.ones(4), 0, 0, 0.0), "num_samples must be an integer >= 1, got 0"),
        ((0, 0, 4, torch.ones(4), 0, 1.5, 0.0), "num_samples must be an integer >= 1, got 1.5"),
        ((0, 0, 4, torch.ones(4), 0, True, 0.0), "num_samples must be an integer >= 1, got True"),
        ((0, 0, 4, torch.ones(4), 0, -3, 0.0), "num_samples must be an integer >= 1, got -3"),
        ((0, 0, 4, torch.full((4,), float("nan")), 0, 1, 0.0), "trainer 0's gradient has NaN or inf"),
        ((0, 0, 4, torch.ones(4), 0, 1, 0.0, False), "trainer 0's gradient has NaN or inf"),
    ],
)
def test_malformed_pushes_are_refused_and_leave_the_shard_untouched(args: tuple, message: str) -> None:
    shard = configured_shard()
    shard.push(PushRequest(1, 0, 4, torch.ones(4), 0, 1, 0.0))  # half a global batch buffered
    before = shard.stats()
    refusal = SyncError if "NaN or inf" in message else ValueError  # under `fail`: the job's failure, as on trainers
    with pytest.raises(refusal, match=message):
        shard.push(PushRequest(*args))
    after = shard.stats()
    assert after["buffered_samples"] == before["buffered_samples"] == 1
    assert after["pushes"] == before["pushes"] and after["global_step"] == 0
    torch.testing.assert_close(shard.pull().params, torch.zeros(4))


def test_a_shard_for_bf16_pushes_accumulates_them_in_its_own_dtype_and_refuses_any_other() -> None:
    spec = OptimizerSpec.of(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), LRSchedule())
    shard = DenseShard()
    shard.configure(0, 3, 2, spec, FlatOptimizer(spec, torch.zeros(3)).export(),
                    from_dict(GBAConfig, {"push_dtype": "bfloat16"}), global_batch=4)
    with pytest.raises(ValueError, match="gradient dtype torch.float32, expected torch.bfloat16 .sync.gba.push_dtype"):
        shard.push(PushRequest(0, 0, 3, torch.ones(3), 0, 1, 0.0))
    # 1 + 2^-7 is a bf16 value, 3 times it (3 samples) is not: only a product taken in fp32 is exact
    fine = torch.full((3,), 1 + 2**-7, dtype=torch.bfloat16)
    shard.push(PushRequest(0, 0, 3, fine, 0, 3, 0.0))
    reply = shard.push(PushRequest(1, 0, 3, torch.zeros(3, dtype=torch.bfloat16), 0, 1, 0.0))
    assert reply.token == 1 and reply.params.dtype == torch.float32
    torch.testing.assert_close(reply.params, torch.full((3,), -3 * (1 + 2**-7) / 4), rtol=0, atol=0)


def test_a_shard_for_bf16_parameters_rounds_its_watch_and_push_replies_but_never_its_pulls() -> None:
    spec = OptimizerSpec.of(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), LRSchedule())
    shard = DenseShard()
    shard.configure(0, 3, 2, spec, FlatOptimizer(spec, torch.zeros(3)).export(),
                    from_dict(GBAConfig, {"params_dtype": "bfloat16"}), global_batch=2)
    gradient = torch.full((3,), 1 + 2**-10)  # its negative, the new parameters, is no bf16 value
    shard.push(PushRequest(0, 0, 3, gradient, 0, 1, 0.0))
    stepped = shard.push(PushRequest(1, 0, 3, gradient, 0, 1, 0.0))
    watched = shard.watch(token=0, timeout_s=1.0).result()
    assert stepped.token == watched.token == 1 and stepped.params is watched.params  # one copy per step
    assert watched.params.dtype == torch.bfloat16 and torch.equal(watched.params.float(), -torch.ones(3))
    pulled = shard.pull().params
    assert pulled.dtype == torch.float32 and torch.equal(pulled, -gradient)  # exact: a phase starts or ends on it
    assert pulled is not shard._optimizer.param


def test_shard_steps_once_per_global_batch_and_tracks_staleness() -> None:
    shard = configured_shard()
    shard.push(PushRequest(0, 0, 4, torch.ones(4), 0, 1, 0.0))
    reply = shard.push(PushRequest(1, 0, 4, torch.ones(4), 0, 1, 0.0))
    assert reply.token == 1
    torch.testing.assert_close(reply.params, -torch.ones(4))  # SGD lr 1 on the mean gradient
    shard.push(PushRequest(0, 0, 4, torch.ones(4), 0, 1, 0.0))  # staleness 1
    stats = shard.stats()
    assert stats["staleness_histogram"] == {"0": 2, "1": 1} and stats["global_step"] == 1


def test_the_step_a_push_entered_is_the_one_its_global_batch_advances_k_to() -> None:
    """`fresh_wait` waits for `entered_step` of the last push (global batch of 2 one-sample pushes):
    the first push of a batch entered k + 1, the push completing it the k its reply carries, a stale
    one the batch still open, and a dropped one none (decay threshold 0: staleness 1 is dropped)."""
    shard = configured_shard()
    assert entered_step(shard.push(PushRequest(0, 0, 4, torch.ones(4), 0, 1, 0.0))) == 1
    assert entered_step(shard.push(PushRequest(1, 0, 4, torch.ones(4), 0, 1, 0.0))) == 1  # completed it
    assert entered_step(shard.push(PushRequest(0, 0, 4, torch.ones(4), 0, 1, 0.0))) == 2  # staleness 1, kept
    strict = DenseShard()
    spec = OptimizerSpec.of(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), LRSchedule())
    config = from_dict(GBAConfig, {"decay": {"kind": "drop", "threshold": 0}})
    strict.configure(0, 4, 2, spec, FlatOptimizer(spec, torch.zeros(4)).export(), config, global_batch=2,
                     on_nonfinite="fail")
    strict.push(PushRequest(0, 0, 4, torch.ones(4), 0, 1, 0.0))
    strict.push(PushRequest(1, 0, 4, torch.ones(4), 0, 1, 0.0))
    dropped = strict.push(PushRequest(0, 0, 4, torch.ones(4), 0, 1, 0.0))
    assert dropped.weight == 0.0 and entered_step(dropped) is None


def test_fresh_waits_are_bounded_by_a_share_of_compute_and_stop_while_they_time_out_or_cost_too_much() -> None:
    """`FreshWaitPolicy`, by hand: the bound is `share` x the moving average of the compute time
    (weights 0.8 / 0.2); after timeouts bring the share of useful waits under one half, only every
    10th step waits (a probe); useful waits bring the waiting back. Waits that succeed but take
    most of a step stop once the share of the compute time spent waiting passes the budget, and
    resume as that share decays over the steps that do not wait."""
    policy = FreshWaitPolicy(0.5, budget=1.0)
    assert policy.bound_s(0.100) == pytest.approx(0.050)
    assert policy.bound_s(0.200) == pytest.approx(0.5 * (0.8 * 0.100 + 0.2 * 0.200))  # 0.060
    for _ in range(3):  # useful: 1 -> 0.8 -> 0.64 -> 0.512, still waiting
        policy.record(fresh=False, waited_s=0.0)
    assert policy.useful == pytest.approx(0.512) and policy.bound_s(0.120) is not None  # step 3
    policy.record(fresh=False, waited_s=0.0)  # 0.41: futile
    waits = [policy.bound_s(0.120) is not None for _ in range(4, 21)]  # steps 4..20
    assert [step for step, waited in zip(range(4, 21), waits) if waited] == [10, 20]
    for _ in range(2):  # probes that found fresh parameters: 0.41 -> 0.53 -> 0.62
        policy.record(fresh=True, waited_s=0.0)
    assert policy.bound_s(0.120) is not None  # step 21: waiting again
    assert FreshWaitPolicy(0.0, budget=1.0).bound_s(0.100) is None

    slow = FreshWaitPolicy(1.0, budget=0.25)
    waited = []
    for _ in range(12):  # every wait fresh, but 0.9 of the 0.100 s step: spent 0.18, 0.32 -> stop
        bound = slow.bound_s(0.100)
        waited.append(bound is not None)
        if bound is not None:
            slow.record(fresh=True, waited_s=0.090)
    # waits at steps 1, 2; 0.32 decays (x0.8 a step) to 0.26, 0.21: wait at 5 (-> 0.35), skip 6-7, wait
    # at 8 (-> 0.36), skip 9, the probe at 10 (-> 0.41), skip 11-12: about the budget's share of the time
    assert waited == [True, True, False, False, True, False, False, True, False, True, False, False]
    assert slow.useful == 1.0  # the back-off here is the budget's, not the timeouts'
    quick = FreshWaitPolicy(1.0, budget=0.25)
    for _ in range(20):  # peers answer within a tenth of the step: never held back
        assert quick.bound_s(0.100) is not None
        quick.record(fresh=True, waited_s=0.010)


def test_fresh_waits_are_taken_only_where_the_batch_is_predicted_to_complete_within_the_longest_wait() -> None:
    """`FreshWaitPolicy.worth_waiting`, by hand: the pace of the global steps is the ratio of the
    moving averages (0.8 / 0.2) of the seconds and the steps between installs that advanced it; a
    wait is predicted at calibration x missing share x pace, and taken while that is at most
    min(share, sqrt(2 x budget x pace / compute)) x compute; each batch's time to complete against
    its prediction moves the calibration (by at most 4 x the calibration)."""
    policy = FreshWaitPolicy(1.0, budget=0.25)
    policy.bound_s(0.100)  # compute 0.100 s
    assert policy.worth_waiting(0.75)  # the pace unknown: wait, as without a prediction
    policy.calibrate(0.5, 0.001)  # nor can a batch be calibrated against it
    assert policy.calibration == 1.0
    policy.observe_global_step(10, now=0.0)
    policy.observe_global_step(10, now=0.05)  # no advance: the interval runs on from 0.0
    policy.observe_global_step(11, now=0.12)
    assert policy.seconds_per_step == pytest.approx(0.12)
    policy.observe_global_step(13, now=0.36)  # seconds 0.8 x 0.12 + 0.2 x 0.24, steps 0.8 x 1 + 0.2 x 2
    assert policy.seconds_per_step == pytest.approx(0.144 / 1.2)
    longest = math.sqrt(2 * 0.25 * 0.12 / 0.100) * 0.100  # 0.0775 s: 0.65 of the batch at this pace
    assert policy.longest_s == pytest.approx(longest)
    assert policy.worth_waiting(0.6) and not policy.worth_waiting(0.7)
    policy.calibrate(0.5, 0.012)  # 0.2 of its 0.060 s prediction: 1 -> 0.84
    assert policy.calibration == pytest.approx(0.84)
    assert policy.worth_waiting(0.75)  # 0.84 x 0.75 x 0.12 = 0.0756 <= 0.0775
    policy.calibrate(0.5, 1.0)  # held up: counts at most 4 x, 0.84 -> 0.84 x (0.8 + 0.8)
    assert policy.calibration == pytest.approx(0.84 * 1.6)
    policy.record(None, waited_s=0.001)  # skipped past the answer: the waits' usefulness is unchanged
    policy.record(False, waited_s=0.1)
    assert policy.useful == pytest.approx(0.8)
    assert FreshWaitPolicy(0.1, budget=1.0).longest_s is None  # nothing seen yet
    capped = FreshWaitPolicy(0.1, budget=1.0)
    capped.bound_s(0.100)
    capped.observe_global_step(0, now=0.0)
    capped.observe_global_step(1, now=1.0)
    assert capped.longest_s == pytest.approx(0.010)  # never past the bound, share x compute


def test_lookahead_computes_on_the_parameters_extrapolated_by_the_staleness_at_their_velocity() -> None:
    """`Lookahead`, by hand, over 2 shards of a 4-element vector: live = received + scale x
    staleness (moving average, weights 0.8 / 0.2) x velocity per global step between the last two
    installs of each slice; an exact install, a slice not installed, a gap past LONGEST_GAP,
    `received` (an evaluation) and `forget` each as documented; scale 0 installs the received values."""
    param = torch.nn.Parameter(torch.zeros(4))
    dense = DenseParams([("w", param)])
    bounds = [(0, 2), (2, 4)]
    lookahead = Lookahead(dense, scale=1.0)
    lookahead.install([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])], [10, 10], bounds, exact=True)
    assert param.tolist() == [1.0, 2.0, 3.0, 4.0]
    lookahead.observe(1)
    lookahead.observe(2)  # staleness: 0 -> 0.2 -> 0.56
    assert lookahead.staleness == pytest.approx(0.56)
    # shard 0 two global steps on (velocity [1, -1] per step), shard 1 one step on (velocity [2, 0])
    lookahead.install([torch.tensor([3.0, 0.0]), torch.tensor([5.0, 4.0])], [12, 11], bounds, exact=False)
    assert param.tolist() == pytest.approx([3.56, -0.56, 6.12, 4.0])
    # only shard 1 new (velocity [-1, 1]); shard 0 keeps its received values and velocity
    lookahead.install([None, torch.tensor([4.0, 5.0])], [12, 12], bounds, exact=False)
    assert param.tolist() == pytest.approx([3.56, -0.56, 3.44, 5.56])
    lookahead.install([torch.tensor([9.0, 9.0]), None], [12 + LONGEST_GAP + 1, 12], bounds, exact=False)
    assert param.tolist() == pytest.approx([9.0, 9.0, 3.44, 5.56])  # too far apart: no velocity for shard 0
    lookahead.install([torch.tensor([1.0, 1.0]), torch.tensor([2.0, 2.0])], [30, 30], bounds, exact=True)
    assert param.tolist() == [1.0, 1.0, 2.0, 2.0]  # a pull: exact, velocity forgotten
    lookahead.install([torch.tensor([2.0, 1.0]), None], [31, 30], bounds, exact=False)
    assert param.tolist() == pytest.approx([2.56, 1.0, 2.0, 2.0])
    with lookahead.received():
        assert param.tolist() == [2.0, 1.0, 2.0, 2.0]  # an evaluation mid-run: the shards' values
    assert param.tolist() == pytest.approx([2.56, 1.0, 2.0, 2.0])  # the next gradient's: the prediction again
    lookahead.forget()
    assert lookahead.staleness == 0.0
    with lookahead.received():  # nothing received since leaving GBA: the live values are the model
        assert param.tolist() == pytest.approx([2.56, 1.0, 2.0, 2.0])
    lookahead.install([torch.tensor([5.0, 5.0]), torch.tensor([5.0, 5.0])], [32, 31], bounds, exact=False)
    assert param.tolist() == [5.0, 5.0, 5.0, 5.0]  # after a switch: as received
    off = Lookahead(dense, scale=0.0)
    off.observe(3)
    off.install([torch.tensor([7.0, 7.0]), torch.tensor([8.0, 8.0])], [40, 40], bounds, exact=False)
    assert param.tolist() == [7.0, 7.0, 8.0, 8.0]


def test_gba_defaults_are_the_measured_ones() -> None:
    """Pinned with the figures behind them (docs/gba.md, "Quality"): production preset, 4 trainers
    + 1 server, seed 0, 250K samples, AUC - sync. Without a straggler: -0.0230 with neither,
    -0.0112 with lookahead 1 alone, -0.0005 with fresh_wait 1 and lookahead 1. Trainer 3 3x slow:
    -0.0154 with neither, -0.0119 lookahead alone, -0.0052 with fresh_wait 0.25, -0.0009 with
    fresh_wait 1 (plain async -0.103). On quiet cores those waits held GBA at 2.1x sync under the
    straggler (waits that succeed late); the budget of a quarter of the compute time keeps 2.56x at
    -0.0036 (-0.0061 without waits, 2.86x) and costs -0.0043 without a straggler on these shared
    cores. With the waits taken only where the batch is predicted to complete soon, the decay:
    trainer 3 3x slow, 5 seeds, dropping beyond 2 global steps -0.0021 (median; -0.0062 on seed 1),
    halving per step of staleness from 0 -0.0016 (median; every seed within 0.0027) at 2.79x sync;
    with the prediction calibrated by every batch, -0.0014 (every seed within 0.0035) at 2.71x,
    and a budget of 0.35 -0.0018 at 2.53x. The budget side by side (5 seeds, f21fb2c): with the
    straggler a quarter 2.50x at -0.0017, a half 2.28x at -0.0018, 1 2.23x at -0.0022; without one
    a quarter 1.18x at -0.0014, 1 1.05x at -0.0003."""
    config = GBAConfig()
    assert (config.fresh_wait, config.fresh_wait_budget, config.lookahead) == (1.0, 0.25, 1.0)
    for bad in ({"fresh_wait_budget": 0}, {"fresh_wait_budget": 1.5}, {"lookahead": -1}, {"fresh_wait": -0.5}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            GBAConfig(**bad)
    assert (config.decay.kind, config.decay.threshold, config.decay.rate, config.decay.max_staleness) == (
        "exponential", 0, 0.5, 32)


def test_pending_switch_blocks_close_and_close_blocks_switches() -> None:
    shard = configured_shard()
    assert shard.request_mode("sync") is True
    assert shard.begin_close() is False  # the closing trainer must join the switch first
    other = configured_shard()
    assert other.begin_close() is True
    assert other.request_mode("sync") is False


def test_switch_policy_fires_after_a_window_and_has_hysteresis() -> None:
    policy = SwitchPolicy(SwitchPolicyConfig(enabled=True, to_gba_ratio=1.5, to_sync_ratio=1.2, window=3))
    straggling, healthy, between = [1.0, 1.0, 3.0], [1.0, 1.0, 1.1], [1.0, 1.0, 1.3]
    assert [policy.observe("sync", straggling) for _ in range(2)] == [None, None]
    assert policy.observe("sync", healthy) is None  # streak broken
    assert [policy.observe("sync", straggling) for _ in range(3)] == [None, None, "gba"]
    assert [policy.observe("gba", between) for _ in range(5)] == [None] * 5  # inside the band: stay
    assert [policy.observe("gba", healthy) for _ in range(3)] == [None, None, "sync"]
    assert SwitchPolicy(SwitchPolicyConfig(enabled=False)).observe("sync", straggling) is None


def test_replies_share_one_published_copy_per_global_step_that_later_steps_never_change() -> None:
    """RPC sends a reply after the lock is released, so replies carry a copy of the parameters,
    cloned once per step for every reader, never written after: the next step publishes anew, and a
    shard configured again (a checkpoint loaded at the same k) publishes the loaded values."""
    shard = configured_shard()
    shard.push(PushRequest(0, 0, 4, torch.ones(4), 0, 1, 0.0))
    stepped = shard.push(PushRequest(1, 0, 4, torch.ones(4), 0, 1, 0.0))  # k 0 -> 1
    readers = [stepped.params, shard.pull().params, shard.watch(token=0, timeout_s=1.0).result().params,
               shard.pull().params]
    assert all(params is readers[0] for params in readers)  # one clone for four readers
    assert readers[0] is not shard._optimizer.param
    shard.push(PushRequest(0, 0, 4, torch.ones(4), 1, 1, 0.0))
    after = shard.push(PushRequest(1, 0, 4, torch.ones(4), 1, 1, 0.0))  # k 1 -> 2
    torch.testing.assert_close(readers[0], -torch.ones(4))  # still step 1's values
    assert after.token == 2 and after.params is not readers[0]
    torch.testing.assert_close(after.params, -2 * torch.ones(4))
    spec = OptimizerSpec.of(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), LRSchedule())
    loaded = FlatOptimizer(spec, torch.full((4,), 7.0)).export() | {"global_step": 2}
    shard.configure(0, 4, 2, spec, loaded, GBAConfig(), global_batch=2)
    assert shard.pull().token == 2
    torch.testing.assert_close(shard.pull().params, torch.full((4,), 7.0))


def test_watch_answers_once_the_global_step_passes_the_token_and_none_once_exported() -> None:
    """The long poll behind a trainer's fresh parameters: a Future, never a wait, that the push
    moving k past the token completes on its own thread once the shard's lock is released (the
    transport replies from there); at its timeout the expiry thread completes it with what the shard
    holds; past `WATCHERS` waiting, or k already past, it is answered at once; when the shard
    leaves GBA every waiting one gets None."""
    shard = configured_shard()
    started = time.monotonic()
    assert shard.watch(token=0, timeout_s=0.05).result(timeout=2.0).token == 0  # nothing new: at the timeout
    assert time.monotonic() - started >= 0.04
    watch = shard.watch(token=0, timeout_s=5.0)
    completed_by: list[tuple[threading.Thread, bool]] = []
    watch.add_done_callback(lambda _: completed_by.append((threading.current_thread(), shard._lock.locked())))
    shard.push(PushRequest(0, 0, 4, torch.ones(4), 0, 1, 0.0))
    assert not watch.done()  # half a global batch: k has not moved
    shard.push(PushRequest(1, 0, 4, torch.ones(4), 0, 1, 0.0))
    assert watch.done() and watch.result().token == 1
    assert completed_by == [(threading.current_thread(), False)]  # by the pushing thread, the lock released
    torch.testing.assert_close(watch.result().params, -torch.ones(4))
    assert shard.watch(token=0, timeout_s=5.0).result(timeout=0).token == 1  # already past: at once
    waiting = [shard.watch(token=1, timeout_s=5.0) for _ in range(WATCHERS)]
    extra = shard.watch(token=1, timeout_s=5.0)
    assert not any(waiter.done() for waiter in waiting) and extra.result(timeout=0).token == 1
    shard.export()
    assert [waiter.result(timeout=0) for waiter in waiting] == [None] * WATCHERS


def sharded(numel: int = 4, num_trainers: int = 2, global_batch: int = 2, on_nonfinite: str = "fail",
            roster: Roster | None = None, **decay: object) -> list[DenseShard]:
    """The dense vector over two in-process shards, configured as `DenseShardClient.configure` does
    (`roster`: shard 0's server's membership)."""
    spec = OptimizerSpec.of(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), LRSchedule())
    initial = FlatOptimizer(spec, torch.zeros(numel)).export()
    config = GBAConfig(decay=StalenessDecayConfig(**decay))
    shards = []
    for index, (start, end) in enumerate(shard_bounds(numel, 2)):
        shard = DenseShard(roster if index == 0 else None)
        shard.configure(start, end, num_trainers, spec, slice_export(initial, start, end), config, global_batch,
                        index=index, on_nonfinite=on_nonfinite)
        shards.append(shard)
    return shards


def test_the_other_shards_apply_shard_0s_decisions_in_its_order_whatever_order_they_arrive_in() -> None:
    """Shard 0 decides each push once; shard 1 gets the parts of two pushes in the opposite order
    and still applies them as decided (the second completes the global batch), so both shards
    advance k together and hold the values one shard over the whole vector would."""
    leader, follower = sharded()
    reference = configured_shard()
    g_a, g_b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([3.0, 2.0, 1.0, 0.0])
    for trainer, gradient in ((0, g_a), (1, g_b)):
        reference.push(PushRequest(trainer, 0, 4, gradient, 0, 1, 0.0))
    first = leader.push(PushRequest(0, 0, 2, g_a[:2], 0, 1, 0.0))
    second = leader.push(PushRequest(1, 0, 2, g_b[:2], 0, 1, 0.0))
    assert (first.decision.seq, second.decision.seq) == (0, 1) and second.token == 1
    early = follower.push(PushRequest(1, 2, 4, g_b[2:], 0, 1, 0.0, True, second.decision))
    assert early.token == 0 and follower.stats()["pending_pushes"] == 1  # waits for decision 0, no thread does
    late = follower.push(PushRequest(0, 2, 4, g_a[2:], 0, 1, 0.0, True, first.decision))
    assert late.token == 1 and follower.stats()["pending_pushes"] == 0
    torch.testing.assert_close(torch.cat([leader.pull().params, follower.pull().params]), reference.pull().params)
    assert [shard.stats()["global_step"] for shard in (leader, follower)] == [1, 1]
    with pytest.raises(ValueError, match="decision 0 was already applied"):
        follower.push(PushRequest(0, 2, 4, g_a[2:], 0, 1, 0.0, True, first.decision))
    with pytest.raises(ValueError, match="only shard 0 decides"):
        follower.push(PushRequest(0, 2, 4, g_a[2:], 0, 1, 0.0))
    with pytest.raises(ValueError, match="shard 0: it decides pushes"):
        leader.push(PushRequest(0, 0, 2, g_a[:2], 0, 1, 0.0, True, first.decision))
    exported = concat_exports([shard.export() for shard in (leader, follower)])
    assert exported["global_step"] == 1


def test_a_dropped_push_has_no_decision_and_a_broken_part_keeps_k_in_step() -> None:
    leader, follower = sharded(kind="drop", threshold=0, max_staleness=4)
    ones = torch.ones(2)
    for trainer in (0, 1):
        decision = leader.push(PushRequest(trainer, 0, 2, ones, 0, 1, 0.0)).decision
        follower.push(PushRequest(trainer, 2, 4, ones, 0, 1, 0.0, True, decision))
    stale = leader.push(PushRequest(0, 0, 2, ones, 0, 1, 0.0))  # staleness 1 > threshold 0
    assert stale.weight == 0.0 and stale.decision is None  # nothing for shard 1 to apply
    kept = leader.push(PushRequest(0, 0, 2, ones, 1, 1, 0.0)).decision
    nan = torch.full((2,), float("nan"))
    with pytest.raises(ValueError, match="NaN or inf values here .* k stays shard 0's"):
        follower.push(PushRequest(0, 2, 4, nan, 1, 1, 0.0, True, kept))  # a client that lied about `finite`
    completing = leader.push(PushRequest(1, 0, 2, ones, 1, 1, 0.0)).decision
    follower.push(PushRequest(1, 2, 4, ones, 1, 1, 0.0, True, completing))
    assert [shard.stats()["global_step"] for shard in (leader, follower)] == [2, 2]
    assert torch.isfinite(follower.pull().params).all()


def local_client(shards: list[DenseShard]) -> DenseShardClient:
    """A trainer's client of the two shards, called in this process as its transport would call them."""
    class LocalShards:
        roles = Roles.assign(0, 3, num_servers=2)

        def call(self, server: int, service: str, method: str, *args: object) -> object:
            return getattr(shards[server], method)(*args)

        def call_each(self, service: str, method: str, args_by_server: list, first: int = 0) -> list:
            return [getattr(shards[first + index], method)(*args) for index, args in enumerate(args_by_server)]

    return DenseShardClient(4, LocalShards())


def test_the_client_reports_a_dropped_push_as_dropped_by_every_shard() -> None:
    """A push shard 0 dropped reaches no other shard: their replies (pulls) carry weight 0, not 1."""
    client = local_client(sharded(on_nonfinite="skip", kind="drop", threshold=0, max_staleness=4))
    for trainer in (0, 1):
        assert [reply.weight for reply in client.push(trainer, torch.ones(4), 0, 1, 0.0)] == [1.0, 1.0]
    stale = client.push(0, torch.ones(4), 0, 1, 0.0)  # staleness 1 > threshold 0
    assert [reply.weight for reply in stale] == [0.0, 0.0] and [reply.token for reply in stale] == [1, 1]
    nonfinite = client.push(0, torch.ones(4), 1, 1, 0.0, finite=False)
    assert [reply.weight for reply in nonfinite] == [0.0, 0.0]


def test_a_departed_trainers_missing_part_is_voided_so_the_other_shards_keep_k_with_shard_0() -> None:
    """Trainer 1 departs after shard 0 decided its push and before shard 1 got its part: shard 0's
    next decision carries the void, shard 1 counts those samples without a gradient and steps with
    shard 0 (no push waits forever); the part arriving after all is refused; a gap at the very end
    (no later decision) is closed by the client's `settle`, which `snapshot` runs."""
    roster = Roster(2, on_lost="continue")
    leader, follower = sharded(roster=roster)
    g_a, g_b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([3.0, 2.0, 1.0, 0.0])
    lost = leader.push(PushRequest(1, 0, 2, g_b[:2], 0, 1, 0.0)).decision  # trainer 1's part 1 never sent
    assert roster.lose(1, 1, "killed")
    reply = leader.push(PushRequest(0, 0, 2, g_a[:2], 0, 1, 0.0))
    kept = reply.decision
    assert [void.seq for void in reply.voided] == [0]
    follower.push(PushRequest(0, 2, 4, g_a[2:], 0, 1, 0.0, True, kept, voided=reply.voided))
    assert [shard.stats()["global_step"] for shard in (leader, follower)] == [1, 1]
    assert follower.stats()["pending_pushes"] == 0
    assert (leader.stats()["voided_decisions"], follower.stats()["voids_applied"]) == (1, 1)
    # shard 0 applied both gradients, shard 1 trainer 0's alone, each over the batch's 2 samples (lr 1)
    torch.testing.assert_close(leader.pull().params, -(g_a[:2] + g_b[:2]) / 2)
    torch.testing.assert_close(follower.pull().params, -g_a[2:] / 2)
    with pytest.raises(ValueError, match="decision 0 was already applied"):
        follower.push(PushRequest(1, 2, 4, g_b[2:], 0, 1, 0.0, True, lost))
    client = local_client([leader, follower])
    client.push(0, g_a, 1, 1, 0.0)  # delivered everywhere: a void of it later is ignored
    last = leader.push(PushRequest(0, 0, 2, g_a[:2], 1, 1, 0.0)).decision  # completes k=2 on shard 0 alone
    assert roster.lose(0, 1, "killed")
    assert [shard.stats()["global_step"] for shard in (leader, follower)] == [2, 1]
    assert client.snapshot(timeout_s=5.0)["global_step"] == 2
    # trainer 0's three recent decisions were voided; shard 1 lacked only the last
    assert (leader.stats()["voided_decisions"], follower.stats()["voids_applied"]) == (4, 2)
    assert last.seq == 3 and follower.stats()["pending_pushes"] == 0


def test_non_finite_pushes_are_dropped_and_counted_under_skip_and_end_the_job_under_fail() -> None:
    leader, _ = sharded(on_nonfinite="skip")
    leader.push(PushRequest(1, 0, 2, torch.ones(2), 0, 1, 0.0))
    nan = torch.tensor([1.0, float("inf")])
    reply = leader.push(PushRequest(0, 0, 2, nan, 0, 1, 0.0))
    marked = leader.push(PushRequest(0, 0, 2, torch.ones(2), 0, 1, 0.0, False))  # NaN in another shard's part
    assert (reply.weight, reply.decision, marked.weight, marked.decision) == (0.0, None, 0.0, None)
    stats = leader.stats()
    assert (stats["nonfinite_dropped"], stats["buffered_samples"], stats["global_step"]) == (2, 1, 0)
    torch.testing.assert_close(leader.pull().params, torch.zeros(2))
    failing, _ = sharded(on_nonfinite="fail")
    with pytest.raises(SyncError, match="trainer 1's gradient has NaN or inf values .*on_nonfinite: fail"):
        failing.push(PushRequest(1, 0, 2, nan, 0, 1, 0.0))
    with pytest.raises(SyncError, match="the job failed: trainer 1's gradient"):
        failing.push(PushRequest(0, 0, 2, torch.ones(2), 0, 1, 0.0))  # any trainer's later push
    failing.configure(0, 2, 2, *sharded_args())  # the roster's failure is the job's: a new GBA phase keeps it
    with pytest.raises(PeerLost, match="the job failed: trainer 1's gradient") as refused:
        failing.push(PushRequest(0, 0, 2, torch.ones(2), 0, 1, 0.0))
    assert refused.value.ranks == (1,)  # named by rank, so trainer 0 never blames itself
    roster = Roster(2)
    reported, _ = sharded(on_nonfinite="fail", roster=roster)
    reported.fail("trainer 0 (rank 0): non-finite gradient", [0])
    with pytest.raises(PeerLost, match=r"the job failed: trainer 0 \(rank 0\)") as refused:
        reported.push(PushRequest(1, 0, 2, torch.ones(2), 0, 1, 0.0))
    assert refused.value.ranks == (0,) and roster.failed == (0,)  # the server's one record


def sharded_args() -> tuple:
    spec = OptimizerSpec.of(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), LRSchedule())
    return spec, FlatOptimizer(spec, torch.zeros(2)).export(), GBAConfig(), 2


def test_snapshot_keeps_the_shard_serving() -> None:
    shard = configured_shard()
    for trainer in (0, 1):
        shard.push(PushRequest(trainer, 0, 4, torch.ones(4), 0, 1, 0.0))
    shard.push(PushRequest(0, 0, 4, torch.ones(4), 1, 1, 0.0))  # half of the next global batch
    snapshot = shard.snapshot()
    assert snapshot["global_step"] == 1 and shard.stats()["buffered_samples"] == 1
    torch.testing.assert_close(snapshot["param"], -torch.ones(4))
    assert shard.push(PushRequest(1, 0, 4, torch.ones(4), 1, 1, 0.0)).token == 2


def test_a_shard_saves_at_each_multiple_of_its_interval_and_a_restored_one_drops_newer_tokens(tmp_path) -> None:
    """The server's own checkpoints: the shard offers its state when configured and at every
    `every`-th global step; the writer keeps the newest two files, skips one that does not load; a
    shard restored from one serves the same parameters and k, and drops (and counts) a push computed
    on parameters newer than its k instead of refusing it as malformed, as a fresh shard does."""
    offered: list[tuple[int, dict]] = []
    shard = configured_shard()
    shard.on_checkpoint(2, lambda step, state: offered.append((step, state)))
    for _ in range(5):  # 5 global steps of 2 pushes each
        for trainer in (0, 1):
            shard.push(PushRequest(trainer, 0, 4, torch.ones(4), shard.stats()["global_step"], 1, 0.0))
    assert [step for step, _ in offered] == [0, 2, 4]
    checkpoints = ServerCheckpoints(tmp_path, server_index=0)
    writer = CheckpointWriter(checkpoints, "dense", {"tables": lambda: {"rows": torch.arange(3)}})
    for step, state in offered:  # a writer behind keeps the newest only: any subset ending at 4 is written
        writer.offer(step, state)
    writer.close()
    assert writer.saved[-1] == 4 and set(writer.saved) <= {0, 2, 4}
    for step, state in offered[:2]:
        checkpoints.save(step, {"dense": state})
    assert checkpoints.steps() == [2, 4]  # the newest KEEP_LAST
    step, saved = checkpoints.latest()
    assert step == saved["dense"]["exported"]["global_step"] == 4 and torch.equal(saved["tables"]["rows"], torch.arange(3))
    restored = DenseShard()
    restored.restore(saved["dense"])
    torch.testing.assert_close(restored.pull().params, -4 * torch.ones(4))  # SGD lr 1, mean gradient 1, 4 steps
    reply = restored.push(PushRequest(0, 0, 4, torch.ones(4), 5, 1, 0.0))  # made on step 5, before the restart
    assert reply.weight == 0.0 and reply.token == 4
    stats = restored.stats()
    assert (stats["restored_at"], stats["dropped_after_restore"], stats["buffered_samples"]) == (4, 1, 0)
    with pytest.raises(ValueError, match="token 6 is from the future"):  # the live shard, at k = 5
        shard.push(PushRequest(0, 0, 4, torch.ones(4), 6, 1, 0.0))
    (checkpoints.path_of(4) / "state.pt").write_bytes(b"truncated")
    assert checkpoints.latest()[1]["dense"]["exported"]["global_step"] == 2
