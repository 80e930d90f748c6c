"""Roles in the harness's torchrun job, and what keeps the dense replicas together.

- `join` is `shadowgba.join` with the harness's tables: without servers every rank trains; with
  `sync.ps.num_servers > 0` (gba, easgd_ps) the last ranks are servers, which serve for the whole
  job inside `join` (GBA's dense shards or the S-EASGD centre and, with `model.embeddings: ps`, the
  tables). Everything a trainer does collectively (TorchRec's all-to-all, held-out evaluation,
  throughput sums, the replica check) runs on `job.trainer_group`, never on the default group.
- `dense_sync` is `shadowgba.dense_sync` for every shadowgba algorithm, torch's periodic model
  averager for the pma baseline (`dlrm.pma`), TorchRec's 2D table averaging for the torchrec_2d
  baseline (`dlrm.torchrec_2d`), or nothing (none / ddp).
- Resources, every rank's: `ResourceMeter` samples this process's CPU seconds (user + sys) all along,
  since a server rank cannot know when the trainers' timed window opens or closes; `StepWallClock`
  maps the trainers' window (their loop clock, pauses left out) to wall-clock intervals; once the
  job is over `gather_resources` hands those intervals to every rank and collects each rank's CPU
  seconds in them and its peak resident memory through the job's store (no collective: a trainer
  that departed the job takes no part), which `resource_summary` turns into
  CPU seconds per sample and memory per trainer and server. Linux: `ru_maxrss` is in KiB there and
  the current resident set is read from `/proc/self/statm`.
"""

from __future__ import annotations

import bisect
import datetime
import json
import resource
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

import shadowgba
from ctrkit.ctr_data import CTRData
from dlrm.config import ExperimentConfig
from dlrm.host import MiB, cpu_seconds, peak_rss_mib
from dlrm.loop import TrainStats
from dlrm.model import tables
from dlrm.pma import PeriodicAveraging
from dlrm.torchrec_2d import ReplicaSync
from shadowgba.integrations.torchrec import dense_named_parameters
from shadowgba.ps import transport


def join(config: ExperimentConfig, data: CTRData, backend: str) -> shadowgba.Job:
    """This rank's part of the job (collective: every rank calls it after `init_process_group`)."""
    if config.model.embeddings != "ps":
        return shadowgba.join(config.sync, backend=backend)
    num_trainers = dist.get_world_size() - config.sync.ps.num_servers
    options = shadowgba.ps_table_options(
        config.sync, num_trainers, config.data.batch_size, config.train.embedding_optimizer,
        config.train.embedding_lr, config.train.seed,
    )
    return shadowgba.join(config.sync, tables(config, data), options, backend=backend)


def dense_sync(config: ExperimentConfig, model: nn.Module, optimizer: Any, job: shadowgba.Job) -> Any:
    """What keeps the dense replicas together under `config` (None for the none and ddp baselines)."""
    if config.baseline == "pma":
        params = [param for _, param in dense_named_parameters(model)]
        return PeriodicAveraging(params, optimizer, config.sync.foreground_every, job.trainer_group)
    if config.baseline == "torchrec_2d":
        return ReplicaSync(model, optimizer, config.sync.foreground_every, job.layout.replica_group)
    if config.baseline is not None:
        return None
    return shadowgba.dense_sync(model, optimizer, job, local_batch_size=config.data.batch_size, end_job=False)


def paired_trainers(config: ExperimentConfig, job: shadowgba.Job) -> tuple[dist.ProcessGroup, int]:
    """The trainers whose steps pair every step, which must stop at the same step, and the global
    rank that decides for them: every trainer (TorchRec's all-to-all over all of them, or dense DDP
    over all of them as in torchrec_2d), or in a 2D job this rank's sharding group alone: its
    all-to-all is all that pairs its steps, and a group must not wait for another to stop."""
    if job.layout is None or config.baseline == "torchrec_2d":
        return job.trainer_group, job.roles.trainer_ranks[0]
    return job.layout.sharding_group, job.layout.global_rank(0)


