"""A torchrun job the network-fault tests start across simulated hosts (tests/test_hosts.py).

    torchrun ... tests/cluster_job.py --config examples/configs/ma.yaml --seconds 20 --out DIR [--sync.x y]

Every trainer trains a dense MLP (`--width`: about width^2 parameters) on random batches for
`--seconds` of wall time inside `shadowgba.dense_sync`, and appends what it has done to
`DIR/rank<r>.jsonl` every `REPORT_EVERY_S` (wall time, steps, sync rounds), so that a test can see
whether a rank trained and whether its rounds went on while a link was down. At the end each rank
writes `DIR/rank<r>.json`: its steps and rounds, a checksum of its dense weights, and the error
that ended it (type and message), if one did; then it exits 1 if there was one.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import torch
from torch import distributed as dist, nn

import shadowgba

REPORT_EVERY_S = 0.2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, default=256)
    args, overrides = parser.parse_known_args()
    config = shadowgba.load_config(shadowgba.SyncConfig, args.config, overrides, section="sync")
    torch.set_num_threads(1)
    shadowgba.init_process_group("gloo")
    rank = dist.get_rank()
    record: dict = {"rank": rank, "steps": 0, "rounds": 0, "error": None}
    progress = open(args.out / f"rank{rank}.jsonl", "a")
    try:
        job = shadowgba.join(config)
        record["server"] = job.is_server
        if not job.is_server:
            train(job, args, record, progress)
    except Exception as error:
        record["error"] = {"type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
    record["ended_at"] = time.time()
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    os._exit(1 if record["error"] else 0)  # no interpreter finalization: a peer that is gone cannot hold it


def train(job: shadowgba.Job, args: argparse.Namespace, record: dict, progress) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width),
                          nn.ReLU(), nn.Linear(args.width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(job.trainer_index)
    started = last_report = time.time()
    with shadowgba.dense_sync(model, optimizer, job, local_batch_size=32) as sync:
        while time.time() - started < args.seconds:
            features = torch.randn(32, args.width, generator=generator)
            loss = nn.functional.mse_loss(model(features), features[:, :1])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            record["steps"] += 1
            if time.time() - last_report >= REPORT_EVERY_S:
                last_report = time.time()
                record["rounds"] = sync.metrics.rounds
                progress.write(json.dumps({"t": last_report, "steps": record["steps"], "rounds": record["rounds"]}) + "\n")
                progress.flush()
    record["rounds"] = sync.metrics.rounds
    record["checksum"] = float(sum(param.detach().double().sum() for param in model.parameters()))


if __name__ == "__main__":
    main()
