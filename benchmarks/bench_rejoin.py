"""Groups survive: a 2D job run as one torchrun job per replica group, one group lost mid-run.

    python benchmarks/bench_rejoin.py [--seeds 1,2,3] [--steps 6000] [--fault-at 0.3] [--restart-after-s 20] \
        [--config examples/configs/ma_2d.yaml] [--dotted.key value ...]

Every job is the harness (`benchmarks/train_dlrm.py`), 2 replica groups of 2 ranks, each group a
torchrun job of its own meeting the other at a replica store (`sync.replica_jobs`,
`sync.on_group_lost: continue`), `--steps` steps a group. Per seed, three jobs in a row:

- `uninterrupted`: nothing happens;
- `killed`: rank 3 (group 1's second rank) SIGKILLs itself at `--fault-at` of its steps; group 1's
  torchrun job ends (its agent has no restarts left) and this script starts it again
  `--restart-after-s` after the kill: its new process set asks to join, the members let it in after
  a round and hand it their replica, and it trains its steps from the start;
- `stopped`: rank 3 stops for good (SIGSTOP) at the same step: group 1 ends (its other rank's
  all-to-all times out, its agent ends the group), and group 0 trains on alone.

Reported per job: group 0's samples/s before the fault and during the outage (its own step times,
`train.record_step_times`; the outage ends when the rejoined group's first step ends, or with
group 0's own steps), the outage's timeline (kill, restart, the rejoined group's first step), the
replicas' spread across the groups at the end, and held-out AUC against the uninterrupted job of the
same seed. Medians (min-max) over the seeds, and each seed's AUC difference. Writes every run as
JSON (runs/bench_rejoin.json). Stop anything else running on the cores first.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from bench_summary import Column, markdown_table, spread, spread_cell
from example_job import ROOT, SYNTHETIC_HELDOUT, replica_store, start_replica_group

JOB_TIMEOUT_S = 1800.0
"""The longest one group's torchrun job may take before the benchmark gives up on it."""
FAULTS = ("uninterrupted", "killed", "stopped")
"""The jobs of a seed (module docstring)."""
LOST_TRAINER = 3
"""The rank that fails: group 1's second rank."""
HEAL_LINE = re.compile(r"rejoined \(epoch \d+\) and took the replica of group \d+ in ([0-9.]+) s")
"""Group 0's log line of a group let in (`ShadowSync._enter_epoch`): the heal's time, decision to rounds."""


def run_job(fault: str, seed: int, args: argparse.Namespace, extra: Sequence[str], scratch: Path) -> dict[str, Any]:
    """One job of the two groups under `fault`; both groups' results and the outage's timeline."""
    fault_step = max(1, int(args.fault_at * args.steps))
    fault_log = scratch / f"{fault}{seed}.jsonl"
    outputs = [scratch / f"{fault}{seed}_group{group}.json" for group in (0, 1)]
    arguments = ["--config", args.config, "--train.steps", str(args.steps), "--train.seed", str(seed),
                 "--data.synthetic.seed", str(seed), "--train.record_step_times", "true",
                 "--sync.on_group_lost", "continue", *SYNTHETIC_HELDOUT, *extra]
    faults = {"killed": f"kill:{LOST_TRAINER}:{fault_step}", "stopped": f"stop:{LOST_TRAINER}:{fault_step}"}
    environment = {"SHADOWGBA_TEST_FAULT_LOG": str(fault_log)}
    timeline: dict[str, float] = {}
    with replica_store() as store:
        first = start_replica_group(0, 2, store, 2, arguments, outputs[0], environment)
        second = start_replica_group(1, 2, store, 2, arguments, outputs[1],
                                     {**environment, "SHADOWGBA_TEST_FAULTS": faults[fault]} if fault in faults
                                     else environment)
        lost_log = second.communicate(timeout=JOB_TIMEOUT_S)[0]
        if fault == "killed":
            timeline["fault_at"] = _fired(fault_log)["at"]
            time.sleep(max(0.0, timeline["fault_at"] + args.restart_after_s - time.time()))
            timeline["restart_at"] = time.time()
            second = start_replica_group(1, 2, store, 2, arguments, outputs[1], environment)
            lost_log = second.communicate(timeout=JOB_TIMEOUT_S)[0]
        elif fault == "stopped":
            timeline["fault_at"] = _fired(fault_log)["at"]
        log = first.communicate(timeout=JOB_TIMEOUT_S)[0]
    expected = [0, 1 if fault == "stopped" else 0]
    if [first.returncode, second.returncode] != expected:
        raise SystemExit(f"{fault} seed {seed}: the groups exited {[first.returncode, second.returncode]}, "
                         f"expected {expected}:\n--- group 0 ---\n{log[-3000:]}\n--- group 1 ---\n{lost_log[-3000:]}")
    results = [json.loads(output.read_text()) if output.exists() else None for output in outputs]
    heals = [float(seconds) for seconds in HEAL_LINE.findall(log)]
    return {"fault": fault, "seed": seed, "timeline": timeline, "groups": results,
            "metrics": {**metrics(results, timeline, args), "heal_s": heals[0] if heals else None}}


