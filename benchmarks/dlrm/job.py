"""Roles in the harness's torchrun job, and what keeps the dense replicas together.

- `join` is `shadowgba.join` with the harness's tables: without servers every rank trains; with
  `sync.ps.num_servers > 0` (gba, easgd_ps) the last ranks are servers, which serve for the whole
  job inside `join` (GBA's dense shards or the S-EASGD centre and, with `model.embeddings: ps`, the
  tables). Everything a trainer does collectively (TorchRec's all-to-all, held-out evaluation,
  throughput sums, the replica check) runs on `job.trainer_group`, never on the default group.
- `dense_sync` is `shadowgba.dense_sync` for every shadowgba algorithm, torch's periodic model
  averager for the pma baseline (`dlrm.pma`), or nothing (none / ddp).
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from torch import nn

import shadowgba
from ctrkit.ctr_data import CTRData
from dlrm.config import ExperimentConfig
from dlrm.model import tables
from dlrm.pma import PeriodicAveraging
from shadowgba.integrations.torchrec import dense_named_parameters


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
    if config.baseline is not None:
        return None
    return shadowgba.dense_sync(model, optimizer, job, local_batch_size=config.data.batch_size, end_job=False)


def applied_samples(sync: Any, config: ExperimentConfig) -> Callable[[], int]:
    """A counter of the samples the dense parameters have been updated with under gba, read from the
    global step k: one global batch per step, or one local batch per step under GBA without
    aggregation (exact unless such a job switches modes while running)."""
    without_aggregation = config.sync.gba.aggregation == "none"

    def count() -> int:
        per_step = config.data.batch_size if without_aggregation and sync.mode == "gba" else sync.global_batch
        return sync.global_step * per_step

    return count
