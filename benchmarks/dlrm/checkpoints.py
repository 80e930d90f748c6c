"""Checkpoints of the example's job (`--checkpoint-dir`, `--checkpoint-every`, `--resume`), via
`shadowgba.checkpoint`.

What one checkpoint holds: the model (`ModelState`: TorchRec-sharded tables through DCP's sharded
path, this trainer's dense replica under its own key), the dense optimizer and the sync runtime
(per trainer), TorchRec's fused embedding optimizer (sharded) or the PS-hosted tables with their
optimizer state (gathered by trainer 0, `PSEmbeddingBagCollection`), under easgd_ps the EASGD centre
(gathered by trainer 0 from the servers, `Job.centre()`), and a `TrainState` (step,
samples, data position, RNG streams). It is taken after the step's `optimizer.step()` (and so after a
foreground round that step holds), every trainer at the same step; the data position is the next
batch index of the trainer's stream, which every `ctrkit` source can start from (`train_batches(...,
start=)`): synthetic data regenerates batch `start` directly from (seed, rank, index), the
MovieLens / in-memory tables seek to (epoch, position) of their seeded shuffle, Criteo TSV files are
read and skipped line by line up to the position (cost linear in the samples already trained on).

Resuming (`--resume`) loads the newest good checkpoint if there is one, after the sync's `start()`
(which broadcasts trainer 0's replica: each trainer's own one is restored after it); the run then
trains until `train.steps` counted from step 0, so a resumed run trains the same total steps. When
the directory holds checkpoints and every one is corrupted, the job fails listing each and why,
unless `--resume-allow-fresh-start` says to train from step 0 then.
Under `torchrun --max-restarts=N` a restarted attempt resumes by itself when `--resume` is given.

Not supported (refused at start-up): the pma baseline (torch's averager keeps a step counter that
is not Stateful), and saving (`--checkpoint-every`) in `train.duration_s` / `train.global_samples`
runs whose trainers step independently (PS tables): a save is collective at one step, which such
trainers may never all reach. Such a run may still `--resume`: the load happens once, before the
first step, where every trainer is. That is how `bench_gba --warm-start-samples` continues one
synchronous run under each algorithm.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import shadowgba
from dlrm.config import ExperimentConfig
from dlrm.model import BuiltModel
from shadowgba.checkpoint import Checkpointer, ModelState, PerReplica, PerTrainer, Setup, TrainState
from shadowgba.errors import CheckpointError, ConfigError
from shadowgba.integrations.torchrec import dense_named_parameters


@dataclasses.dataclass
class CheckpointOptions:
    """The harness's checkpoint flags."""

    directory: Path | None = None
    every: int = 0
    """Steps between checkpoints (0: none, but --resume still loads)."""
    resume: bool = False
    keep_last: int = 2
    async_save: bool = False
    allow_fresh_start: bool = False
    """With `resume`: when every checkpoint in the directory is corrupted, start from step 0 rather than fail."""

    def check(self, config: ExperimentConfig) -> None:
        """Refuse what cannot run, before any process group exists."""
        if self.allow_fresh_start and not self.resume:
            raise ConfigError("--resume-allow-fresh-start needs --resume")
        if self.directory is None:
            if self.every or self.resume:
                raise ConfigError("--checkpoint-every and --resume need --checkpoint-dir")
            return
        if self.every < 0 or self.keep_last < 1:
            raise ConfigError("--checkpoint-every must be >= 0 and --checkpoint-keep >= 1")
        if config.baseline == "pma":
            raise ConfigError("--checkpoint-dir: the pma baseline cannot be checkpointed (torch's averager "
                              "is not Stateful)")
        if config.train.job_samples:
            raise ConfigError("--checkpoint-dir: train.job_samples counts the samples of one run from its start; "
                              "a resumed run would count them again")
        if self.every and not config.lockstep and (config.train.duration_s or config.train.global_samples):
            raise ConfigError("--checkpoint-every: with PS tables trainers step independently; saving checkpoints "
                              "needs a step count (train.steps), not train.duration_s or train.global_samples "
                              "(--resume alone is fine: loading happens before the first step)")


