"""Building the example's DLRM: tables sharded by TorchRec over the trainers, or hosted on the PS.

- `model.embeddings: torchrec`: tables built on the meta device, sharded table-wise round-robin over
  the *trainer group* by `DistributedModelParallel` (server ranks, if any, hold no table and take no
  part in the all-to-all), trained by a fused in-backward optimizer. The dense part is left out of
  DDP unless `sync.algo` is `ddp`.
- `model.embeddings: ps`: a `PSEmbeddingBagCollection` in place of TorchRec's collection; the
  servers serve `EmbeddingShard`s built from the same `tables()` and `ps_embedding_config()`. Under
  GBA's global-batch aggregation the rows' gradients are aggregated over the same global batch as
  the dense ones, stale ones decayed by the same `sync.options.decay`; without aggregation (plain
  async PS) and under S-EASGD they are applied on arrival.

Either way the dense parameters must be exactly the MLPs': `build_model` checks it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from dlrm_config import ExperimentConfig
from shadowgba.dense import dense_named_parameters
from shadowgba.ps import transport
from shadowgba.ps.embedding import PSEmbeddingBagCollection, PSEmbeddingConfig
from shadowgba.ctr_data import CTRData
from shadowgba.torchrec_integration import ShadowDataParallelWrapper
from sync_algos.staleness import StalenessDecayConfig

DENSE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
}
TORCHREC_EMBEDDING_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rowwise_adagrad": RowWiseAdagrad,
}
EBC_PATH = "model.sparse_arch.embedding_bag_collection"
"""Where DLRMTrain keeps the EmbeddingBagCollection: the key of the sharding plan."""


@dataclasses.dataclass
class BuiltModel:
    """The trainable model and the handles the training loop needs."""

    module: nn.Module
    """DLRMTrain (inside DMP with TorchRec tables): `module(batch) -> (loss, (loss, logits, labels))`."""
    dense_params: list[nn.Parameter]
    """The replicated (dense) parameters: exactly the two MLPs'."""
    ps_embeddings: PSEmbeddingBagCollection | None
    """The PS-hosted tables, whose row gradients the loop pushes after backward; None with TorchRec."""


def tables(config: ExperimentConfig, data: CTRData) -> list[EmbeddingBagConfig]:
    """One table per sparse feature (the same list on trainers and servers)."""
    return [
        EmbeddingBagConfig(
            name=f"table_{index}", embedding_dim=config.model.embedding_dim, num_embeddings=size, feature_names=[feature]
        )
        for index, (feature, size) in enumerate(zip(data.feature_names, data.num_embeddings_per_feature))
    ]


def ps_embedding_config(config: ExperimentConfig, num_trainers: int) -> PSEmbeddingConfig:
    """How the PS tables update: aggregated over GBA's global batch, or on arrival (Hogwild) without
    aggregation and under S-EASGD."""
    gba = config.sync.algorithm_config() if config.sync.algo == "gba" else None
    aggregate = gba is not None and gba.aggregation == "global_batch"
    return PSEmbeddingConfig(
        optimizer=config.train.embedding_optimizer,
        lr=config.train.embedding_lr,
        mode="aggregate" if aggregate else "hogwild",
        global_batch=num_trainers * config.data.batch_size if aggregate else 0,
        decay=gba.decay if aggregate else StalenessDecayConfig(),  # stale rows decay as the dense gradients
        max_in_flight=config.ps.max_in_flight,
        seed=config.train.seed,
    )


def build_model(
    config: ExperimentConfig, data: CTRData, roles: transport.Roles, device: torch.device
) -> BuiltModel:
    """The DLRM on a trainer rank, its tables where `model.embeddings` says."""
    table_configs = tables(config, data)
    if config.model.embeddings == "ps":
        ebc: nn.Module = PSEmbeddingBagCollection(
            table_configs, ps_embedding_config(config, len(roles.trainer_ranks)), roles.num_servers
        )
    else:
        ebc = EmbeddingBagCollection(tables=table_configs, device=torch.device("meta"))
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=data.num_dense,
        dense_arch_layer_sizes=config.model.dense_arch_layer_sizes,
        over_arch_layer_sizes=config.model.over_arch_layer_sizes,
        dense_device=device,
    )
    if config.model.embeddings == "ps":
        module: nn.Module = DLRMTrain(dlrm).to(device)
    else:
        module = _shard(config, ebc, DLRMTrain(dlrm), roles, device)
    dense = dict(dense_named_parameters(module))
    mlps = {id(param) for param in [*dlrm.dense_arch.parameters(), *dlrm.over_arch.parameters()]}
    if {id(param) for param in dense.values()} != mlps:
        raise RuntimeError(f"dense parameters are not exactly the DLRM's MLPs: {sorted(dense)}")
    return BuiltModel(module, list(dense.values()), ebc if isinstance(ebc, PSEmbeddingBagCollection) else None)


def _shard(
    config: ExperimentConfig,
    ebc: EmbeddingBagCollection,
    train_module: DLRMTrain,
    roles: transport.Roles,
    device: torch.device,
) -> DistributedModelParallel:
    """Table-wise round-robin over the trainers, fused optimizer; dense DDP only for `ddp`."""
    optimizer = TORCHREC_EMBEDDING_OPTIMIZERS[config.train.embedding_optimizer]
    apply_optimizer_in_backward(optimizer, ebc.parameters(), {"lr": config.train.embedding_lr})
    num_trainers = len(roles.trainer_ranks)
    # Explicit kernel: left out, TorchRec picks "fused" only if the in-backward optimizer above is
    # already attached, else "dense" (tables that no optimizer here would train).
    placement = {
        table.name: table_wise(rank=index % num_trainers, compute_kernel="fused")
        for index, table in enumerate(ebc.embedding_bag_configs())
    }
    plan = ShardingPlan(
        {EBC_PATH: construct_module_sharding_plan(ebc, placement, world_size=num_trainers, device_type=device.type)}
    )
    wrapper = DefaultDataParallelWrapper() if config.sync.algo == "ddp" else ShadowDataParallelWrapper()
    return DistributedModelParallel(
        train_module, env=ShardingEnv.from_process_group(roles.trainer_group), device=device, plan=plan,
        data_parallel_wrapper=wrapper,
    )
