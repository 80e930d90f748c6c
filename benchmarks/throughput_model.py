"""A throughput model of sync all-reduce, the shadow algorithms and GBA past the machine at hand.

    python benchmarks/throughput_model.py [--calibration runs/throughput_calibration.json] \
        [--trainers 8,64,256,1024] [--slow-factor 3] [--slow-count 1] [--jitter-sigma 0] \
        [--bandwidth-gib-s B --latency-us L]   # another network than the fitted loopback

Plain maths over measured inputs (`Calibration`, written by `benchmarks/calibrate.py`); nothing
here imports torch. docs/scaling.md states the equations; in symbols, for N trainers of local batch
B, per-step compute t (one torch thread, nothing else running), a straggler multiplier m_i of
trainer i and a per-step jitter J (lognormal, mean 1):

- CPU sharing. A host of C cores that runs R busy ranks stretches every rank's compute by
  max(1, R u / C), u being each rank's busy cores (1 for real compute; less when compute is
  simulated by sleeping). Past this machine a host runs one trainer (R = 1); on this one all ranks
  of a job share its cores, which is what the validation at 1, 2, 4 and 8 trainers measures.
- TorchRec-sharded tables: every step also runs its embedding all-to-alls with the other trainers;
  their cost is measured, not modelled: t(N), the step's CPU seconds on a rank of N with the tables
  sharded over them (`Preset.sharded_compute_s`, at 2, 4, 8 ranks; held at the last beyond).
- Ring all-reduce of b bytes over N ranks: A(b, N) = 2 (N - 1) / N * b / beta + 2 (N - 1) * alpha
  (beta: bandwidth, alpha: per-hop latency; fitted by calibrate.py), with a third term where ranks
  share cores (`AllReduce`).
- Sync all-reduce (DDP-like): every step waits for the slowest trainer and then all-reduces the
  dense gradient: samples/s = N B / (t E[max_i m_i J_i] + lookups + A(dense bytes, N)).
- Shadow MA / EASGD / BMUF: no trainer waits for another; trainer i runs at B / (t m_i (1 + s)),
  s being the share of its compute the shadow thread steals. A round costs R_s = A(dense bytes, N)
  plus copies of the dense vector; rounds/s = min(1 / interval, share / R_s) (`sync.max_round_share`,
  at most 1), and the thread's CPU per
  second, u_s = rounds/s x copy seconds, stretches compute only where the host has no spare core
  (`shadow_steal`).
- GBA over S dense shards: trainer i runs at B / (t m_i + lookups), never waiting; every trainer step
  sends each shard a 1/S slice, so the servers take at most P(b / S) trainer pushes per second, P(x)
  = 1 / (c + x / g) a shard's pushes/s at push size x (c: per-push cost, g: ingest bytes/s), plus
  1/S of the step's embedding rows at their per-row server cost. Applied samples/s = B min(sum_i
  1 / t_i, server pushes/s). In the bandwidth-bound regime that is S x a shard's GiB/s / bytes;
  the per-push cost c does not shrink with S, which caps what more shards buy.
- Shards needed: the smallest S whose server pushes/s is at least (1 + headroom) x the trainers'
  push rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Sequence

from shadowgba.config import SyncConfig

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CALIBRATION = ROOT / "runs" / "throughput_calibration.json"


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """Ring all-reduce cost: A(b, N) = 2 (N - 1) / N * b / bandwidth + 2 (N - 1) * (latency +
    (k - 1) * switch), k >= 1 being how crowded the ranks' cores are (ranks / cores on one host).
    Where ranks share cores each hop also waits for its receiver to be scheduled (`switch_s` per
    rank beyond a core each); past this machine, one rank a host, k = 1 and that term is gone."""

    bandwidth_bytes_per_s: float
    latency_s: float
    switch_s: float = 0.0

    def time_s(self, nbytes: float, ranks: int, crowding: float = 1.0) -> float:
        """Seconds for one all-reduce of `nbytes` over `ranks` (zero on one rank)."""
        if ranks <= 1:
            return 0.0
        hops = 2 * (ranks - 1)
        return hops / ranks * nbytes / self.bandwidth_bytes_per_s + hops * (self.latency_s + (crowding - 1.0) * self.switch_s)


@dataclasses.dataclass(frozen=True)
class LinearCost:
    """A cost of `fixed_s + per_unit_s x units`: a shard's push (units: bytes) or a lookup (units: rows)."""

    fixed_s: float
    per_unit_s: float

    def time_s(self, units: float) -> float:
        """Seconds for one operation of `units`."""
        return self.fixed_s + self.per_unit_s * units

    def rate(self, units: float) -> float:
        """Operations per second of `units` each, back to back."""
        return 1.0 / self.time_s(units)


