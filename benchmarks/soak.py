"""Soak: torchrun jobs of randomly chosen configurations, faults injected, restarted and resumed, for M minutes.

    python benchmarks/soak.py --minutes 6 [--seed 0] [--job-timeout-s 180] [--elastic-share 0.1] [--output runs/soak.json]
    make soak [SOAK_MINUTES=6]

Not part of `make test`. Each job is one `torchrun --standalone --max-restarts=1` run of
`benchmarks/train_dlrm.py`, one after the other (the development machines have 2 cores), drawn at random:
- the configuration: ma / easgd / bmuf in shadow or foreground mode (2 trainers), easgd_ps, gba with
  TorchRec-sharded tables, gba with PS-hosted tables (2 trainers + 1 server), sync all-reduce;
- pacing `--sync.interval_ms`; for gba either the switch policy (short window, trainer 1 slowed
  3x, so that it has something to switch on) or a plain `--sync.gba.initial_mode` choice;
- the step count and `--checkpoint-every`, always with `--resume`;
- in about half the jobs a fault on a random trainer and step (`dlrm.faults`, armed through
  `SHADOWGBA_TEST_FAULTS`): the trainer SIGKILLs itself (`kill`), its loop raises (`fail`), its
  process is stopped for good (`stop`: SIGSTOP, never continued; such a job runs under
  `sync.timeout_s` STOP_TIMEOUT_S, so that the survivors give up on it within it, naming it, and
  torchrun's agent kills the stopped worker when it tears the attempt down), or its dense weights
  turn NaN (`nan`). torchrun answers a kill, failure or stop by restarting the job, which resumes
  from its checkpoint. A NaN trainer is caught by its own guard (`shadowgba.nonfinite`) before
  anything of it reaches a peer: where a shared optimizer owns the dense weights (gba, sync
  all-reduce: `REPAIRED`) its steps are skipped until it takes them back and the job finishes
  without a restart, with a finite held-out loss; elsewhere nothing repairs its replica, so the
  job runs with `--sync.max_skipped_steps 1`: it ends at the next step (before a checkpoint could
  keep the NaN) and the restart resumes as after a failure.
- or, in a share of the draws (`--elastic-share`, default one in ten), an *elastic* job (`gba_elastic`: `benchmarks/bench_elastic.py`'s job,
  shorter): 4 trainers and 1 server of the elastic layout, each a process of its own, GBA with
  PS-hosted tables; 1-3 trainers, drawn at random (the same one may be drawn again: its new process
  is then killed once it has trained), are SIGKILLed at random points of the run and a new process
  of each is started 1-6 s later (before or after the server has declared the old one departed,
  `RECONNECT_GRACE_S`), and the job is never restarted.
  Such a job is an error unless every kill fired, the server recorded exactly the killed processes
  as departed, every new process trained within `REJOIN_WITHIN_S` of its start, the job reached its
  global step, and every process still running at the end exited 0.
A job that runs past `--job-timeout-s` is a hang: torchrun and every worker are killed. A job that exits
non-zero is an error; so is a finished job whose results contradict its schedule (no restart after
a fault that fired, a fault that did not fire, a resume from another step than the last checkpoint
before the fault, or a step count other than the one asked for).

"Samples lost" counts the work a restarted job had done past its last checkpoint and did again:
(fault step - resumed_from_step) x batch size x trainers; with a checkpoint at the fault step it is 0.
An elastic job redoes nothing (a killed trainer loses at most its in-flight batches, which GBA's
global batch does not wait for), so it adds 0; its kills and rejoins are counted instead.
The report (a table, and every job's record in the JSON file) sums over the jobs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_elastic import TRAINERS as ELASTIC_TRAINERS  # benchmarks/ is this script's folder: its modules
from bench_elastic import Kill, Run  # import as scripts do
from bench_elastic import rejoin_seconds
from bench_elastic import run_job as run_elastic
from dlrm.faults import FAULTS_ENV, KILL_ENV
from dlrm.host import free_port

ROOT = Path(__file__).resolve().parent.parent
BATCH = 32
SMALL = [  # the tests' small model and data: a job takes seconds
    "--train.warmup_steps", "0", "--train.progress", "false",
    "--data.synthetic.num_tables", "3", "--data.synthetic.num_embeddings", "100",
    "--data.synthetic.batch_size", str(BATCH), "--data.synthetic.eval_batches", "2",
    "--data.synthetic.calibration_samples", "2048",
]
STOP_TIMEOUT_S = 15
"""`sync.timeout_s` of a job with a `stop` fault (its RPC timeout: STOP_RPC_TIMEOUT_S, below it): the
survivors must notice the stopped trainer well within the job's time limit."""
STOP_RPC_TIMEOUT_S = 5
CONFIGS: dict[str, tuple[str, int, list[str]]] = {  # name: (config file, ranks, extra arguments)
    **{f"{algo}_{mode}": (f"{algo}.yaml", 2, ["--sync.mode", mode])
       for algo in ("ma", "easgd", "bmuf") for mode in ("shadow", "foreground")},
    "easgd_ps": ("easgd_ps.yaml", 3, []),
    "gba_torchrec": ("gba.yaml", 3, []),
    "gba_ps_tables": ("gba_ps_embeddings.yaml", 3, []),
    "sync_allreduce": ("sync_allreduce.yaml", 2, []),
}