class JobCheckpoints:
    """The Checkpointer and the Stateful dict of one trainer; `after_step` saves when due."""

    def __init__(self, options: CheckpointOptions, config: ExperimentConfig, model: BuiltModel,
                 optimizer: Any, sync: Any, job: shadowgba.Job) -> None:
        self.options = options
        self.batch_size = config.data.batch_size
        self.train_state = TrainState(job.trainer_index)
        setup = Setup.of(config.algo, dense_named_parameters(model.module), job.num_trainers, job.roles.num_servers,
                         config.sync.sharding_group_size)
        replica = job.layout.group_index if job.layout is not None else None
        directory = options.directory
        if job.replica_store is not None:  # one torchrun job per group: each commits its own checkpoints
            directory = Path(directory) / f"group{replica}"
        self.checkpointer = Checkpointer(
            directory, setup, keep_last=options.keep_last, async_save=options.async_save,
            process_group=job.trainer_group, timeout_s=config.sync.timeout_s,
        )
        self.state: dict[str, Any] = {
            "model": ModelState(model.module, job.trainer_index, replica),
            "dense_optimizer": PerTrainer(optimizer, job.trainer_index),
        }
        fused = getattr(model.module, "fused_optimizer", None)
        if fused is not None:
            self.state["embedding_optimizer"] = fused if replica is None else PerReplica(fused, replica)
        if model.ps_embeddings is not None:
            self.state["ps_embeddings"] = model.ps_embeddings
        if sync is not None:
            self.state["sync"] = PerTrainer(sync, job.trainer_index)
        if config.algo == "easgd_ps":
            self.state["centre"] = job.centre()  # on the servers: gathered by trainer 0
        self.state["train"] = self.train_state  # last: restores the RNG states after everything else
        self.resumed_from: int | None = None
        self.resumed_position_only = False
        self.load_s = 0.0
        self._start_step = 0

    def resume(self, position_only: bool = False) -> int:
        """Load the newest checkpoint when --resume says so (collective); the step to continue from.
        `position_only`: only the train state (a replica group that joined a running job holds a
        replica newer than its checkpoint's: `DenseSync.joined_running_job`)."""
        if self.options.resume:
            started = time.perf_counter()
            state = {"train": self.train_state} if position_only else self.state
            try:
                self.resumed_from = self.checkpointer.load_latest(state, self.options.allow_fresh_start)
            except CheckpointError as error:
                if "would start over from step 0" in str(error):
                    error.add_note("train_dlrm.py: add --resume-allow-fresh-start to train from step 0 anyway")
                raise
            self.resumed_position_only = position_only and self.resumed_from is not None
            self.load_s = time.perf_counter() - started if self.resumed_from is not None else 0.0
        self._start_step = self.train_state.step
        return self._start_step

    @property
    def data_position(self) -> int:
        return self.train_state.data_position

    def after_step(self, step: int) -> float:
        """Keep the train state current; save when due (collective). Returns the seconds spent."""
        started = time.perf_counter()
        state = self.train_state
        state.data_position += step - state.step  # one batch per step
        state.samples += (step - state.step) * self.batch_size
        state.step = step
        if self.options.every and step % self.options.every == 0:
            self.checkpointer.save(step, self.state)
        else:
            self.checkpointer.poll()
        return time.perf_counter() - started

    def close(self) -> None:
        self.checkpointer.close()

    def summary(self) -> dict[str, Any]:
        saves = self.checkpointer.save_s
        latest = self.checkpointer.checkpoints()[-1:] if self.checkpointer.rank == 0 else []
        size = sum(f.stat().st_size for f in latest[0][1].rglob("*") if f.is_file()) if latest else None
        return {
            "directory": str(self.options.directory), "every": self.options.every, "async": self.options.async_save,
            "resumed_from_step": self.resumed_from, "resumed_position_only": self.resumed_position_only,
            "load_s": self.load_s,
            "saves": len(saves), "save_s_mean": sum(saves) / len(saves) if saves else None,
            "save_s_max": max(saves, default=None), "latest_size_bytes": size,
        }