@dataclasses.dataclass(frozen=True)
class Preset:
    """What a model size costs one trainer."""

    name: str
    compute_s: float
    """Wall seconds of one training step (batch, forward, backward, optimizer) alone on a core."""
    dense_params: int
    batch_size: int
    lookup_bytes: int
    """Bytes of embedding rows one step looks up (tables x ids per sample x batch x dim x 4)."""
    sharded_compute_s: dict[int, float] = dataclasses.field(default_factory=dict)
    """CPU seconds of one step on each rank of a job whose tables TorchRec shards over that many
    ranks (its all-to-alls of ids, pooled rows and their gradients included), by rank count, as
    measured on the calibration machine; empty: not measured."""

    def step_compute_s(self, sharded_over: int) -> float:
        """One step's compute when the tables are TorchRec-sharded over `sharded_over` ranks (1: local
        tables, `compute_s`): the measurement at the largest measured rank count not above it, so
        past the measured counts the all-to-all's cost is held at the last one (not extrapolated)."""
        measured = [ranks for ranks in self.sharded_compute_s if ranks <= sharded_over]
        return self.sharded_compute_s[max(measured)] if measured else self.compute_s

    @property
    def dense_bytes(self) -> int:
        """Size of the dense vector (float32): what sync all-reduces, a shadow round averages, GBA pushes."""
        return 4 * self.dense_params


@dataclasses.dataclass(frozen=True)
class Hosts:
    """Where the ranks run: `cores` per host, `ranks_per_host` busy ranks on each (trainers and servers)."""

    cores: float
    ranks_per_host: int = 1
    busy_share: float = 1.0
    """Cores one rank keeps busy while it computes: 1 for real compute, less for sleep-simulated compute."""

    @property
    def crowding(self) -> float:
        """Ranks per core on a host, at least 1: what an all-reduce among them waits for (`AllReduce`)."""
        return max(1.0, self.ranks_per_host / self.cores)

    def stretch(self, extra_busy: float = 0.0) -> float:
        """Factor by which sharing the host's cores stretches a rank's compute, `extra_busy` cores per
        rank besides its training thread (a shadow thread) included."""
        return max(1.0, self.ranks_per_host * (self.busy_share + extra_busy) / self.cores)


@dataclasses.dataclass(frozen=True)
class Stragglers:
    """Which trainers are slow: `count` trainers plus a `fraction` of them run `factor` times slower,
    and every step of every trainer is multiplied by lognormal jitter of mean 1 and log-std `jitter_sigma`."""

    factor: float = 1.0
    count: int = 0
    fraction: float = 0.0
    jitter_sigma: float = 0.0

    def slow(self, trainers: int) -> int:
        """How many of `trainers` are slow."""
        if self.factor == 1.0:
            return 0
        return min(trainers, max(self.count, round(self.fraction * trainers)))

    def multipliers(self, trainers: int) -> list[float]:
        """Each trainer's mean step-time multiplier (the jitter has mean 1)."""
        slow = self.slow(trainers)
        return [self.factor] * slow + [1.0] * (trainers - slow)

    def expected_max(self, trainers: int) -> float:
        """E[max_i m_i J_i]: the step-time multiplier a step that waits for every trainer pays."""
        slow = self.slow(trainers)
        if self.jitter_sigma == 0.0:
            return self.factor if slow else 1.0
        return _expected_max_lognormal(self.jitter_sigma, [(self.factor, slow), (1.0, trainers - slow)])


