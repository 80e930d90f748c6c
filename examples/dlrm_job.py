"""Roles in the example's torchrun job: trainers and (for GBA) parameter servers.

- Without servers every rank is a trainer and the trainer group is the default group.
- With `ps.num_servers > 0` (gba, easgd_ps) the last ranks are servers: each serves a dense GBA
  shard (gba) or a slice of the EASGD centre (easgd_ps) and, with `model.embeddings: ps`, an
  embedding shard, then waits in `transport.stop()` until every trainer is done. Trainers get
  `Roles.trainer_group`; everything a trainer does collectively (the training loop's own
  collectives, held-out evaluation, throughput sums, the replica check, ShadowSync's broadcast and
  final average) runs on that group, never on the default group the servers are part of.
- `dense_sync` picks what keeps the dense replicas together: ShadowSync (ma / easgd / bmuf /
  easgd_ps), GBASync (gba: sync all-reduce or GBA, per `sync.options.initial_mode`), torch's
  periodic model averager (pma, `dlrm_pma`), or nothing (none / ddp).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from dlrm_config import ExperimentConfig
from dlrm_model import ps_embedding_config, tables
from dlrm_pma import PeriodicAveraging
from shadowgba.config import BASELINES
from shadowgba.ctr_data import CTRData
from shadowgba.dense import dense_named_parameters
from shadowgba.gba import GBASync, serve_dense_shard
from shadowgba.ps import transport
from shadowgba.ps.easgd_center import CENTER_SERVICE, ElasticCenter
from shadowgba.ps.embedding import DEFAULT_SERVICE, EmbeddingShard
from shadowgba.runtime import ShadowSync


def join(config: ExperimentConfig, backend: str) -> transport.Roles:
    """This rank's roles (collective: every rank calls it after `init_process_group`)."""
    if config.ps.num_servers:
        return transport.start(config.ps.num_servers, backend)
    roles = transport.Roles.assign(dist.get_rank(), dist.get_world_size(), num_servers=0)
    return dataclasses.replace(roles, trainer_group=dist.group.WORLD)


def leave(roles: transport.Roles) -> None:
    """Collective counterpart of `join`; with servers, they are released when every trainer is here."""
    if roles.num_servers:
        transport.stop()


def serve(config: ExperimentConfig, data: CTRData, roles: transport.Roles) -> None:
    """A server rank's whole job: host its shards (trainers configure the dense one) or its slice of
    the S-EASGD centre (trainers initialise it)."""
    if config.sync.algo == "easgd_ps":
        transport.serve(CENTER_SERVICE, ElasticCenter())
    else:
        serve_dense_shard()
    if config.model.embeddings == "ps":
        shard = EmbeddingShard(tables(config, data), ps_embedding_config(config, len(roles.trainer_ranks)),
                               roles.server_index, roles.num_servers)
        transport.serve(DEFAULT_SERVICE, shard)


def dense_sync(
    config: ExperimentConfig, model: nn.Module, optimizer: torch.optim.Optimizer, roles: transport.Roles
) -> ShadowSync | GBASync | PeriodicAveraging | None:
    """The synchronization of the dense replicas that `sync.algo` names (None for none and ddp)."""
    if config.sync.algo == "pma":
        params = [param for _, param in dense_named_parameters(model)]
        return PeriodicAveraging(params, optimizer, config.sync.foreground_every, roles.trainer_group)
    if config.sync.algo in BASELINES:
        return None
    if config.sync.algo == "gba":
        lockstep_every = config.train.stop_check_every if config.lockstep else 0  # TorchRec tables pair the steps
        return GBASync(model, optimizer, config.sync, roles, local_batch_size=config.data.batch_size,
                       lockstep_every=lockstep_every)
    return ShadowSync(model, optimizer, config.sync, process_group=roles.trainer_group)


def applied_samples(gba: GBASync, config: ExperimentConfig) -> Callable[[], int]:
    """A counter of the samples the dense parameters have been updated with, read from the global
    step k: one global batch per step, or one local batch per step under GBA without aggregation
    (exact unless such a job switches modes while running)."""
    without_aggregation = config.sync.algorithm_config().aggregation == "none"

    def count() -> int:
        per_step = config.data.batch_size if without_aggregation and gba.mode == "gba" else gba.global_batch
        return gba.global_step * per_step

    return count
