"""Durable jobs: atomic, verified, keep-last-k checkpoints through `torch.distributed.checkpoint` (DCP).

    checkpointer = Checkpointer("ckpt", setup, keep_last=2, async_save=False,
                                process_group=job.trainer_group, timeout_s=config.sync.timeout_s)
    state = {"model": ModelState(model, trainer), "optimizer": PerTrainer(optimizer, trainer),
             "embedding_optimizer": model.fused_optimizer, "sync": PerTrainer(sync, trainer),
             "train": train_state}
    with sync:                                   # start() first: it broadcasts trainer 0's replica
        checkpointer.load_latest(state)          # None when there is none yet
        for batch in batches:
            ...
            if step % every == 0:
                checkpointer.save(step, state)   # every trainer, the same step
    checkpointer.close()                         # waits for (and commits) an async save

What is saved. The values of `state` are `Stateful`s (`torch.distributed.checkpoint.stateful`); DCP
calls their `state_dict()` on save and `load_state_dict()` on load. Tensors that are *sharded*
(TorchRec's `ShardedTensor` tables and their fused optimizer state, `DTensor`s) go through DCP's
sharded path: each trainer writes its own shards once. Everything a trainer holds *for itself* (its
dense replica, which under ma / easgd / bmuf differs from its peers' between rounds, its dense
optimizer's moments, its sync runtime's state, its RNG streams and data position) is saved under a
key naming the trainer (`trainer{i}`) as one serialized blob (`PerTrainer`, `ModelState`,
`TrainState`): DCP de-duplicates equal keys across ranks, so an un-keyed replicated tensor would be
written by one rank only and every trainer would resume with that rank's replica.

Atomicity. Step n is written into `directory/.tmp-step_0000000n`; once every trainer's files and
DCP's `.metadata` are written, trainer 0 writes `shadowgba.json` (the setup, the step and the size
and CRC-32 of every file) and renames the folder to `directory/step_0000000n`. A synchronous save
meets the trainers at a barrier before that rename (and after, so every trainer sees it); an
asynchronous one relies on DCP's own final gather (its future completes on trainer 0 only after every
rank's write results arrived) and is committed by trainer 0 when it notices the future is done
(`poll()`, the next `save()`, `wait()` or `close()`). A crash at any point before the rename leaves a
`.tmp-*` folder, never looked at by `load_latest` and removed by the next `Checkpointer` on the
directory; the previous checkpoint stays loadable. Only the last `keep_last` committed checkpoints
are kept (trainer 0 removes older ones after each commit). The directory must be one every trainer
sees (a shared file system when trainers run on several hosts): trainer 0 checksums and renames it.

Asynchronous saves (`async_save=True`): `dcp.async_save` copies the state to CPU memory in the
calling thread (a consistent snapshot; the training thread then goes on) and writes it from a
background thread. That thread runs DCP's collectives, so they run on a dedicated gloo group over the
same trainer ranks with the same timeout (created with `use_local_synchronization`, so server
ranks need not take part), never on the group the training thread's own collectives use. At most one
save is in flight: the next `save()` first waits for, and commits, the previous one.

What is refused (`CheckpointError`, naming the difference or the path): a checkpoint whose
`shadowgba.json` names another sync algorithm, another dense layout (parameter names and sizes, in
order), another trainer count or another server count; a checkpoint that is corrupted or truncated
(a file missing, of another size, or failing its CRC-32; a missing or unreadable `shadowgba.json`);
a checkpoint whose files hold anything but DCP's metadata, tensors and plain data, named file by
file (`shadowgba.checkpoint_reader`: the seal only tells a damaged file, and anyone who can write
the folder can recompute it, so what is loaded is restricted as well; nothing in it is run).
`load(path)` raises on either; `load_latest` skips a corrupted checkpoint (logging why) and falls
back to the newest good one, but raises on a setup mismatch: resuming an older checkpoint of this
setup behind a newer one of another would silently train from the wrong state. Nor does it start
over silently: when checkpoints exist and every one is corrupted, it raises, listing each and why
(`allow_fresh_start=True` makes that a logged fresh start instead).

Resharding. DCP itself can load sharded tensors into another sharding and another world size (its
load planner reads any overlap of saved shards). This module refuses a different trainer or
server count anyway, because most of the state is not of that kind: the per-trainer replicas,
optimizer moments, runtime states and data positions have no meaning for a trainer that did not
exist, and the PS tables' pending GBA buffers and global steps are per server shard (their rows are
saved in global row order, so the rows alone could be resharded). A job that changes its size has
to start from exported weights, not resume.

Nothing here can hang: every collective runs on `process_group` (the trainer group, whose timeout
is the job's `sync.timeout_s`) or, for async saves, on the dedicated group with the same timeout.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import os
import random
import shutil
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.stateful import Stateful

from shadowgba.checkpoint_reader import SafeLoadPlanner, SafeReader
from shadowgba.errors import CheckpointError, ConfigError
from shadowgba.serialized import (
    TMP_PREFIX, commit_folder, state_from_bytes, state_to_bytes, step_folders, verify_folder,
)

logger = logging.getLogger("shadowgba")

_ASYNC_GROUPS: dict[tuple[Any, ...], dist.ProcessGroup] = {}


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a checkpoint must match to be loaded: see the module docstring."""

    algo: str
    """The sync algorithm (or the baseline's name)."""
    dense: tuple[tuple[str, int], ...]
    """Dense parameter names and element counts, in order."""
    trainers: int
    servers: int
    sharding_group_size: int = 0
    """A 2D job's ranks per replica group (0: flat): each group's table replicas are saved apart."""

    @classmethod
    def of(cls, algo: str, dense: Iterable[tuple[str, torch.Tensor]], trainers: int, servers: int,
           sharding_group_size: int = 0) -> "Setup":
        """The setup of a job with these named dense parameters."""
        return cls(algo, tuple((name, int(param.numel())) for name, param in dense), trainers, servers,
                   sharding_group_size)

    def to_json(self) -> dict[str, Any]:
        return {"algo": self.algo, "dense": [list(entry) for entry in self.dense],
                "trainers": self.trainers, "servers": self.servers, "sharding_group_size": self.sharding_group_size}

    def difference(self, saved: Mapping[str, Any]) -> str | None:
        """What differs between this job and a checkpoint's saved setup, in words; None if nothing."""
        if saved.get("algo") != self.algo:
            return f"it was made by sync algo '{saved.get('algo')}', this job runs '{self.algo}'"
        if saved.get("trainers") != self.trainers:
            return f"it was made by {saved.get('trainers')} trainers, this job has {self.trainers}"
        if saved.get("servers") != self.servers:
            return f"it was made with {saved.get('servers')} parameter servers, this job has {self.servers}"
        if saved.get("sharding_group_size", 0) != self.sharding_group_size:
            return (f"it was made with sync.sharding_group_size {saved.get('sharding_group_size', 0)}, this job has "
                    f"{self.sharding_group_size}")
        theirs = [tuple(entry) for entry in saved.get("dense", [])]
        if theirs != list(self.dense):
            for index, (mine, other) in enumerate(zip(self.dense, theirs)):
                if mine != other:
                    return (f"dense parameter {index} is {other[0]} ({other[1]} elements) there, "
                            f"{mine[0]} ({mine[1]} elements) here")
            return f"it has {len(theirs)} dense parameters, this job {len(self.dense)}"
        return None