def _lognormal_cdf(x: float, sigma: float) -> float:
    """P(J <= x) for J lognormal of mean 1 (mu = -sigma^2 / 2)."""
    if x <= 0.0:
        return 0.0
    return 0.5 * (1.0 + math.erf((math.log(x) + sigma * sigma / 2) / (sigma * math.sqrt(2.0))))


def _expected_max_lognormal(sigma: float, groups: Sequence[tuple[float, int]], points: int = 4000) -> float:
    """E[max] over independent draws m J, `count` draws for each (m, count) in `groups`:
    the integral over x >= 0 of 1 - prod F(x / m)^count, by the trapezoidal rule."""
    top = max(scale for scale, count in groups if count) * math.exp(sigma * 9.0)
    step = top / points

    def survival(x: float) -> float:
        return 1.0 - math.prod(_lognormal_cdf(x / scale, sigma) ** count for scale, count in groups if count)

    values = [survival(index * step) for index in range(points + 1)]
    return step * (sum(values) - (values[0] + values[-1]) / 2)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Every measured input of the model (calibrate.py writes them, this reads them)."""

    presets: dict[str, Preset]
    allreduce: AllReduce
    shard_push: LinearCost
    """One dense shard's cost of one push of x bytes (fixed: per push; per unit: per byte)."""
    lookup: LinearCost
    """A trainer's wait for one lookup of x bytes of rows from a server (fixed: per call; per unit: per byte)."""
    server_row_byte_s: float
    """A server's seconds per byte of a step's embedding rows: serving them plus applying their gradient."""
    copy_bytes_per_s: float
    """Memory bandwidth of copying the dense vector (a shadow round copies it `SHADOW_COPIES` times)."""
    shadow_steal: float
    """Share of a core's speed the training thread loses per core the shadow thread keeps busy, when
    the host has a spare core for it (memory bandwidth, caches)."""
    cores: int
    """Cores of the calibration machine."""
    provisional: bool
    """Whether the calibration ran on a loaded machine (see docs/scaling.md)."""

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        """Read calibrate.py's JSON."""
        raw = json.loads(path.read_text())
        model = raw["model"]
        return cls(
            presets={name: Preset(name=name, **{**fields, "sharded_compute_s": {
                int(ranks): seconds for ranks, seconds in fields.get("sharded_compute_s", {}).items()}})
                for name, fields in model["presets"].items()},
            allreduce=AllReduce(**model["allreduce"]),
            shard_push=LinearCost(**model["shard_push"]),
            lookup=LinearCost(**model["lookup"]),
            server_row_byte_s=model["server_row_byte_s"],
            copy_bytes_per_s=model["copy_bytes_per_s"],
            shadow_steal=model["shadow_steal"],
            cores=model["cores"],
            provisional=raw.get("provisional", True),
        )


SHADOW_COPIES = 3
"""Copies of the dense vector in a shadow round: the snapshot out of the training thread, the
round's result, and its write-back."""