def applied_samples(sync: Any, config: ExperimentConfig) -> Callable[[], int]:
    """A counter of the samples the dense parameters have been updated with under gba, read from the
    global step k: one global batch per step, or one local batch per step under GBA without
    aggregation (exact unless such a job switches modes while running)."""
    without_aggregation = config.sync.gba.aggregation == "none"

    def count() -> int:
        per_step = config.data.batch_size if without_aggregation and sync.mode == "gba" else sync.global_batch
        return sync.global_step * per_step

    return count


Interval = tuple[float, float]
"""Wall-clock seconds (`time.time()`: comparable across the ranks' machines, unlike a monotonic clock)."""


def rss_mib() -> float:
    """This process's resident memory now."""
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * resource.getpagesize() / MiB


class ResourceMeter:
    """This rank's CPU seconds, sampled in a daemon thread from construction to `stop()`, so that the
    CPU spent in any wall-clock interval in between is known afterwards (linear between samples)."""

    PERIOD_S = 0.05
    """Sampling period: a reading costs microseconds, and a 30 s window is then off by < 0.2%."""

    def __init__(self, period_s: float = PERIOD_S) -> None:
        self._times: list[float] = []
        self._cpu: list[float] = []
        self._sample()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), name="resource-meter", daemon=True)
        self._thread.start()
        self.rss_before_sync_mib: float | None = None
        """A trainer's resident memory just before its sync runtime is built (`mark_before_sync`)."""

    def mark_before_sync(self) -> None:
        """Trainers: remember the resident memory before the sync runtime exists."""
        self.rss_before_sync_mib = rss_mib()

    def stop(self) -> None:
        """Take the last sample and end the sampling thread."""
        self._stopped.set()
        self._thread.join()
        self._sample()

    def cpu_s(self, intervals: Sequence[Interval]) -> float:
        """CPU seconds spent in `intervals` (after `stop()`)."""
        return sum(self._cpu_at(end) - self._cpu_at(start) for start, end in intervals)

    def _cpu_at(self, when: float) -> float:
        index = min(max(bisect.bisect_left(self._times, when), 1), len(self._times) - 1)
        (t0, t1), (c0, c1) = self._times[index - 1 : index + 1], self._cpu[index - 1 : index + 1]
        share = min(max((when - t0) / (t1 - t0), 0.0), 1.0) if t1 > t0 else 1.0
        return c0 + share * (c1 - c0)

    def _sample(self) -> None:
        self._times.append(time.time())
        self._cpu.append(cpu_seconds())

    def _run(self, period_s: float) -> None:
        while not self._stopped.wait(period_s):
            self._sample()


class StepWallClock:
    """The wall-clock time of every step end of this trainer and of every pause between steps
    (held-out evaluation, checkpoints), which the training loop's clock leaves out."""

    def __init__(self) -> None:
        self._ends: list[float] = []
        self._offsets: list[float] = []
        self._pauses: list[tuple[float, float, float]] = []

    def step_ended(self, elapsed_s: float) -> None:
        """A step ended at `elapsed_s` of the loop's clock (call before the pause, if any)."""
        self._ends.append(elapsed_s)
        self._offsets.append(time.time() - elapsed_s)

    def paused(self, seconds: float) -> None:
        """The last step was followed by a pause of `seconds` (0: none)."""
        if seconds:
            self._pauses.append((self._ends[-1], self._ends[-1] + self._offsets[-1], seconds))

    def intervals(self, start_s: float, end_s: float) -> list[Interval]:
        """[start_s, end_s] of the loop's clock as wall-clock intervals, the pauses left out."""
        intervals, wall = [], self._wall(start_s)
        for loop_s, pause_start, pause_s in self._pauses:
            if start_s <= loop_s < end_s:
                intervals.append((wall, pause_start))
                wall = pause_start + pause_s
        return [*intervals, (wall, self._wall(end_s))]

    def _wall(self, loop_s: float) -> float:
        """A step at `loop_s` of the loop's clock runs after every pause that follows an earlier step end."""
        return loop_s + self._offsets[min(bisect.bisect_left(self._ends, loop_s), len(self._ends) - 1)]


