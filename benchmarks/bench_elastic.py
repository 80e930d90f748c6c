"""A trainer lost and restarted mid-run, against the same job uninterrupted: GBA with PS-hosted tables.

    python benchmarks/bench_elastic.py [--reps 5] [--global-steps 2600] [--kill-at 0.3] [--restart-after-s 20]
    make bench-elastic

Not part of `make test`. Each repetition runs the same job twice, in alternating order: 4 trainers and
1 server of the elastic layout (`sync.ps.num_trainers`), each its own process meeting at the
server's store, a DLRM on the synthetic CTR task with its tables on the server, GBA until the
server's global step reaches `--global-steps` (so both runs see the same samples). In the
*interrupted* run trainer 1 is SIGKILLed once the global step passes `--kill-at` of that, and a new
process of it is started `--restart-after-s` later; it resumes its data position from its own
checkpoint (the index of its next batch, saved after every step) and pulls the current parameters.
No other process restarts.

Per run: samples/s of every trainer together before the kill, of the survivors during the outage
(kill to restart) and their ratio (ideal 3/4: three trainers of four); how long the restarted
process took from its start to its first step; held-out AUC and log loss of trainer 0's model at
the last global step (equal samples seen in both runs); the server's departures; CPU seconds per
sample of every process together (getrusage of the reaped children, which steal does not inflate).
The uninterrupted run's figures are read in the same global-step windows. Trainers add
`--compute-ms` of simulated compute to each step so that 4 trainers and a server on 2 cores
measure the protocol, not the scheduler.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import shadowgba  # noqa: E402 (the checkout's package, as the tests import it)
from ctrkit.evaluation import log_loss, roc_auc  # noqa: E402
from ctrkit.events import Events  # noqa: E402
from ctrkit.synthetic import SyntheticConfig, SyntheticCTR  # noqa: E402
from shadowgba.config import SyncConfig  # noqa: E402
from shadowgba.gba.config import GBAConfig  # noqa: E402
from shadowgba.job.config import PSConfig  # noqa: E402
from shadowgba.job.rendezvous import ELASTIC_RANK  # noqa: E402

TRAINERS = 4
KILLED = 1
"""The trainer index that is killed and restarted."""
BATCH = 256
# 256 held-out batches (65K samples): comparing two runs' AUC to 0.002 needs the evaluation's own noise below it
DATA = SyntheticConfig(num_tables=8, num_embeddings=2000, batch_size=BATCH, eval_batches=256,
                       calibration_samples=16384)
DENSE_ARCH = [64, 32, 16]
OVER_ARCH = [64, 32, 1]
WARMUP_S = 5.0
"""The first seconds after the first step, left out of the rates (processes still starting)."""
EMBEDDING_LR = 0.1
"""The tables' row-wise Adagrad (on the server)."""
TIMEOUT_S = 10.0
"""`sync.timeout_s` and the calls' timeout: a killed trainer is seen at once (its connection closes)."""


@dataclasses.dataclass(frozen=True)
class Kill:
    """One trainer process SIGKILLed mid-run, and a new process of it started later."""

    trainer: int
    at: float
    """When: once a step reports a global step of at least this fraction of the run's and the
    trainer's current process has trained (a kill of a trainer still down or starting waits for its
    new process's first step, so every killed process had joined the job)."""
    restart_after_s: float
    """Seconds from the kill to the new process's start."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One job of the benchmark (or of the soak, `benchmarks/soak.py`)."""

    global_steps: int
    kills: tuple[Kill, ...]
    """In the order they fire; none: the uninterrupted run."""
    compute_ms: float
    lr: float
    port: int
    workdir: str
    deadline_s: float = 1800.0
    """A job not finished by then is killed, and `run_job` raises."""


def config() -> SyncConfig:
    return SyncConfig(algo="gba", timeout_s=TIMEOUT_S, ps=PSConfig(
        num_servers=1, num_trainers=TRAINERS, rpc_timeout_s=TIMEOUT_S, on_trainer_lost="continue"),
        gba=GBAConfig(initial_mode="gba"))


def tables(data: SyntheticCTR) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"table_{index}", embedding_dim=DENSE_ARCH[-1], num_embeddings=size,
                               feature_names=[feature])
            for index, (feature, size) in enumerate(zip(data.feature_names, data.num_embeddings_per_feature))]