@dataclasses.dataclass(frozen=True)
class Job:
    """One job to predict: a preset on N trainers, where they run, how they straggle, how they sync."""

    preset: Preset
    trainers: int
    hosts: Hosts
    stragglers: Stragglers = Stragglers()
    shards: int = 1
    """Dense shards (GBA), one per server rank; each also holds 1/shards of the tables when `ps_tables`."""
    ps_tables: bool = False
    """Tables on the parameter servers (each step waits for its lookups) rather than local / TorchRec."""
    torchrec_tables: bool = False
    """Tables TorchRec-sharded over the trainers: every step's all-to-alls cost what the preset's
    `sharded_compute_s` measured at this many trainers (bench_scaling's jobs)."""
    interval_s: float = 0.2
    """Shadow thread's target time between rounds (`sync.interval_ms`)."""
    round_share: float = SyncConfig().max_round_share
    """The most of the wall time the shadow thread's rounds may take (`sync.max_round_share`)."""

    def lookup_s(self, calibration: Calibration) -> float:
        """A trainer's per-step wait for its embedding rows (zero with local tables)."""
        return calibration.lookup.time_s(self.preset.lookup_bytes) if self.ps_tables else 0.0

    def allreduce_s(self, calibration: Calibration) -> float:
        """One all-reduce of the dense vector over the trainers."""
        return calibration.allreduce.time_s(self.preset.dense_bytes, self.trainers, self.hosts.crowding)

    def compute_s(self, extra_busy: float = 0.0) -> float:
        """One step's compute on its host, CPU sharing included."""
        base = self.preset.step_compute_s(self.trainers) if self.torchrec_tables else self.preset.compute_s
        return base * self.hosts.stretch(extra_busy)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted throughput of one job under one algorithm."""

    algorithm: str
    samples_per_s: float
    """Samples per second that reach the dense model."""
    computed_samples_per_s: float
    """Samples per second the trainers compute (GBA: more than applied when the servers cap pushes)."""
    bound: str
    """What limits it: "slowest trainer", "all-reduce", "compute", "servers"."""
    detail: dict[str, float]


def predict_sync(job: Job, calibration: Calibration) -> Prediction:
    """Every step waits for the slowest trainer, then all-reduces the dense gradient."""
    compute = job.compute_s() * job.stragglers.expected_max(job.trainers) + job.lookup_s(calibration)
    allreduce = job.allreduce_s(calibration)
    rate = job.trainers * job.preset.batch_size / (compute + allreduce)
    bound = "all-reduce" if allreduce > compute else "slowest trainer"
    return Prediction("sync", rate, rate, bound, {"step_s": compute + allreduce, "allreduce_s": allreduce})


def own_pace(job: Job, step_s: float) -> float:
    """Samples/s of trainers that never wait for each other, each at `step_s` times its multiplier."""
    return sum(job.preset.batch_size / (step_s * multiplier) for multiplier in job.stragglers.multipliers(job.trainers))


def predict_none(job: Job, calibration: Calibration) -> Prediction:
    """Local training, no dense sync: every trainer at its own pace (the baseline of the ratios)."""
    step_s = job.compute_s() + job.lookup_s(calibration)
    rate = own_pace(job, step_s)
    return Prediction("none", rate, rate, "compute", {"step_s": step_s})


def predict_shadow(job: Job, calibration: Calibration) -> Prediction:
    """Trainers never wait; the shadow thread's rounds (one all-reduce of the dense parameters plus
    copies) take CPU and memory bandwidth from the training thread: where the host's cores are all
    taken, the thread's busy share stretches compute as one more busy rank would; with a spare core
    it costs only `shadow_steal` per busy core."""
    copy_s = SHADOW_COPIES * job.preset.dense_bytes / calibration.copy_bytes_per_s
    round_s = job.allreduce_s(calibration) + copy_s
    rounds_per_s = min(1.0 / job.interval_s, job.round_share / round_s)
    busy = rounds_per_s * copy_s
    shared = job.hosts.stretch(busy) / job.hosts.stretch()
    slowdown = shared if shared > 1.0 else 1.0 + calibration.shadow_steal * busy
    step_s = job.compute_s() * slowdown + job.lookup_s(calibration)
    rate = own_pace(job, step_s)
    return Prediction("shadow", rate, rate, "compute",
                      {"step_s": step_s, "round_s": round_s, "rounds_per_s": rounds_per_s, "shadow_busy": busy})


def server_pushes_per_s(job: Job, calibration: Calibration, shards: int) -> float:
    """Trainer steps per second `shards` server ranks can ingest: every step pushes each shard a
    1/shards slice of the dense gradient and (PS tables) makes it serve 1/shards of the step's rows."""
    rows = job.preset.lookup_bytes / shards if job.ps_tables else 0.0
    return 1.0 / (calibration.shard_push.time_s(job.preset.dense_bytes / shards) + rows * calibration.server_row_byte_s)


def predict_gba(job: Job, calibration: Calibration) -> Prediction:
    """No trainer waits for another; the servers' ingest bounds the total push rate."""
    step_s = job.compute_s() + job.lookup_s(calibration)
    computed = own_pace(job, step_s)
    capacity = server_pushes_per_s(job, calibration, job.shards) * job.preset.batch_size
    bound = "servers" if capacity < computed else "compute"
    return Prediction("gba", min(computed, capacity), computed, bound,
                      {"step_s": step_s, "server_samples_per_s": capacity})


