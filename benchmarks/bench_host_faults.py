"""Across hosts, the network faults: each fault test of `make test-hosts`, run `--reps` times, as one table.

    python benchmarks/bench_host_faults.py [--reps 3] [--output runs/bench_host_faults.json]

The faults are injected and judged by the tests themselves (`tests/test_hosts.py`,
`tests/test_hosts_elastic.py`: a host's link set down for a while or for good, throttled to 1%, a
server's host cut off, an elastic trainer's host cut off or its process killed), on the simulated
hosts of `ctrkit.cluster`. Each test records what it measured (`tests/fault_table.py`: times from
the fault, steps and rounds around it, what each rank said); this script runs them with that
recording on and joins it with pytest's verdict per run: passed, failed, or hung (pytest-timeout
stopped it). Prints a Markdown table, one row per fault, with every run's figures. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Sequence

from ctrkit.cluster import unavailable_reason

ROOT = Path(__file__).resolve().parents[1]
TESTS = ("tests/test_hosts.py", "tests/test_hosts_elastic.py")
EXPECTED: dict[str, str] = {
    "test_a_link_down_for_less_than_the_timeout_costs_nothing":
        "training goes on; rounds resume once the link is back; nothing is named; replicas identical",
    "test_a_link_down_past_the_timeout_ends_every_rank_naming_the_unreachable_one":
        "every rank ends within the timeout (+ the notice board's bound), naming the unreachable rank",
    "test_2d_a_host_cut_off_past_the_timeout_ends_every_rank_naming_the_unreachable_ones[fail]":
        "every rank ends, host 0's naming host 1's ranks, host 1's saying they are cut off",
    "test_2d_a_host_cut_off_past_the_timeout_ends_every_rank_naming_the_unreachable_ones[continue]":
        "host 1's group drops out; host 0's trains on to its last step and writes the result",
    "test_a_trainer_host_cut_off_past_the_timeout_departs_and_its_restart_rejoins":
        "the trainer departs after the timeout, the others train on; its restart rejoins once the link is back",
    "test_a_trainer_killed_on_one_host_rejoins_from_another":
        "the trainer departs, the others train on; its restart on another host rejoins",
    "test_a_link_throttled_to_1_percent_is_a_network_straggler_the_other_host_trains_through":
        "a network straggler: both hosts keep their step rate; the rounds slow down",
    "test_a_servers_host_cut_off_ends_every_trainer_naming_the_server":
        "trainers end naming the server (no server restart configured), within 2x the timeout",
}
"""Each fault test, by pytest's name, and what it asserts."""
FAULT_TESTS = sorted({name.split("[")[0] for name in EXPECTED})


def verdicts(junit: Path) -> dict[str, str]:
    """pytest's verdict per test name in a JUnit XML report: passed, failed, hung or skipped."""
    outcome: dict[str, str] = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if case.find("skipped") is not None:
            outcome[case.get("name", "")] = "skipped"
        elif problem is None:
            outcome[case.get("name", "")] = "passed"
        else:
            outcome[case.get("name", "")] = "hung" if "Timeout" in (problem.get("message") or "") else "failed"
    return outcome


def run_once(scratch: Path, rep: int) -> list[dict[str, Any]]:
    """Every fault test once: one row per test, its verdict and its figures."""
    table, junit = scratch / f"faults{rep}.jsonl", scratch / f"junit{rep}.xml"
    env = {**os.environ, "SHADOWGBA_FAULT_TABLE": str(table), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "hosts", *TESTS, "-k", " or ".join(FAULT_TESTS),
                    "-p", "no:cacheprovider", f"--junitxml={junit}"], cwd=ROOT, env=env, check=False)
    measured = {row["test"]: row for row in map(json.loads, table.read_text().splitlines())} if table.exists() else {}
    verdict = verdicts(junit)
    return [{"rep": rep, "test": test, "verdict": verdict.get(test, "not run"), **measured.get(test, {})}
            for test in EXPECTED]


def rounded(value: Any) -> Any:
    """`value` with every float in it to 0.1."""
    if isinstance(value, float):
        return round(value, 1)
    return [rounded(item) for item in value] if isinstance(value, list) else value


def figures(measured: dict[str, Any] | None) -> str:
    if not measured:
        return "-"
    return "; ".join(f"{name.replace('_', ' ')} {rounded(value)}" for name, value in measured.items() if value is not None)


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = ["| fault | layout | expected | verdicts | measured (each run) |", "| --- | --- | --- | --- | --- |"]
    for test, expected in EXPECTED.items():
        mine = [run for run in runs if run["test"] == test]
        named = next((run for run in mine if "fault" in run), {"fault": test, "layout": "-"})
        counts = {verdict: sum(run["verdict"] == verdict for run in mine) for verdict in ("passed", "failed", "hung")}
        cell = ", ".join(f"{count} {verdict}" for verdict, count in counts.items() if count) or "not run"
        each = "<br>".join(f"run {run['rep'] + 1}: {figures(run.get('measured'))}" for run in mine)
        lines.append(f"| {named['fault']} | {named['layout']} | {expected} | {cell} | {each} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="runs of every fault test")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "bench_host_faults.json", help="JSON results")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(reason)
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for rep in range(args.reps):
            runs += run_once(Path(scratch), rep)
    print(markdown(runs))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"reps": args.reps, "runs": runs}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
