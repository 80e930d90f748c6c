"""A plain PyTorch model and training loop, the dense replicas kept in sync by shadowgba.

    torchrun --standalone --nproc_per_node=2 examples/plain_loop.py --config examples/configs/easgd.yaml
    torchrun --standalone --nproc_per_node=3 examples/plain_loop.py --config examples/configs/sync_allreduce.yaml

No TorchRec needed: every parameter of the model is dense. Each trainer fits the same linear
teacher on its own random batches; the `with` block is the same whatever `sync.algo` the config
names (with parameter servers, `sync.ps.num_servers` of the ranks serve instead of training).
"""

from __future__ import annotations

import argparse

import torch
from torch import distributed as dist, nn

import shadowgba

TEACHER = torch.linspace(-1.0, 1.0, 16).unsqueeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file whose `sync` section configures shadowgba")
    parser.add_argument("--steps", type=int, default=500)
    args, overrides = parser.parse_known_args()
    config = shadowgba.load_config(shadowgba.SyncConfig, args.config, overrides, section="sync")

    shadowgba.init_process_group("gloo")  # torch's, with gloo on the interface that reaches MASTER_ADDR
    job = shadowgba.join(config)  # a server rank serves here until the trainers are done
    if job.is_server:
        return
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(job.trainer_index)
    with shadowgba.dense_sync(model, optimizer, job, local_batch_size=64) as sync:
        for _ in range(args.steps):
            features = torch.randn(64, 16, generator=generator)
            loss = nn.functional.mse_loss(model(features), features @ TEACHER)
            loss.backward()
            optimizer.step()  # the step boundary: shadowgba's per-step work runs here
            optimizer.zero_grad()
    if job.trainer_index == 0:
        print(f"{config.algo}: final loss {loss.item():.4f}; {sync.metrics.format()}", flush=True)


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