PREDICTORS = {"none": predict_none, "sync": predict_sync, "shadow": predict_shadow, "gba": predict_gba}
"""What the model predicts: local training (no sync, the baseline of the ratios), sync all-reduce, a
shadow algorithm (MA, EASGD and BMUF differ in the maths of a round, not in its cost), GBA."""


def predict(algorithm: str, job: Job, calibration: Calibration) -> Prediction:
    """The prediction of one of `PREDICTORS`."""
    return PREDICTORS[algorithm](job, calibration)


def shards_needed(job: Job, calibration: Calibration, headroom: float = 0.25, most: int = 4096) -> int | None:
    """Smallest number of dense shards whose ingest keeps up with the trainers' push rate times
    (1 + headroom); None if even `most` shards cannot (the per-push cost alone is too high)."""
    demand = (1.0 + headroom) * own_pace(job, job.compute_s() + job.lookup_s(calibration)) / job.preset.batch_size
    for shards in range(1, most + 1):
        if server_pushes_per_s(job, calibration, shards) >= demand:
            return shards
    return None


def prediction_rows(calibration: Calibration, presets: Sequence[str], trainer_counts: Sequence[int],
                    stragglers: Stragglers, shard_counts: Sequence[int | None], hosts: Hosts) -> list[dict[str, Any]]:
    """Samples/s per preset and trainer count: sync, shadow, GBA at each shard count (None: one
    shard per trainer), and the shards the job needs. Tables on the servers, as GBA's jobs have them."""
    rows = []
    for preset in (calibration.presets[name] for name in presets):
        for trainers in trainer_counts:
            base = Job(preset, trainers, hosts, stragglers, ps_tables=True)
            row: dict[str, Any] = {"preset": preset.name, "trainers": trainers,
                                   "sync": predict_sync(base, calibration).samples_per_s,
                                   "shadow": predict_shadow(base, calibration).samples_per_s}
            for shards in shard_counts:
                gba = predict_gba(dataclasses.replace(base, shards=shards or trainers), calibration)
                row[f"gba_{shards or 'N'}"] = gba.samples_per_s
            row["shards_needed"] = shards_needed(base, calibration)
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION)
    parser.add_argument("--presets", default="small,production", help="calibrated presets to predict")
    parser.add_argument("--trainers", default="8,64,256,1024")
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--slow-count", type=int, default=1)
    parser.add_argument("--slow-fraction", type=float, default=0.0)
    parser.add_argument("--jitter-sigma", type=float, default=0.0)
    parser.add_argument("--host-cores", type=float, default=2.0, help="cores of each trainer's host (one trainer a host)")
    parser.add_argument("--bandwidth-gib-s", type=float, help="the network's all-reduce bandwidth instead of the fitted one")
    parser.add_argument("--latency-us", type=float, help="the network's per-hop latency instead of the fitted one")
    args = parser.parse_args(argv)
    calibration = Calibration.load(args.calibration)
    ring = calibration.allreduce
    calibration = dataclasses.replace(calibration, allreduce=AllReduce(
        args.bandwidth_gib_s * 2**30 if args.bandwidth_gib_s else ring.bandwidth_bytes_per_s,
        args.latency_us * 1e-6 if args.latency_us is not None else ring.latency_s, ring.switch_s))
    stragglers = Stragglers(args.slow_factor, args.slow_count, args.slow_fraction, args.jitter_sigma)
    rows = prediction_rows(calibration, args.presets.split(","), [int(n) for n in args.trainers.split(",")], stragglers,
                           [1, 2, 4, None], Hosts(args.host_cores))
    headers = {"preset": "preset", "trainers": "trainers", "sync": "sync all-reduce", "shadow": "shadow MA",
               "gba_1": "GBA 1 shard", "gba_2": "GBA 2 shards", "gba_4": "GBA 4 shards", "gba_N": "GBA N shards",
               "shards_needed": "shards needed"}
    print("| " + " | ".join(headers.values()) + " |\n|" + " --- |" * 2 + " ---: |" * (len(headers) - 2))
    for row in rows:
        cells = [f"{row[key]:,.0f}" if isinstance(row[key], float) else str(row[key]) for key in headers]
        print("| " + " | ".join("none keeps up" if cell == "None" else cell for cell in cells) + " |")

if __name__ == "__main__":
    main()