ELASTIC = "gba_elastic"
"""The elastic job's name in the draws and the report (module docstring)."""
ELASTIC_GLOBAL_STEPS = 1200
"""The elastic job's length in global steps (about 45 s here): long enough that each new process
trains before the end, even a second kill of one trainer, which waits for its first new process
to train (kills at no later than 40% of the run, restarts at most 6 s after)."""
NO_COUNTS = {"rounds": 0, "mode_switches": 0, "checkpoints": 0, "restarts": 0, "samples_lost": 0,
             "trainer_kills": 0, "rejoins": 0}
"""A job's counts in the report before its results are read (each job kind fills its own)."""
REJOIN_WITHIN_S = 30.0
"""A new trainer process must report its first step within this of its start."""


REPAIRED = frozenset({"gba_torchrec", "gba_ps_tables", "sync_allreduce"})
"""Configurations whose dense weights a shared optimizer owns (GBA's shards, or the sync
all-reduce's flat optimizer on every trainer): a trainer whose weights turn NaN takes them back."""


def draw_job(rng: random.Random, index: int, elastic_share: float) -> dict[str, Any]:
    """One job's configuration, pacing, schedule and fault; elastic with probability `elastic_share`."""
    if rng.random() < elastic_share:
        return draw_elastic_job(rng, index)
    name = rng.choice(sorted(CONFIGS))
    config, ranks, extra = CONFIGS[name]
    trainers = ranks - (1 if ranks == 3 else 0)
    steps = rng.randrange(40, 101, 10)
    every = rng.choice([5, 10, 15, 20])
    args = ["--config", f"examples/configs/{config}", *extra, *SMALL, "--train.steps", str(steps),
            "--train.seed", str(index), "--sync.interval_ms", str(rng.choice([0, 5, 20, 50, 200]))]
    gba = None
    if name.startswith("gba"):
        if rng.random() < 0.5:
            gba = f"switch_policy from {(initial := rng.choice(['sync', 'gba']))}"
            args += ["--sync.gba.initial_mode", initial, "--sync.gba.switch_policy.enabled", "true",
                     "--sync.gba.switch_policy.window", "5", "--straggler.trainers", "[1]",
                     "--straggler.factor", "3"]
        else:
            gba = f"initial_mode {(initial := rng.choice(['sync', 'gba']))}"
            args += ["--sync.gba.initial_mode", initial]
    kinds = ["kill", "fail", "stop", "nan"]
    fault = (rng.choice(kinds), rng.randrange(trainers), rng.randrange(3, steps - 2)) if rng.random() < 0.5 else None
    if fault and fault[0] == "stop":
        args += ["--sync.timeout_s", str(STOP_TIMEOUT_S), "--sync.ps.rpc_timeout_s", str(STOP_RPC_TIMEOUT_S)]
    if fault and fault[0] == "nan" and name not in REPAIRED:
        args += ["--sync.max_skipped_steps", "1"]
    return {"index": index, "name": name, "ranks": ranks, "trainers": trainers, "steps": steps,
            "checkpoint_every": every, "gba": gba, "fault": fault, "args": args}


def draw_elastic_job(rng: random.Random, index: int) -> dict[str, Any]:
    """An elastic job: its kills, in firing order."""
    points = sorted(rng.uniform(0.1, 0.4) for _ in range(rng.randint(1, 3)))
    kills = [(rng.randrange(ELASTIC_TRAINERS), round(at, 3), round(rng.uniform(1.0, 6.0), 1)) for at in points]
    return {"index": index, "name": ELASTIC, "ranks": ELASTIC_TRAINERS + 1, "trainers": ELASTIC_TRAINERS,
            "steps": ELASTIC_GLOBAL_STEPS, "checkpoint_every": 0, "gba": None, "fault": None, "kills": kills}


