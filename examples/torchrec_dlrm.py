"""TorchRec's DLRM with its train pipeline, the dense replicas kept in sync by shadowgba.

    torchrun --standalone --nproc_per_node=2 examples/torchrec_dlrm.py --config examples/configs/bmuf.yaml
    torchrun --standalone --nproc_per_node=3 examples/torchrec_dlrm.py --config examples/configs/gba.yaml

Any config of examples/configs works; only its `sync` section is read, and the algorithms with
parameter servers (gba, easgd_ps) take `sync.ps.num_servers` of the ranks as servers. The model,
data and loop are those of TorchRec's golden training example (random data,
`TrainPipelineSparseDist`); the lines marked `# shadowgba` are what shadowgba adds to it.
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


def train(config: shadowgba.SyncConfig, steps: int, batch_size: int, num_embeddings: int = 10_000) -> None:
    """Every rank: join the job; trainers train `steps` steps of `batch_size` samples each."""
    rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device, backend = torch.device(f"cuda:{rank}"), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    shadowgba.init_process_group(backend)  # shadowgba: torch's, with gloo on the NIC that reaches MASTER_ADDR
    job = shadowgba.join(config)  # shadowgba: a server rank serves here until the trainers are done
    if job.is_server:  # shadowgba
        return

    tables = [
        EmbeddingBagConfig(name=f"t_{name}", embedding_dim=16, num_embeddings=num_embeddings, feature_names=[name])
        for name in DEFAULT_CAT_NAMES
    ]
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=len(DEFAULT_INT_NAMES),
        dense_arch_layer_sizes=[64, 16],
        over_arch_layer_sizes=[64, 1],
        dense_device=device,
    )
    train_model = DLRMTrain(dlrm)
    apply_optimizer_in_backward(RowWiseAdagrad, train_model.model.sparse_arch.parameters(), {"lr": 0.1})
    model = DistributedModelParallel(module=train_model, device=device, **job.dmp_kwargs())  # shadowgba
    optimizer = KeyedOptimizerWrapper(
        dict(model.named_parameters()), lambda params: torch.optim.Adagrad(params, lr=0.1)
    )
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    dataset = RandomRecDataset(
        keys=DEFAULT_CAT_NAMES, batch_size=batch_size, hash_size=num_embeddings, ids_per_feature=1,
        num_dense=len(DEFAULT_INT_NAMES),
    )
    batches = itertools.islice(dataset, steps)  # a finite epoch: the pipeline drains at its end
    with shadowgba.dense_sync(model, optimizer, job, local_batch_size=batch_size) as sync:  # shadowgba
        with contextlib.suppress(StopIteration):
            while True:
                pipeline.progress(batches)
    if job.trainer_index == 0:
        print(f"{config.algo}: {sync.metrics.format()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file whose `sync` section configures shadowgba")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=512)
    args, overrides = parser.parse_known_args()  # e.g. --sync.interval_ms 50
    config = shadowgba.load_config(shadowgba.SyncConfig, args.config, overrides, section="sync")
    train(config, args.steps, args.batch_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