class PerTrainer:
    """A `Stateful` saving `target.state_dict()` under this trainer's own key, as one serialized blob.

    For state each trainer holds for itself (a dense optimizer, a sync runtime): DCP would
    de-duplicate the same key across ranks. The blob is a snapshot taken when DCP asks for it.
    """

    def __init__(self, target: Any, trainer_index: int) -> None:
        self.target = target
        self.key = f"trainer{trainer_index}"

    def state_dict(self) -> dict[str, Any]:
        return {self.key: state_to_bytes(self.target.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loaded = state_from_bytes(state[self.key], self.key)
        if "torchrec" in sys.modules:  # a TorchRec optimizer needs its state before it loads one
            from shadowgba.integrations.torchrec import give_lazy_state

            give_lazy_state(self.target, loaded)
        self.target.load_state_dict(loaded)


class PerReplica:
    """A `Stateful` whose sharded state (TorchRec's tables, their fused optimizer) is one replica
    group's of a 2D job: saved under the group's key, so DCP writes every group's replicas of the
    same shards apart (they differ between rounds) instead of de-duplicating them to one group's."""

    def __init__(self, target: Any, replica_index: int) -> None:
        self.target = target
        self.key = f"replica{replica_index}"

    def state_dict(self) -> dict[str, Any]:
        return {self.key: self.target.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.target.load_state_dict(state[self.key])


class ModelState:
    """A `Stateful` model: sharded tensors (TorchRec tables, DTensors) through DCP's sharded path,
    everything else (the dense replica) under this trainer's key (see the module docstring). In a
    2D job (`replica_index`) the sharded tensors are saved under the replica group's key."""

    def __init__(self, model: nn.Module, trainer_index: int, replica_index: int | None = None) -> None:
        self.model = model
        self.key = f"trainer{trainer_index}"
        self.sharded_key = "sharded" if replica_index is None else f"sharded_replica{replica_index}"

    def state_dict(self) -> dict[str, Any]:
        sharded, local = self._split(self.model.state_dict())
        return {self.sharded_key: sharded, self.key: state_to_bytes(local)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        local = state_from_bytes(state[self.key], self.key)
        self.model.load_state_dict({**state[self.sharded_key], **local})

    @staticmethod
    def _split(full: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        sharded, local = {}, {}
        for name, value in full.items():
            (sharded if _is_sharded(value) else local)[name] = value
        return sharded, local


@dataclasses.dataclass
class TrainState:
    """Where this trainer is: step, samples it has trained on, data position, RNG streams (Stateful).

    `data_position` is the index of the next training batch in this trainer's stream
    (`CTRData.train_batches(..., start=data_position)`). The RNG states are torch's CPU generator
    (and CUDA's when available), Python's `random` and numpy's global one; loading restores them.
    """

    trainer_index: int
    step: int = 0
    samples: int = 0
    data_position: int = 0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "samples": self.samples, "data_position": self.data_position,
                 "extra": self.extra, "rng": _rng_states()}
        return {f"trainer{self.trainer_index}": state_to_bytes(state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        key = f"trainer{self.trainer_index}"
        loaded = state_from_bytes(state[key], key)
        self.step, self.samples = loaded["step"], loaded["samples"]
        self.data_position, self.extra = loaded["data_position"], loaded["extra"]
        _set_rng_states(loaded["rng"])


class Checkpointer:
    """Saves and restores a dict of `Stateful`s at step boundaries; see the module docstring."""

    def __init__(
        self,
        directory: str | os.PathLike,
        setup: Setup,
        keep_last: int = 2,
        async_save: bool = False,
        process_group: dist.ProcessGroup | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1, got {keep_last}")
        self.directory = Path(directory)
        self.setup = setup
        self.keep_last = keep_last
        self.async_save = async_save
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.timeout_s = timeout_s
        self.save_s: list[float] = []
        """Seconds each save blocked the caller (for async saves: the staging copy only)."""
        self._pending: tuple[int, Path, Future] | None = None
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(f"{TMP_PREFIX}*"):  # saves a crash cut short
                shutil.rmtree(stale, ignore_errors=True)
        self._barrier()

    # ------------------------------------------------------------------------------------- saving
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Checkpoint `state` as of step `step` (collective over the trainers, every one at the same step).

        Values with a `prepare_checkpoint()` method have it called first, before the barrier that
        precedes DCP's `state_dict()` calls (PS tables: this trainer's row pushes have landed)."""
        started = time.perf_counter()
        self.wait()
        for value in state.values():  # e.g. PS tables: this trainer's pushes land before the barrier
            prepare = getattr(value, "prepare_checkpoint", None)
            if callable(prepare):
                prepare()
        final = self.path_of(step)
        tmp = self.directory / f"{TMP_PREFIX}{final.name}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        if self.async_save:
            snapshot = _snapshot(_stateful_to_state_dict(dict(state)))  # in this thread: consistent
            future = dcp.async_save(snapshot, checkpoint_id=str(tmp), process_group=self._dcp_async_group(),
                                    async_stager=_Staged())
            self._pending = (step, tmp, future)
        else:
            dcp.save(dict(state), checkpoint_id=str(tmp), process_group=self.group)
            self._barrier()  # every trainer's files are written
            if self.rank == 0:
                self._commit(step, tmp)
            self._barrier()  # every trainer sees the committed checkpoint
        self.save_s.append(time.perf_counter() - started)

    def poll(self) -> None:
        """No collective: commit a finished async save (trainer 0) and raise its failure, if any."""
        if self._pending is not None and self._pending[2].done():
            self.wait()

    def wait(self) -> None:
        """Wait for the async save in flight (if any) and commit it; no collective."""
        if self._pending is None:
            return
        step, tmp, future = self._pending
        self._pending = None
        try:
            future.result(timeout=self.timeout_s)
        except Exception as error:
            raise CheckpointError(f"asynchronous save of step {step} into {tmp} failed: {error!r}") from error
        if self.rank == 0:
            self._commit(step, tmp)

    def close(self) -> None:
        """Wait for (and commit) the last async save."""
        self.wait()

    # ------------------------------------------------------------------------------------ loading
    def checkpoints(self) -> list[tuple[int, Path]]:
        """Committed checkpoints (step, path), oldest first."""
        return step_folders(self.directory)

    def path_of(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}"

    def load_latest(self, state: Mapping[str, Any], allow_fresh_start: bool = False) -> int | None:
        """Restore the newest good checkpoint into `state` (collective); its step, or None if there is
        none. A corrupted one is skipped (logged), a setup mismatch raises `CheckpointError`. When
        checkpoints exist and none verifies, `CheckpointError` lists each and why: a resume that
        silently started from step 0 would throw the run's work away. With `allow_fresh_start` that
        case returns None instead (logged), as an empty directory does."""
        choice: list[Any] = [None]
        if self.rank == 0:
            try:
                choice[0] = self._choose(allow_fresh_start)
            except CheckpointError as error:
                choice[0] = error
        dist.broadcast_object_list(choice, src=dist.get_global_rank(self.group, 0), group=self.group)
        if isinstance(choice[0], CheckpointError):
            raise CheckpointError(str(choice[0]))
        if choice[0] is None:
            return None
        step, path = choice[0]
        self._load_verified(Path(path), state)
        return step

    def load(self, path: str | os.PathLike, state: Mapping[str, Any]) -> int:
        """Restore the checkpoint at `path` (collective); its step. Raises `CheckpointError` if it is
        corrupted or of another setup, before anything changed."""
        path = Path(path)
        verdict: list[Any] = [None]
        if self.rank == 0:
            try:
                verdict[0] = self.verify(path)
            except CheckpointError as error:
                verdict[0] = error
        dist.broadcast_object_list(verdict, src=dist.get_global_rank(self.group, 0), group=self.group)
        if isinstance(verdict[0], CheckpointError):
            raise CheckpointError(str(verdict[0]))
        self._load_verified(path, state)
        return verdict[0]

    def verify(self, path: Path) -> int:
        """Check the files against `shadowgba.json`, the setup against this job's, and that DCP's
        `.metadata` holds DCP's metadata only (`SafeReader`); its step. Raises `CheckpointError`
        naming the path or file and what is wrong. No collective."""
        step = verify_folder(path, self.setup.difference)["step"]
        SafeReader(path).read_metadata()
        return step

    # ---------------------------------------------------------------------------------- internals
    def _choose(self, allow_fresh_start: bool) -> tuple[int, str] | None:
        """The newest checkpoint that verifies (trainer 0); None when there is none at all. A setup
        mismatch raises; so does a directory whose every checkpoint is corrupted, unless
        `allow_fresh_start`."""
        refused = []
        for step, path in reversed(self.checkpoints()):
            try:
                self.verify(path)
            except CheckpointError as error:
                if "does not fit this job" in str(error):
                    raise
                logger.warning("shadowgba: skipping checkpoint: %s", error)
                refused.append(str(error))
                continue
            return step, str(path)
        if refused and not allow_fresh_start:
            raise CheckpointError(f"none of the {len(refused)} checkpoints in {self.directory} loads, so the run "
                                  "would start over from step 0 (load_latest(..., allow_fresh_start=True) does that): "
                                  + "; ".join(refused))
        if refused:
            logger.warning("shadowgba: every checkpoint in %s is corrupted; starting from step 0 (fresh start "
                           "allowed)", self.directory)
        return None

    def _load_verified(self, path: Path, state: Mapping[str, Any]) -> None:
        failure: Exception | CheckpointException | None = None
        try:
            dcp.load(dict(state), checkpoint_id=str(path), process_group=self.group, storage_reader=SafeReader(path),
                     planner=SafeLoadPlanner())
        except (Exception, CheckpointException) as error:  # a refusal by a Stateful, or a file refused or unreadable
            failure = error
        failed = [failure is not None]
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, failed, group=self.group)
        if failure is not None:
            raise CheckpointError(f"loading checkpoint {path} failed (the state may be partly loaded): "
                                  f"{_reason(failure)}") from failure
        if any(flag[0] for flag in everyone):
            raise CheckpointError(f"loading checkpoint {path} failed on another trainer (the state may be partly "
                                  "loaded)")

    def _commit(self, step: int, tmp: Path) -> None:
        """Trainer 0: seal the folder and rename it into place (`commit_folder`), dropping the oldest."""
        commit_folder(tmp, self.path_of(step), step, self.setup.to_json(), self.keep_last)

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    def _dcp_async_group(self) -> dist.ProcessGroup:
        """The dedicated gloo group of async saves: one per trainer set and timeout for the life of the
        default group (re-creating local-synchronization groups of the same ranks can hang in
        torch 2.13's `new_group`), shared by every Checkpointer of this process."""
        ranks = tuple(dist.get_process_group_ranks(self.group))
        key = (id(dist.group.WORLD), ranks, self.timeout_s)
        if key not in _ASYNC_GROUPS:
            _ASYNC_GROUPS[key] = dist.new_group(
                ranks=list(ranks), backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s),
                use_local_synchronization=True,
            )
        return _ASYNC_GROUPS[key]


class _Staged(AsyncStager):
    """The state is already a CPU snapshot (`_snapshot`): DCP's default stager cannot copy a
    `ShardedTensor` (torch 2.13: `new_empty` is not implemented for it)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _reason(failure: Exception | CheckpointException) -> str:
    """What failed, in words: DCP's `CheckpointException` (a BaseException) wraps each rank's error
    with its traceback; the errors themselves say it."""
    if isinstance(failure, CheckpointException):
        return "; ".join(f"on rank {rank}: {error}" for rank, (error, _) in failure.failures.items())
    return str(failure)


def _stateful_to_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state.items()}


def _snapshot(value: Any) -> Any:
    """A copy of `value` whose tensors (ShardedTensor shards and DTensor locals included) are CPU clones."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, ShardedTensor):
        metadata = copy.deepcopy(value.metadata())
        for shard_metadata in metadata.shards_metadata:
            shard_metadata.placement = _cpu_placement(shard_metadata.placement)
        metadata.tensor_properties.pin_memory = False
        shards = [
            Shard(shard.tensor.detach().to("cpu", copy=True),
                  dataclasses.replace(shard.metadata, placement=_cpu_placement(shard.metadata.placement)))
            for shard in value.local_shards()
        ]
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata,
                                                                         process_group=value._process_group)
    if isinstance(value, DTensor):
        return DTensor.from_local(value.to_local().detach().to("cpu", copy=True), value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {key: _snapshot(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_snapshot(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_snapshot(item) for item in value)
    return copy.deepcopy(value)


def _cpu_placement(placement: Any) -> Any:
    from torch.distributed.remote_device import _remote_device

    if placement is None:
        return None
    return _remote_device(f"rank:{placement.rank()}/cpu")


def _is_sharded(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    return isinstance(value, (ShardedTensor, DTensor))


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        name, keys, position, has_gauss, cached_gaussian = numpy.random.get_state()
        states["numpy"] = {"name": name, "keys": torch.from_numpy(keys.copy()), "position": position,
                           "has_gauss": has_gauss, "cached_gaussian": cached_gaussian}
    except ImportError:
        pass
    return states


def _set_rng_states(states: Mapping[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy

        state = states["numpy"]
        numpy.random.set_state((state["name"], state["keys"].numpy(), state["position"], state["has_gauss"],
                                state["cached_gaussian"]))


__all__ = ["Checkpointer", "ModelState", "PerTrainer", "Setup", "Stateful", "TrainState"]