def timed_window(stats: TrainStats, roles: transport.Roles, device: torch.device) -> tuple[float, float]:
    """The trainers' common timed window in the loop's clock (collective on the trainer group): from the
    last trainer's warm-up end to the first trainer's last step, the window `loop.common_window`
    counts samples in."""
    bounds = torch.tensor([stats.warmup_end_s, -stats.step_end_s[-1]], dtype=torch.float64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=roles.trainer_group)
    return bounds[0].item(), -bounds[1].item()


RESOURCES_WAIT_S = 60.0
"""How long `gather_resources` waits for a rank's post: the servers post theirs once every trainer
has closed the job, which takes them seconds."""


def gather_resources(meter: ResourceMeter, job: shadowgba.Job, window: Sequence[Interval],
                     members: Sequence[int]) -> list[dict[str, Any]] | None:
    """Every rank, after the job is closed, with no collective: the first of `members` (the job's
    ranks of the trainers still in it, the same on each; servers pass none) posts `window` in
    the job's store, every rank posts its CPU seconds in it and its peak resident memory, and each
    member reads the posts of every member and server (None on servers). A trainer that departed
    posts nothing and is not waited for; a post missing after `RESOURCES_WAIT_S` is a `RuntimeError`."""
    meter.stop()
    # not the default group's store: each torchrun job of a job per replica group holds only its own
    # ranks there, and rank 0's process (ranks started by hand) may have gone with a lost group
    store = dist.PrefixStore(f"harness/{job.name}/resources", job.store)
    rank = job.roles.rank
    if members and rank == members[0]:
        store.set("window", json.dumps(list(window)))
    store.wait(["window"], datetime.timedelta(seconds=RESOURCES_WAIT_S))
    intervals = [tuple(interval) for interval in json.loads(store.get("window"))]
    store.set(str(rank), json.dumps({
        "rank": rank, "role": "server" if job.is_server else "trainer",
        "cpu_s_in_window": meter.cpu_s(intervals), "peak_rss_mib": peak_rss_mib(),
        "rss_before_sync_mib": meter.rss_before_sync_mib,
    }))
    if job.is_server:
        return None
    ranks = sorted([*members, *job.roles.server_ranks])
    store.wait([str(one) for one in ranks], datetime.timedelta(seconds=RESOURCES_WAIT_S))
    return [json.loads(store.get(str(one))) for one in ranks]


def resource_summary(by_rank: list[dict[str, Any]], samples: int, dense_mib: float) -> dict[str, Any]:
    """CPU seconds of every rank in the window per sample trained in it, peak memory per trainer and
    server, and each trainer's peak memory above what it held before its sync runtime was built (the
    "extra"), also as a multiple of the dense parameters' size."""
    trainers = [rank for rank in by_rank if rank["role"] == "trainer"]
    servers = [rank for rank in by_rank if rank["role"] == "server"]
    extra = [rank["peak_rss_mib"] - rank["rss_before_sync_mib"] for rank in trainers]
    cpu_s = sum(rank["cpu_s_in_window"] for rank in by_rank)
    return {
        "by_rank": by_rank,
        "cpu_s_in_window": cpu_s,
        "cpu_s_per_sample": cpu_s / samples if samples else None,
        "trainer_peak_rss_mib_max": max(rank["peak_rss_mib"] for rank in trainers),
        "server_peak_rss_mib_max": max((rank["peak_rss_mib"] for rank in servers), default=None),
        "trainer_extra_rss_mib_max": max(extra),
        "trainer_extra_x_dense_max": max(extra) / dense_mib,
    }
