"""Train a TorchRec DLRM on synthetic CTR data with shadowgba (or a baseline) and report the numbers.

    torchrun --standalone --nproc_per_node=2 examples/train_dlrm.py --config examples/configs/bmuf.yaml \
        [--sync.interval_ms 20 ...] [--output results.json]

The embedding tables are sharded table-wise by `DistributedModelParallel` and trained by a fused
(in-backward) optimizer; the dense MLPs are replicated. `sync.algo` picks how the replicas meet:
ma / easgd / bmuf through `ShadowSync`, `none` for purely local training, `ddp` for TorchRec's default
dense DDP. The run reports held-out AUC and log loss next to the planted teacher's ceiling,
throughput over a timed window after warm-up, the sync metrics, and how far the dense replicas
are apart at the end. Everything is one torch thread per rank, gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from tqdm import tqdm

from shadowgba.config import BASELINES, ConfigError, SyncConfig, load_config, to_dict
from shadowgba.evaluation import all_gather_rows, log_loss, roc_auc
from shadowgba.runtime import ShadowSync
from shadowgba.synthetic import SyntheticConfig, SyntheticCTR
from shadowgba.torchrec_integration import ShadowDataParallelWrapper, dense_named_parameters

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
}
EBC_PATH = "model.sparse_arch.embedding_bag_collection"
"""Where DLRMTrain keeps the EmbeddingBagCollection: the key of the sharding plan."""


@dataclasses.dataclass
class ModelConfig:
    """DLRM shape (TorchRec's conventions: layer sizes include the output layer)."""

    embedding_dim: int = 16
    """Width of every embedding table."""
    dense_arch_layer_sizes: list[int] = dataclasses.field(default_factory=lambda: [64, 16])
    """Bottom MLP on the dense features; the last size must equal embedding_dim."""
    over_arch_layer_sizes: list[int] = dataclasses.field(default_factory=lambda: [64, 1])
    """Top MLP on the interactions; the last size must be 1 (the click logit)."""

    def __post_init__(self) -> None:
        if self.dense_arch_layer_sizes[-1:] != [self.embedding_dim]:
            raise ConfigError(f"dense_arch_layer_sizes must end with embedding_dim ({self.embedding_dim})")
        if self.over_arch_layer_sizes[-1:] != [1]:
            raise ConfigError("over_arch_layer_sizes must end with 1")


@dataclasses.dataclass
class TrainConfig:
    """Optimizers and how long to train."""

    steps: int = 4000
    """Training steps per rank, warm-up included; used when duration_s is 0."""
    duration_s: float = 0.0
    """When > 0: train for this many seconds after warm-up instead of a step count. Rank 0's clock
    decides, so all ranks stop at the same step (TorchRec's all-to-all needs that)."""
    warmup_steps: int = 50
    """Steps before the timed window that throughput is measured over."""
    stop_check_every: int = 20
    """With duration_s: steps between two broadcasts of rank 0's stop decision."""
    embedding_optimizer: Literal["sgd", "adagrad"] = "adagrad"
    """Fused in-backward optimizer of the sharded tables (Adam/LAMB are CUDA-only in FBGEMM)."""
    embedding_lr: float = 0.1
    """Learning rate of the embedding optimizer."""
    dense_optimizer: Literal["sgd", "adagrad", "adam"] = "adam"
    """Optimizer of each rank's dense replica."""
    dense_lr: float = 0.002
    """Learning rate of the dense optimizer."""
    seed: int = 0
    """Seeds model initialization (identical on every rank)."""
    progress: bool = True
    """Show a progress bar on rank 0."""

    def __post_init__(self) -> None:
        if self.duration_s < 0:
            raise ConfigError(f"duration_s must be >= 0, got {self.duration_s}")
        if self.duration_s == 0 and self.steps <= self.warmup_steps:
            raise ConfigError(f"steps ({self.steps}) must exceed warmup_steps ({self.warmup_steps})")
        if self.warmup_steps < 0 or self.stop_check_every < 1:
            raise ConfigError("warmup_steps must be >= 0 and stop_check_every >= 1")


@dataclasses.dataclass
class ExperimentConfig:
    """Everything one run reads."""

    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    """Dense synchronization (shadowgba)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """DLRM shape."""
    data: SyntheticConfig = dataclasses.field(default_factory=SyntheticConfig)
    """Synthetic CTR task and per-rank batch size."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Optimizers and run length."""


@dataclasses.dataclass
class TrainStats:
    """What the training loop measured on this rank."""

    steps: int
    """Training steps taken, warm-up included (the same on every rank)."""
    timed_steps: int
    """Steps inside the timed window (after warm-up)."""
    timed_s: float
    """Length of the timed window on this rank's clock."""


def build_model(config: ExperimentConfig, data: SyntheticCTR, device: torch.device) -> DistributedModelParallel:
    """DLRM with tables built on the meta device, sharded table-wise round-robin over the ranks."""
    tables = [
        EmbeddingBagConfig(
            name=f"table_{index}",
            embedding_dim=config.model.embedding_dim,
            num_embeddings=config.data.num_embeddings,
            feature_names=[feature],
        )
        for index, feature in enumerate(data.feature_names)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=config.data.num_dense,
        dense_arch_layer_sizes=config.model.dense_arch_layer_sizes,
        over_arch_layer_sizes=config.model.over_arch_layer_sizes,
        dense_device=device,
    )
    apply_optimizer_in_backward(
        OPTIMIZERS[config.train.embedding_optimizer], ebc.parameters(), {"lr": config.train.embedding_lr}
    )
    world_size = dist.get_world_size()
    # Explicit kernel: left out, TorchRec picks "fused" only if the in-backward optimizer above is
    # already attached, else "dense" (tables that no optimizer here would train).
    placement = {
        table.name: table_wise(rank=index % world_size, compute_kernel="fused") for index, table in enumerate(tables)
    }
    plan = ShardingPlan(
        {EBC_PATH: construct_module_sharding_plan(ebc, placement, world_size=world_size, device_type=device.type)}
    )
    wrapper = DefaultDataParallelWrapper() if config.sync.algo == "ddp" else ShadowDataParallelWrapper()
    model = DistributedModelParallel(DLRMTrain(dlrm), device=device, plan=plan, data_parallel_wrapper=wrapper)
    _check_dense_split(model, dlrm)
    return model


def _check_dense_split(model: DistributedModelParallel, dlrm: DLRM) -> None:
    """The dense parameters must be exactly the MLPs': no embedding table, no MLP weight missing."""
    dense = dict(dense_named_parameters(model))
    mlps = {id(param) for param in [*dlrm.dense_arch.parameters(), *dlrm.over_arch.parameters()]}
    if {id(param) for param in dense.values()} != mlps:
        raise RuntimeError(f"dense parameters are not exactly the DLRM's MLPs: {sorted(dense)}")


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: SyntheticCTR,
    config: TrainConfig,
    device: torch.device,
) -> TrainStats:
    """Local training steps until the step budget or the time window (after warm-up) is spent."""
    rank = dist.get_rank()
    model.train()
    batches = data.train_batches(rank)
    total = None if config.duration_s else config.steps
    bar = tqdm(total=total, unit="step", disable=rank != 0 or not config.progress)
    step, started = 0, time.perf_counter()
    while True:
        if step == config.warmup_steps:
            started = time.perf_counter()
        batch: Batch = next(batches).to(device)
        loss, _ = model(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        bar.update()
        if step % config.stop_check_every == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        if _should_stop(step, started, config, device):
            break
    elapsed = time.perf_counter() - started
    bar.close()
    return TrainStats(steps=step, timed_steps=step - config.warmup_steps, timed_s=elapsed)


def _should_stop(step: int, started: float, config: TrainConfig, device: torch.device) -> bool:
    if not config.duration_s:
        return step >= config.steps
    timed_steps = step - config.warmup_steps
    if timed_steps <= 0 or timed_steps % config.stop_check_every:
        return False
    stop = torch.tensor([time.perf_counter() - started >= config.duration_s], device=device)
    dist.broadcast(stop, src=0)
    return bool(stop.item())


@torch.no_grad()
def evaluate(model: nn.Module, data: SyntheticCTR, device: torch.device) -> dict[str, float]:
    """Held-out AUC and log loss over the whole set; each rank scores its share with its replica."""
    model.eval()
    logits, labels = [], []
    for batch in data.heldout_batches(dist.get_rank(), dist.get_world_size()):
        _, (_, batch_logits, batch_labels) = model(batch.to(device))
        logits.append(batch_logits)
        labels.append(batch_labels)
    all_logits, all_labels = all_gather_rows(torch.cat(logits)), all_gather_rows(torch.cat(labels))
    return {"auc": roc_auc(all_logits, all_labels), "log_loss": log_loss(all_logits, all_labels)}


def dense_replica_spread(params: Sequence[torch.Tensor]) -> float:
    """Max over ranks and elements of |w - mean over ranks of w|: 0 when replicas are identical."""
    flat = torch.cat([param.detach().flatten() for param in params])
    mean = flat.clone()
    dist.all_reduce(mean)
    spread = (flat - mean / dist.get_world_size()).abs().max()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return spread.item()


def sum_over_ranks(value: float, device: torch.device) -> float:
    """Sum of a per-rank number over all ranks."""
    total = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.item()


def run(config: ExperimentConfig, device: torch.device) -> dict[str, Any]:
    """Build, train, close the sync, evaluate; returns every number of the run."""
    wall_start = time.perf_counter()
    torch.manual_seed(config.train.seed)
    data = SyntheticCTR(config.data)
    model = build_model(config, data, device)
    dense_params = [param for _, param in dense_named_parameters(model)]
    optimizer = OPTIMIZERS[config.train.dense_optimizer](dense_params, lr=config.train.dense_lr)
    sync = None if config.sync.algo in BASELINES else ShadowSync(model, optimizer, config.sync)
    with sync or contextlib.nullcontext():
        stats = train(model, optimizer, data, config.train, device)
    samples_per_s = stats.timed_steps * config.data.batch_size / stats.timed_s
    total_samples_per_s = sum_over_ranks(samples_per_s, device)
    spread = dense_replica_spread(dense_params)
    quality = evaluate(model, data, device)
    teacher_logits, teacher_labels = data.teacher_heldout()
    return {
        "world_size": dist.get_world_size(),
        "steps": stats.steps,
        "timed_steps": stats.timed_steps,
        "timed_s": stats.timed_s,
        "samples_per_s_per_rank": total_samples_per_s / dist.get_world_size(),
        "samples_per_s_total": total_samples_per_s,
        **quality,
        "teacher_auc": roc_auc(teacher_logits, teacher_labels),
        "teacher_log_loss": log_loss(teacher_logits, teacher_labels),
        "dense_params": sum(param.numel() for param in dense_params),
        "dense_replica_max_abs_diff": spread,
        "sync": sync.metrics.summary() if sync else {},
        "wall_s": time.perf_counter() - wall_start,
        "config": to_dict(config),
    }


def _device() -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device, "nccl"
    return torch.device("cpu"), "gloo"


def _report(results: dict[str, Any]) -> None:
    for key, value in results.items():
        if key == "config":
            continue
        if isinstance(value, dict):
            for name, number in value.items():
                print(f"{key}.{name}: {number:.6g}")
        else:
            print(f"{key}: {value:.6g}" if isinstance(value, float) else f"{key}: {value}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="YAML file; keys mirror ExperimentConfig")
    parser.add_argument("--output", type=Path, help="write all numbers and the config as JSON (rank 0)")
    args, overrides = parser.parse_known_args(argv)
    try:
        config = load_config(ExperimentConfig, args.config, overrides)
    except ConfigError as error:
        raise SystemExit(f"config error: {error}") from None
    torch.set_num_threads(1)
    device, backend = _device()
    dist.init_process_group(backend)
    try:
        results = run(config, device)
        if dist.get_rank() == 0:
            _report(results)
            if args.output:
                args.output.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