def run_elastic_job(job: dict[str, Any], workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Run one elastic job (`bench_elastic.run_job`), its kills and rejoins; checked as the module says."""
    here = workdir / f"job_{job['index']:04d}"
    here.mkdir()
    run = Run(job["steps"], tuple(Kill(*kill) for kill in job["kills"]), compute_ms=20.0, lr=0.002,
              port=free_port(), workdir=str(here), deadline_s=timeout_s)
    started = time.monotonic()
    outcome = {**job, **NO_COUNTS, "log": str(here / "log.txt")}
    try:
        result = run_elastic(run)
    except RuntimeError as error:  # it did not finish within the deadline
        (here / "log.txt").write_text(str(error))
        return {**outcome, "wall_s": round(time.monotonic() - started, 1), "status": "hang"}
    steps, kills = result["steps"], result["kills"]
    rejoin_s = [None if (seconds := rejoin_seconds(steps, kill)) is None else round(seconds, 2) for kill in kills]
    killed = sorted((kill["trainer"], kill["incarnation"] - 1) for kill in kills)
    departed = sorted((trainer, incarnation) for trainer, incarnation, *_ in result["departures"])
    outcome.update(wall_s=round(time.monotonic() - started, 1), trainer_kills=len(kills),
                   rejoins=sum(seconds is not None for seconds in rejoin_s), rejoin_s=rejoin_s,
                   departures=result["departures"], global_step=result["global_step"], auc=result["auc"])
    problems = []
    if len(kills) != len(job["kills"]):
        problems.append(f"{len(kills)} of {len(job['kills'])} kills fired and restarted")
    if departed != killed:
        problems.append(f"departures {departed}, killed {killed}")
    if any(seconds is None or seconds > REJOIN_WITHIN_S for seconds in rejoin_s):
        problems.append(f"seconds from each restart to its first step: {rejoin_s} (limit {REJOIN_WITHIN_S:g})")
    if result["global_step"] < job["steps"] or not math.isfinite(result["auc"]):
        problems.append(f"global step {result['global_step']} of {job['steps']}, AUC {result['auc']}")
    if any(code != 0 for code in result["exit_codes"]):
        problems.append(f"exit codes (server, trainers) {result['exit_codes']}")
    (here / "log.txt").write_text(json.dumps({**result, "steps": len(steps)}, indent=1))
    if problems:
        return {**outcome, "status": "error", "why": "; ".join(problems)}
    return {**outcome, "status": "ok"}


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children before their parent's siblings."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_job(job: dict[str, Any], workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Run one job under torchrun; its outcome (status ok / error / hang) and the numbers of the report."""
    here = workdir / f"job_{job['index']:04d}"
    here.mkdir()
    output, fault_log = here / "results.json", here / "faults.jsonl"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={job['ranks']}",
        "--max-restarts=1", "--monitor-interval=0.5", "benchmarks/train_dlrm.py", *job["args"],
        "--checkpoint-dir", str(here / "ckpt"), "--checkpoint-every", str(job["checkpoint_every"]), "--resume",
        "--output", str(output),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHADOWGBA_TEST_FAULT_LOG": str(fault_log)}
    for armed in (KILL_ENV, FAULTS_ENV):
        env.pop(armed, None)
    if job["fault"]:
        env[FAULTS_ENV] = "{}:{}:{}".format(*job["fault"])
    started = time.monotonic()
    with open(here / "log.txt", "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # torchrun's workers run in sessions of their own: kill each
            for pid in [*_descendants(process.pid), process.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.wait()
            returncode = None
    outcome = {**{k: v for k, v in job.items() if k != "args"}, "wall_s": round(time.monotonic() - started, 1),
               "returncode": returncode, "log": str(here / "log.txt"),
               **NO_COUNTS}
    if returncode is None:
        return {**outcome, "status": "hang"}
    if returncode != 0 or not output.exists():
        return {**outcome, "status": "error", "why": f"exit status {returncode}"}
    results = json.loads(output.read_text())
    fired = [json.loads(line) for line in fault_log.read_text().splitlines()] if fault_log.exists() else []
    checkpoint = results["checkpoint"] or {}
    resumed_from = checkpoint.get("resumed_from_step")
    restarts = results["restart_count"]
    every = job["checkpoint_every"]
    outcome.update(
        rounds=(results["sync"] or {}).get("rounds", 0),
        mode_switches=(results["gba"] or {}).get("mode_switches", 0),
        # this attempt's saves, and those of the first attempt up to the fault (saved before it fires)
        checkpoints=checkpoint.get("saves", 0) + (fired[0]["step"] // every if fired else 0),
        restarts=restarts, resumed_from=resumed_from, steps_done=results["steps"],
        steps_this_run=results["steps_this_run"],
    )
    problems = []
    if results["steps"] != job["steps"]:
        problems.append(f"trained {results['steps']} steps, not {job['steps']}")
    if job["fault"]:
        kind, trainer, step = job["fault"]
        if [(f["kind"], f["trainer"], f["step"], f["restart_count"]) for f in fired] != [(kind, trainer, step, 0)]:
            problems.append(f"fault {kind}:{trainer}:{step} armed, fired: {fired}")
        if kind == "nan" and not math.isfinite(results["log_loss"]):
            problems.append(f"held-out log loss {results['log_loss']} after a NaN trainer")
    if job["fault"] and job["fault"][0] == "nan" and job["name"] in REPAIRED:
        if restarts:
            problems.append(f"restart_count {restarts} after a NaN trainer that its shared optimizer repairs")
    elif job["fault"]:
        expected = step // every * every
        if restarts != 1 or (resumed_from or 0) != expected:
            problems.append(f"after the fault at step {step}: restart_count {restarts}, resumed from "
                            f"{resumed_from}, expected 1 and the checkpoint of step {expected}")
        if results["steps"] - results["steps_this_run"] != (resumed_from or 0):
            problems.append(f"{results['steps_this_run']} steps this run after resuming from {resumed_from}")
        outcome["samples_lost"] = (step - (resumed_from or 0)) * BATCH * job["trainers"]
    elif restarts or fired:
        problems.append(f"restart_count {restarts} and faults {fired} without an injected fault")
    if problems:
        return {**outcome, "status": "error", "why": "; ".join(problems)}
    return {**outcome, "status": "ok"}


def report(outcomes: list[dict[str, Any]], minutes: float) -> dict[str, Any]:
    total = lambda key: sum(outcome[key] for outcome in outcomes)  # noqa: E731
    return {
        "minutes": round(minutes, 1), "jobs": len(outcomes), "rounds": total("rounds"),
        "mode_switches": total("mode_switches"), "checkpoints": total("checkpoints"),
        "restarts": total("restarts"), "errors": sum(o["status"] == "error" for o in outcomes),
        "hangs": sum(o["status"] == "hang" for o in outcomes), "samples_lost": total("samples_lost"),
        "trainer_kills": total("trainer_kills"), "rejoins": total("rejoins"),
    }


def table(summary: dict[str, Any], outcomes: list[dict[str, Any]]) -> str:
    keys = list(summary)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---:|" * len(keys),
             "| " + " | ".join(f"{summary[key]:,}" if isinstance(summary[key], int) else str(summary[key])
                              for key in keys) + " |", ""]
    by_config: dict[str, list[dict[str, Any]]] = {}
    for outcome in outcomes:
        by_config.setdefault(outcome["name"], []).append(outcome)
    lines += ["| configuration | jobs | faults (elastic: kills) | job restarts | rejoins | errors | hangs | wall s mean |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, runs in sorted(by_config.items()):
        lines.append(f"| {name} | {len(runs)} | {sum(bool(r['fault']) + r['trainer_kills'] for r in runs)} | "
                     f"{sum(r['restarts'] for r in runs)} | {sum(r['rejoins'] for r in runs)} | "
                     f"{sum(r['status'] == 'error' for r in runs)} | "
                     f"{sum(r['status'] == 'hang' for r in runs)} | {sum(r['wall_s'] for r in runs) / len(runs):.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, required=True, help="start new jobs for this long")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (default: %(default)s)")
    parser.add_argument("--job-timeout-s", type=float, default=180.0,
                        help="a job running longer is a hang and is killed (default: %(default)s)")
    parser.add_argument("--elastic-share", type=float, default=0.1,
                        help="share of the draws that are elastic jobs (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "soak.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    outcomes: list[dict[str, Any]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="soak_") as scratch:
        while time.monotonic() - started < args.minutes * 60:
            job = draw_job(rng, len(outcomes), args.elastic_share)
            runner = run_elastic_job if job["name"] == ELASTIC else run_job
            outcome = runner(job, Path(scratch), args.job_timeout_s)
            outcomes.append(outcome)
            if job["name"] == ELASTIC:
                fault = "kills " + ",".join("{}@{}+{}s".format(*kill) for kill in job["kills"])
            else:
                fault = "{}:{}:{}".format(*job["fault"]) if job["fault"] else "no fault"
            print(f"job {job['index']:3d} {job['name']:15s} {job['steps']:3d} steps, every {job['checkpoint_every']:2d}, "
                  f"{fault:12s} {job['gba'] or '':22s} -> {outcome['status']} ({outcome['wall_s']:.1f} s)"
                  + (f": {outcome.get('why')}; log kept below" if outcome["status"] != "ok" else ""), flush=True)
            if outcome["status"] != "ok":  # keep the evidence past the scratch folder
                kept = args.output.parent / "soak_logs" / f"job_{job['index']:04d}.log"
                kept.parent.mkdir(parents=True, exist_ok=True)
                kept.write_text(Path(outcome["log"]).read_text())
                outcome["log"] = str(kept)
    summary = report(outcomes, (time.monotonic() - started) / 60)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"summary": summary, "seed": args.seed, "jobs": outcomes}, indent=2) + "\n")
    print(table(summary, outcomes))
    print(f"full record: {args.output}")
    sys.exit(1 if summary["errors"] or summary["hangs"] else 0)


if __name__ == "__main__":
    main()