def process(rank: int, run: Run, send: Callable[[tuple], None]) -> None:
    """One process of the job (`rank`: its SHADOWGBA_RANK; the server is rank TRAINERS)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(run.port), **{ELASTIC_RANK: str(rank)})
    data = SyntheticCTR(DATA)
    options = shadowgba.ps_table_options(config(), TRAINERS, BATCH, optimizer="rowwise_adagrad", lr=EMBEDDING_LR)
    job = shadowgba.join(config(), tables=tables(data), table_options=options)
    if job.is_server:
        send(("server", [dataclasses.astuple(left) for left in job.transport.roster.departures],
              job.served["dense"].stats()["global_step"]))
        return
    trainer, incarnation = job.trainer_index, job.transport.incarnation
    torch.manual_seed(0)
    embeddings = job.ps_embeddings()
    model = DLRMTrain(DLRM(embedding_bag_collection=embeddings, dense_in_features=data.num_dense,
                           dense_arch_layer_sizes=DENSE_ARCH, over_arch_layer_sizes=OVER_ARCH))
    optimizer = torch.optim.Adam(model.parameters(), lr=run.lr)  # the tables have no parameters here
    position = Path(run.workdir) / f"trainer_{trainer}.position"
    start = int(position.read_text()) if position.exists() else 0  # its own checkpoint: the next batch
    with shadowgba.dense_sync(model, optimizer, job, local_batch_size=BATCH) as sync:
        index = start
        while sync.global_step < run.global_steps:
            loss, _ = model(data.train_batch(trainer, index))
            loss.backward()
            embeddings.push_gradients()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(run.compute_ms / 1000)
            index += 1
            position.with_suffix(".tmp").write_text(str(index))
            position.with_suffix(".tmp").replace(position)
            send(("step", trainer, incarnation, index, sync.global_step, time.time()))
        embeddings.flush()
        if trainer == 0:  # the model at the last global step: every trainer's pushes counted, as in the other run
            sync.wait_for_global_step(run.global_steps, timeout_s=60.0)
            send(("quality", *evaluate(model, data)))


def evaluate(model: DLRMTrain, data: SyntheticCTR) -> tuple[float, float]:
    """Held-out AUC and log loss of `model` (the tables looked up on the server)."""
    logits, labels = [], []
    with torch.no_grad():
        for batch in data.heldout_batches(0, 1):
            _, (_, batch_logits, batch_labels) = model(batch)
            logits.append(batch_logits.flatten())
            labels.append(batch_labels.flatten())
    logits, labels = torch.cat(logits), torch.cat(labels)
    return roc_auc(logits, labels), log_loss(logits, labels)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_job(run: Run) -> dict[str, Any]:
    """Run one job to its last global step; its timeline (every step, and each kill's `killed_at`,
    `restarted_at` and the new process's `incarnation`) and figures."""
    context = multiprocessing.get_context("spawn")
    events = Events(context)
    cpu_before = children_cpu_s()

    def start(rank: int) -> Any:
        return events.start(process, (rank, run))

    server = start(TRAINERS)
    trainers = {index: start(index) for index in range(TRAINERS)}
    incarnations = dict.fromkeys(trainers, 1)
    trained: set[int] = set()
    """Trainers whose current process has reported a step."""
    steps: list[tuple[int, int, int, int, float]] = []
    server_report = quality = None
    pending, down, kills = list(run.kills), {}, []
    deadline = time.monotonic() + run.deadline_s
    try:
        while (server_report is None or quality is None) and time.monotonic() < deadline:
            event = events.receive(timeout_s=0.5)
            if event is not None and event[0] == "step":
                steps.append(event[1:])
                if event[2] == incarnations[event[1]]:
                    trained.add(event[1])
            elif event is not None and event[0] == "server":
                server_report = event[1:]
            elif event is not None and event[0] == "quality":
                quality = event[1:]
            for kill in [kill for kill in pending if kill.trainer in trained and steps
                         and steps[-1][3] >= kill.at * run.global_steps][:1]:
                pending.remove(kill)
                trained.discard(kill.trainer)
                os.kill(trainers[kill.trainer].pid, signal.SIGKILL)
                down[kill.trainer] = {"trainer": kill.trainer, "killed_at": time.time(),
                                      "restart_after_s": kill.restart_after_s}
            for trainer, record in list(down.items()):
                if time.time() >= record["killed_at"] + record["restart_after_s"]:
                    trainers[trainer].join(10)
                    trainers[trainer] = start(trainer)
                    incarnations[trainer] += 1
                    kills.append({**down.pop(trainer), "restarted_at": time.time(),
                                  "incarnation": incarnations[trainer]})
    finally:
        for child in [server, *trainers.values()]:
            child.join(30)
            if child.is_alive():
                child.kill()
                child.join()
    if server_report is None or quality is None:
        raise RuntimeError(f"the job did not finish within {run.deadline_s:g} s: last steps {steps[-3:]}, "
                           f"kills {kills}, still down {list(down.values())}, not fired {pending}")
    return {"steps": steps, "kills": kills, "departures": server_report[0],
            "global_step": server_report[1], "auc": quality[0], "log_loss": quality[1],
            "cpu_s": children_cpu_s() - cpu_before, "exit_codes": [child.exitcode for child in [server, *trainers.values()]]}


def rejoin_seconds(steps: Sequence[tuple[int, int, int, int, float]], kill: dict[str, Any]) -> float | None:
    """Seconds from a kill's restart to the new process's first step (None: it never trained)."""
    first = [step[4] for step in steps if step[:2] == (kill["trainer"], kill["incarnation"])]
    return first[0] - kill["restarted_at"] if first else None


def window_rate(steps: Sequence[tuple[int, int, int, int, float]], start: float, end: float,
                trainers: set[int]) -> float:
    """Samples per second that `trainers` trained within [start, end)."""
    count = sum(1 for step in steps if step[0] in trainers and start <= step[4] < end)
    return count * BATCH / max(end - start, 1e-9)


def first_time_at(steps: Sequence[tuple[int, int, int, int, float]], global_step: float) -> float:
    """When the first step reported a global step >= `global_step`."""
    return min(step[4] for step in steps if step[3] >= global_step)


def figures(result: dict[str, Any], kill_time: float | None, outage_s: float, kill_at_step: float) -> dict[str, Any]:
    """The run's figures; the uninterrupted run is read at the global step where the other was killed."""
    steps = result["steps"]
    begin = min(step[4] for step in steps)
    warm = begin + WARMUP_S
    kill = kill_time if kill_time is not None else first_time_at(steps, kill_at_step)
    everyone, survivors = set(range(TRAINERS)), set(range(TRAINERS)) - {KILLED}
    before = window_rate(steps, warm, kill, everyone)
    during = window_rate(steps, kill, kill + outage_s, survivors)
    samples = len(steps) * BATCH
    return {
        "samples_per_s_before": before, "survivors_samples_per_s_outage": during,
        "outage_ratio": during / before if before else float("nan"),
        "rejoin_s": rejoin_seconds(steps, result["kills"][0]) if result["kills"] else None,
        "auc": result["auc"], "log_loss": result["log_loss"], "global_step": result["global_step"],
        "samples": samples, "cpu_s_per_1k_samples": 1000 * result["cpu_s"] / samples,
        "wall_s": max(step[4] for step in steps) - begin, "departures": result["departures"],
        "exit_codes": result["exit_codes"],
    }


def spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.4g} ({min(values):.4g}-{max(values):.4g})"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--global-steps", type=int, default=2600)
    parser.add_argument("--kill-at", type=float, default=0.3)
    parser.add_argument("--restart-after-s", type=float, default=20.0)
    parser.add_argument("--compute-ms", type=float, default=40.0)
    parser.add_argument("--lr", type=float, default=0.002, help="the dense Adam's")
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("--output", default=str(ROOT / "runs/bench_elastic.json"))
    args = parser.parse_args(argv)
    rows: dict[str, list[dict[str, Any]]] = {"uninterrupted": [], "interrupted": []}
    for rep in range(args.reps):
        order = [False, True] if rep % 2 == 0 else [True, False]
        for interrupted in order:
            with tempfile.TemporaryDirectory() as workdir:
                kills = (Kill(KILLED, args.kill_at, args.restart_after_s),) if interrupted else ()
                run = Run(args.global_steps, kills, args.compute_ms, args.lr, args.port + rep * 2 + int(interrupted),
                          workdir)
                result = run_job(run)
            name = "interrupted" if interrupted else "uninterrupted"
            killed_at = result["kills"][0]["killed_at"] if result["kills"] else None
            row = figures(result, killed_at, args.restart_after_s, args.kill_at * args.global_steps)
            rows[name].append(row)
            print(f"rep {rep} {name}: " + ", ".join(f"{key}={value:.4g}" if isinstance(value, float) else
                                                    f"{key}={value}" for key, value in row.items()), flush=True)
    print("\n| run | samples/s before | survivors' samples/s in the outage | ratio | rejoin s | AUC | log loss | "
          "CPU s / 1k samples | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in rows.items():
        rejoin = [row["rejoin_s"] for row in runs if row["rejoin_s"] is not None]
        print(f"| {name} | {spread([r['samples_per_s_before'] for r in runs])} | "
              f"{spread([r['survivors_samples_per_s_outage'] for r in runs])} | {spread([r['outage_ratio'] for r in runs])} | "
              f"{spread(rejoin) if rejoin else '-'} | {spread([r['auc'] for r in runs])} | "
              f"{spread([r['log_loss'] for r in runs])} | {spread([r['cpu_s_per_1k_samples'] for r in runs])} | "
              f"{spread([r['wall_s'] for r in runs])} |")
    deltas = [a["auc"] - b["auc"] for a, b in zip(rows["interrupted"], rows["uninterrupted"])]
    print(f"\nAUC interrupted - uninterrupted, per repetition: {', '.join(f'{d:+.4f}' for d in deltas)} "
          f"(median {statistics.median(deltas):+.4f})")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
