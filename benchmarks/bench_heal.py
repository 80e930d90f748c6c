"""A replica gone NaN, healed under `sync.on_nonfinite: skip`, against the same job without the fault.

    python benchmarks/bench_heal.py [--algos ma,easgd,bmuf,easgd_ps,ma_2d] [--steps 600] [--nan-at 0.3] [--seeds 1]

Not part of `make test`. Per algorithm and seed, three jobs of the harness in rotating order: the
clean one twice, and one in which trainer 1's dense weights turn NaN right after step `--nan-at` x
`--steps` (`dlrm.faults`' `nan` fault, armed through SHADOWGBA_TEST_FAULTS), as a diverged step or
a bit flip leaves them. All train `--steps` steps per trainer (equal samples seen). Reported per
algorithm and seed: whether the faulted job finished, trainer 1's skipped steps (from the fault
until a round healed it: the steps its replica was out) and heals, held-out AUC of the first clean
job and of the faulted one with their difference (the target: within 0.002), and the two clean
jobs' difference: the shadow rounds' timing makes runs of one seed differ, and that is the noise
the fault's difference is read against. ma_2d runs 2 groups of 2 ranks; easgd_ps 2 trainers and 1
server; the others 2 trainers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, Sequence

from bench_2d import parse_list
from example_job import CONFIGS, run_example

ALGOS = {"ma": 2, "easgd": 2, "bmuf": 2, "easgd_ps": 3, "ma_2d": 4}
"""Each algorithm's example config and its ranks."""


def job(algo: str, steps: int, seed: int, nan_step: int | None, output: Path) -> dict[str, Any]:
    """One harness job of `algo`; with `nan_step`, trainer 1's dense weights turn NaN after that step."""
    arguments = ["--config", str(CONFIGS / f"{algo}.yaml"), "--train.steps", str(steps), "--train.seed", str(seed),
                 "--sync.on_nonfinite", "skip"]
    environment = {"SHADOWGBA_TEST_FAULTS": f"nan:1:{nan_step}"} if nan_step is not None else {}
    return run_example(f"{algo} seed {seed}" + (" with NaN" if nan_step else ""), ALGOS[algo], arguments, output,
                       environment=environment)


def triple(algo: str, steps: int, seed: int, nan_step: int, rotation: int, directory: Path) -> dict[str, Any]:
    """The two clean jobs and the faulted one of `algo` (their order rotated by `rotation`), compared."""
    order = ["clean", "faulted", "again"]
    order = order[rotation % 3:] + order[:rotation % 3]
    runs = {name: job(algo, steps, seed, nan_step if name == "faulted" else None, directory / f"{algo}-{seed}-{name}.json")
            for name in order}
    clean, faulted = runs["clean"], runs["faulted"]
    return {
        "algo": algo, "seed": seed, "nan_step": nan_step, "finished": faulted["steps"] == steps,
        "skipped_steps": faulted["nonfinite_steps_skipped_by_trainer"][1],
        "heals": faulted["nonfinite_replicas_healed_by_trainer"][1],
        "auc_clean": clean["auc"], "auc_faulted": faulted["auc"], "auc_diff": faulted["auc"] - clean["auc"],
        "auc_noise": runs["again"]["auc"] - clean["auc"],
        "dense_spread_faulted": faulted["dense_replica_max_abs_diff"],
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| algo | seed | NaN after step | finished | steps trainer 1 skipped | heals | AUC clean | AUC faulted "
             "| difference | clean again - clean |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row['algo']} | {row['seed']} | {row['nan_step']} | {'yes' if row['finished'] else 'NO'} "
                     f"| {row['skipped_steps']} | {row['heals']} | {row['auc_clean']:.4f} | {row['auc_faulted']:.4f} "
                     f"| {row['auc_diff']:+.4f} | {row['auc_noise']:+.4f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", default=",".join(ALGOS), help="comma-separated, of %(default)s")
    parser.add_argument("--steps", type=int, default=600, help="steps per trainer (default: %(default)s)")
    parser.add_argument("--nan-at", type=float, default=0.3, help="fraction of --steps after which the NaN comes")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per algorithm (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=Path("runs/bench_heal.json"))
    args = parser.parse_args(argv)
    algos = parse_list(args.algos, list(ALGOS), "--algos")
    nan_step = max(1, int(args.nan_at * args.steps))
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in range(args.seeds):
            for index, algo in enumerate(algos):
                rows.append(triple(algo, args.steps, seed, nan_step, index + seed, Path(scratch)))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    for algo in algos:
        mine = [row for row in rows if row["algo"] == algo]
        diffs, noise = [row["auc_diff"] for row in mine], [row["auc_noise"] for row in mine]
        print(f"{algo}: AUC faulted - clean median {statistics.median(diffs):+.4f} (min {min(diffs):+.4f}, max "
              f"{max(diffs):+.4f}); clean again - clean median {statistics.median(noise):+.4f} (min {min(noise):+.4f}, "
              f"max {max(noise):+.4f}); {sum(row['finished'] for row in mine)} of {len(mine)} faulted jobs finished")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
