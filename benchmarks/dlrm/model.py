"""Building the example's DLRM: tables sharded by TorchRec over the trainers, or hosted on the PS.

- `model.embeddings: torchrec`: tables built on the meta device, sharded table-wise round-robin over
  the *trainer group* by `DistributedModelParallel` (server ranks, if any, hold no table and take no
  part in the all-to-all), trained by a fused in-backward optimizer. The dense part is left out of
  DDP unless `baseline` is `ddp`.
- `model.embeddings: ps`: a `PSEmbeddingBagCollection` in place of TorchRec's collection
  (`job.ps_embeddings()`); the servers serve `EmbeddingShard`s built from the same `tables()`
  and `shadowgba.ps_table_options`. Under
  GBA's global-batch aggregation the rows' gradients are aggregated over the same global batch as
  the dense ones, stale ones weighed by `sync.gba.row_decay`; without aggregation (plain
  async PS) and under S-EASGD they are applied on arrival.

Either way the dense parameters must be exactly the MLPs': `build_model` checks it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from dlrm.config import ExperimentConfig
from dlrm.torchrec_2d import WorldDDP
import shadowgba
from shadowgba.ps.embedding import PSEmbeddingBagCollection
from ctrkit.ctr_data import CTRData
from shadowgba.integrations.torchrec import dense_named_parameters

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


def build_model(
    config: ExperimentConfig, data: CTRData, job: shadowgba.Job, device: torch.device
) -> BuiltModel:
    """The DLRM on a trainer rank, its tables where `model.embeddings` says."""
    table_configs = tables(config, data)
    if config.model.embeddings == "ps":
        ebc: nn.Module = job.ps_embeddings()
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
        module = _shard(config, ebc, DLRMTrain(dlrm), job, device)
    dense = dict(dense_named_parameters(module))
    mlps = {id(param) for param in [*dlrm.dense_arch.parameters(), *dlrm.over_arch.parameters()]}
    if {id(param) for param in dense.values()} != mlps:
        raise RuntimeError(f"dense parameters are not exactly the DLRM's MLPs: {sorted(dense)}")
    return BuiltModel(module, list(dense.values()), ebc if isinstance(ebc, PSEmbeddingBagCollection) else None)


def _shard(
    config: ExperimentConfig,
    ebc: EmbeddingBagCollection,
    train_module: DLRMTrain,
    job: shadowgba.Job,
    device: torch.device,
) -> DistributedModelParallel:
    """Table-wise round-robin over the trainers, fused optimizer; dense DDP only for `ddp`."""
    optimizer = TORCHREC_EMBEDDING_OPTIMIZERS[config.train.embedding_optimizer]
    apply_optimizer_in_backward(optimizer, ebc.parameters(), {"lr": config.train.embedding_lr})
    # over the trainers, or a 2D job's sharding group (the job's guard places it in every group)
    ranks = job.layout.group_size if job.layout is not None else job.num_trainers
    # Explicit kernel: left out, TorchRec picks "fused" only if the in-backward optimizer above is
    # already attached, else "dense" (tables that no optimizer here would train).
    placement = {
        table.name: table_wise(rank=index % ranks, compute_kernel="fused")
        for index, table in enumerate(ebc.embedding_bag_configs())
    }
    plan = ShardingPlan(
        {EBC_PATH: construct_module_sharding_plan(ebc, placement, world_size=ranks, device_type=device.type)}
    )
    dmp_kwargs = job.dmp_kwargs()
    if config.baseline == "ddp":
        dmp_kwargs["data_parallel_wrapper"] = DefaultDataParallelWrapper()
    if config.baseline == "torchrec_2d":
        dmp_kwargs["data_parallel_wrapper"] = WorldDDP(job.trainer_group)
    return DistributedModelParallel(train_module, device=device, plan=plan, **dmp_kwargs)
