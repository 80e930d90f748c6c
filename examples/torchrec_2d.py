"""TorchRec's DLRM in the 2D layout: replica groups that never wait for each other.

    torchrun --standalone --nproc_per_node=4 examples/torchrec_2d.py --config examples/configs/bmuf_2d.yaml

With `sync.sharding_group_size: k` the ranks form groups of k: TorchRec shards the tables over a
group only, so its all-to-all pairs no rank outside it, and shadowgba's shadow thread averages each
rank's table shards with their replicas in the other groups (and the dense replicas over all
ranks) in the background. A slow rank slows its own group, not the others. The training loop is
TorchRec's golden one (`TrainPipelineSparseDist`, random data); the lines marked `# shadowgba` are
all that shadowgba adds, the same as in the flat layout (`torchrec_dlrm.py`): the layout is config.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os

import torch
from torch import distributed as dist
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import shadowgba  # shadowgba


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file whose `sync` section sets sharding_group_size")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=256)
    args, overrides = parser.parse_known_args()  # e.g. --sync.tables.fragment_mb 1
    config = shadowgba.load_config(shadowgba.SyncConfig, args.config, overrides, section="sync")  # shadowgba
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    shadowgba.init_process_group("nccl" if device.type == "cuda" else "gloo")  # shadowgba: across hosts too
    job = shadowgba.join(config)  # shadowgba: sharding and replica groups, with the job's timeout

    tables = [EmbeddingBagConfig(name=f"t_{name}", embedding_dim=16, num_embeddings=10_000, feature_names=[name])
              for name in DEFAULT_CAT_NAMES]
    dlrm = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
                dense_in_features=len(DEFAULT_INT_NAMES), dense_arch_layer_sizes=[64, 16],
                over_arch_layer_sizes=[64, 1], dense_device=device)
    train_model = DLRMTrain(dlrm)
    apply_optimizer_in_backward(RowWiseAdagrad, train_model.model.sparse_arch.parameters(), {"lr": 0.1})
    # the tables are sharded over this rank's group; the same plan (fused kernels) in every group
    model = DistributedModelParallel(module=train_model, device=device, **job.dmp_kwargs())  # shadowgba
    optimizer = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda params: torch.optim.Adagrad(params, lr=0.1))
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    dataset = RandomRecDataset(keys=DEFAULT_CAT_NAMES, batch_size=args.batch_size, hash_size=10_000,
                               ids_per_feature=1, num_dense=len(DEFAULT_INT_NAMES))
    batches = itertools.islice(dataset, args.steps)
    with shadowgba.dense_sync(model, optimizer, job) as sync:  # shadowgba
        with contextlib.suppress(StopIteration):
            while True:
                pipeline.progress(batches)
    summary = sync.metrics.summary()
    print(f"rank {dist.get_rank()} (group {job.layout.group_index}): {summary['table_cycles']} table cycles, "
          f"{summary['rounds']} dense rounds, steps={summary['steps']}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