def _fired(fault_log: Path) -> dict[str, Any]:
    """The one fault the job fired (`dlrm.faults` record)."""
    fired = [json.loads(line) for line in fault_log.read_text().splitlines()]
    if len(fired) != 1:
        raise SystemExit(f"expected one fired fault in {fault_log}, found {fired}")
    return fired[0]


def metrics(results: list[dict[str, Any] | None], timeline: dict[str, float], args: argparse.Namespace) -> dict[str, Any]:
    """Group 0's throughput before the fault and during the outage, the rejoin's delays, the end state."""
    group0, group1 = results
    assert group0 is not None
    batch = group0["config"]["data"][group0["config"]["data"]["source"]]["batch_size"]
    steps = group0["step_end_at"]
    begin = steps[min(group0["config"]["train"]["warmup_steps"], len(steps) - 1)]
    fault_at = timeline.get("fault_at")
    rejoined_at = group1["step_end_at"][0] if "restart_at" in timeline and group1 else None
    outage_end = rejoined_at if rejoined_at is not None else steps[-1]

    def rate(start: float, end: float) -> float | None:
        done = sum(1 for ended in steps if start < ended <= end)
        return done * batch * 2 / (end - start) if end > start and done else None  # group 0's 2 trainers

    sync = group0["sync"]
    return {
        "group0_samples_per_s_before": rate(begin, fault_at) if fault_at else rate(begin, steps[-1]),
        "group0_samples_per_s_outage": rate(fault_at, outage_end) if fault_at else None,
        "restart_to_training_s": rejoined_at - timeline["restart_at"] if rejoined_at is not None else None,
        "fault_to_training_s": rejoined_at - fault_at if rejoined_at is not None and fault_at else None,
        "groups_lost": sync.get("replica_groups_lost"), "groups_joined": sync.get("replica_groups_joined"),
        "dense_spread": group0["dense_replica_max_abs_diff"], "table_spread": group0["table_replica_max_abs_diff"],
        "auc": group0["auc"], "samples": group0["samples_computed_total"],
    }


def summary_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for fault in FAULTS:
        mine = [run for run in runs if run["fault"] == fault]
        if not mine:
            continue
        baseline = {run["seed"]: run["metrics"]["auc"] for run in runs if run["fault"] == "uninterrupted"}
        row: dict[str, Any] = {"fault": fault}
        for name in ("group0_samples_per_s_before", "group0_samples_per_s_outage", "restart_to_training_s",
                     "heal_s", "dense_spread", "table_spread", "auc", "samples"):
            row[name] = spread([run["metrics"][name] for run in mine])
        ratios = [run["metrics"]["group0_samples_per_s_outage"] / run["metrics"]["group0_samples_per_s_before"]
                  for run in mine if run["metrics"]["group0_samples_per_s_outage"]]
        row["outage_over_before"] = spread(ratios)
        row["auc_differences"] = [run["metrics"]["auc"] - baseline[run["seed"]] for run in mine if run["seed"] in baseline]
        row["auc_difference"] = spread(row["auc_differences"])
        rows.append(row)
    return rows


COLUMNS: list[Column] = [
    ("job", lambda row: row["fault"]),
    ("group 0 samples/s before", lambda row: spread_cell(row["group0_samples_per_s_before"], ",.0f")),
    ("during the outage / before", lambda row: spread_cell(row["outage_over_before"], ".2f")),
    ("restart to training, s", lambda row: spread_cell(row["restart_to_training_s"], ".1f")),
    ("heal, s", lambda row: spread_cell(row["heal_s"], ".2f")),
    ("dense / table spread at the end", lambda row: f"{spread_cell(row['dense_spread'], '.1g')} / "
                                                    f"{spread_cell(row['table_spread'], '.1g')}"),
    ("held-out AUC", lambda row: spread_cell(row["auc"], ".4f")),
    ("AUC - uninterrupted (per seed)", lambda row: ", ".join(f"{value:+.4f}" for value in row["auc_differences"])),
    ("samples", lambda row: spread_cell(row["samples"], ",.0f")),
]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds, one job of each fault per seed")
    parser.add_argument("--steps", type=int, default=6000,
                        help="training steps of each group: enough that group 0 still trains when group 1 rejoins")
    parser.add_argument("--fault-at", type=float, default=0.3, help="share of the steps after which rank 3 fails")
    parser.add_argument("--restart-after-s", type=float, default=20.0, help="how long after the kill group 1 restarts")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {list(FAULTS)}")
    parser.add_argument("--config", default=str(ROOT / "examples" / "configs" / "ma_2d.yaml"), help="the 2D config")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "bench_rejoin.json", help="JSON results")
    args, extra = parser.parse_known_args(argv)
    faults = [fault for fault in args.faults.split(",") if fault]
    if not set(faults) <= set(FAULTS):
        raise SystemExit(f"--faults must name only {list(FAULTS)}; got {faults}")
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in (int(seed) for seed in args.seeds.split(",")):
            for fault in faults:
                run = run_job(fault, seed, args, extra, Path(scratch))
                runs.append(run)
                print(f"{fault} seed {seed}: {json.dumps(run['metrics'])}", flush=True)
    rows = summary_rows(runs)
    print(markdown_table(COLUMNS, rows))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"settings": vars(args) | {"output": str(args.output), "overrides": extra},
                                       "summary": rows, "runs": runs}, indent=2, default=str) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
