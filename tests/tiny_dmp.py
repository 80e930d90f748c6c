"""A tiny TorchRec model sharded table-wise with DistributedModelParallel, for runtime tests."""

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


class TinyRec(nn.Module):
    """Pooled embeddings of two tables -> an MLP -> one logit; returns (loss, logits) as TorchRec's
    train pipelines expect."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[t]) for t in TABLES],
            device=torch.device("meta"),
        )
        self.mlp = nn.Sequential(nn.Linear(DIM * len(TABLES), 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.mlp(self.ebc(batch.sparse_features).values()).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits


def build(
    wrapper: DataParallelWrapper | None = None, dmp_kwargs: dict[str, Any] | None = None, golden_optimizer: bool = False
) -> tuple[DistributedModelParallel, KeyedOptimizerWrapper]:
    """The sharded model (fused SGD on the tables) and an SGD optimizer over its dense parameters.

    `dmp_kwargs` go to DistributedModelParallel (`job.dmp_kwargs()`: shard over the trainers only);
    `golden_optimizer` builds the optimizer as TorchRec's golden training script does, over every
    named parameter of the DMP."""
    torch.manual_seed(dist.get_rank())  # different dense init per rank: the runtime must broadcast
    model = TinyRec()
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.1})
    kwargs = dict(dmp_kwargs or {"data_parallel_wrapper": wrapper or ShadowDataParallelWrapper()})
    group = kwargs["env"].process_group if "env" in kwargs else dist.GroupMember.WORLD
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(group), compute_device="cpu"),
        constraints={t: ParameterConstraints(sharding_types=["table_wise"]) for t in TABLES},
    )
    plan = planner.collective_plan(model, [EmbeddingBagCollectionSharder()], group)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, **kwargs)
    params = dict(dmp.named_parameters()) if golden_optimizer else dict(dense_named_parameters(dmp))
    optimizer = KeyedOptimizerWrapper(params, lambda params: torch.optim.SGD(params, lr=0.05))
    return dmp, optimizer


def batch(rank: int, index: int) -> Batch:
    """A deterministic batch: one id per table per sample, and a label."""
    generator = torch.Generator().manual_seed(10_000 * rank + index)
    ids = torch.randint(0, ROWS, (len(TABLES), BATCH), generator=generator)
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=list(TABLES), values=ids.reshape(-1), lengths=torch.ones(len(TABLES) * BATCH, dtype=torch.int32)
    )
    labels = (ids[0] % 2 == 0).float()
    return Batch(dense_features=torch.zeros(BATCH, 1), sparse_features=features, labels=labels)
