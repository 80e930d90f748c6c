"""A tiny TorchRec model sharded table-wise with DistributedModelParallel (or over PS-hosted tables),
for runtime tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper

from shadowgba.integrations.torchrec import ShadowDataParallelWrapper, dense_named_parameters

TABLES = ("t0", "t1")
ROWS, DIM, BATCH = 50, 8, 16


def table_configs() -> list[EmbeddingBagConfig]:
    """The two tables, one feature each, named as the table."""
    return [EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[t]) for t in TABLES]


class TinyRec(nn.Module):
    """Pooled embeddings of two tables -> an MLP -> one logit; returns (loss, logits) as TorchRec's
    train pipelines expect. `ebc`: the tables' module (default: an EmbeddingBagCollection on the meta
    device, for DMP to shard; a `PSEmbeddingBagCollection` for PS-hosted tables)."""

    def __init__(self, ebc: nn.Module | None = None) -> None:
        super().__init__()
        self.ebc = ebc if ebc is not None else EmbeddingBagCollection(tables=table_configs(), device=torch.device("meta"))
        self.mlp = nn.Sequential(nn.Linear(DIM * len(TABLES), 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.mlp(self.ebc(batch.sparse_features).values()).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits


def build(
    wrapper: DataParallelWrapper | None = None, dmp_kwargs: dict[str, Any] | None = None, golden_optimizer: bool = False,
    stateful_optimizers: bool = False,
) -> tuple[DistributedModelParallel, KeyedOptimizerWrapper]:
    """The sharded model (fused SGD on the tables) and an SGD optimizer over its dense parameters.

    `dmp_kwargs` go to DistributedModelParallel (`job.dmp_kwargs()`: shard over the trainers only);
    `golden_optimizer` builds the optimizer as TorchRec's golden training script does, over every
    named parameter of the DMP; `stateful_optimizers` uses Adagrad on the tables and Adam on the
    dense part instead (optimizer state for checkpoint tests to restore)."""
    torch.manual_seed(dist.get_rank())  # different dense init per rank: the runtime must broadcast
    model = TinyRec()
    table_optimizer = torch.optim.Adagrad if stateful_optimizers else torch.optim.SGD
    apply_optimizer_in_backward(table_optimizer, model.ebc.parameters(), {"lr": 0.1})
    kwargs = dict(dmp_kwargs or {"data_parallel_wrapper": wrapper or ShadowDataParallelWrapper()})
    group = kwargs["env"].process_group if "env" in kwargs else dist.GroupMember.WORLD
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(group), compute_device="cpu"),
        constraints={t: ParameterConstraints(sharding_types=["table_wise"]) for t in TABLES},
    )
    plan = planner.collective_plan(model, [EmbeddingBagCollectionSharder()], group)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, **kwargs)
    params = dict(dmp.named_parameters()) if golden_optimizer else dict(dense_named_parameters(dmp))
    return dmp, KeyedOptimizerWrapper(params, lambda params: dense_optimizer(params, stateful_optimizers))


def dense_optimizer(params: Any, stateful: bool = False) -> torch.optim.Optimizer:
    """SGD over the dense parameters, or Adam (optimizer state) when `stateful`."""
    return torch.optim.Adam(params, lr=0.01) if stateful else torch.optim.SGD(params, lr=0.05)


def batch(rank: int, index: int) -> Batch:
    """A deterministic batch: one id per table per sample, and a label."""
    generator = torch.Generator().manual_seed(10_000 * rank + index)
    ids = torch.randint(0, ROWS, (len(TABLES), BATCH), generator=generator)
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=list(TABLES), values=ids.reshape(-1), lengths=torch.ones(len(TABLES) * BATCH, dtype=torch.int32)
    )
    labels = (ids[0] % 2 == 0).float()
    return Batch(dense_features=torch.zeros(BATCH, 1), sparse_features=features, labels=labels)
