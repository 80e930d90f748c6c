"""One `torchrun` job of `benchmarks/train_dlrm.py`, as the benchmarks launch it.

The single place that knows the launch command: a standalone torchrun of the example with the
progress bar off and the results written to a JSON file, which is read back (`run_example`), or
the same across simulated hosts, one torchrun agent per host (`run_across_hosts`), or one replica
group of a 2D job launched as a torchrun job per group, beside its replica store
(`replica_store`, `start_replica_group`). A failed job stops the benchmark with the job's output
tail (a benchmark with a missing run would compare nothing).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ctrkit.cluster import Cluster
from dlrm.host import free_port
from shadowgba.config import SyncConfig

ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = ROOT / "benchmarks" / "train_dlrm.py"
CONFIGS = ROOT / "examples" / "configs"

WARMUP_STEPS = SyncConfig().first_round_after + 10
"""Steps before a throughput window opens: past the shadow runtime's first round
(`sync.first_round_after`) and a few more, so that every timed step of a shadow variant is one whose
rounds run beside it."""

MODEL_PRESETS = ("small", "production")
"""The model presets the throughput benchmarks run side by side (examples/configs/presets/): small, 8
tables of 100K x 64 and a 338K-parameter dense net, large enough that syncing it costs real time
(docs/benchmarks.md, "The development machines"); production, MLPerf DLRM's 2.4M-parameter dense
and over arch over 26 tables of 100K x 128."""


def preset_arguments(preset: str) -> list[str]:
    """The train_dlrm.py arguments that select a model preset."""
    return ["--preset", preset]


def parse_presets(text: str) -> list[str]:
    """`--presets small,production` as a list, refused (SystemExit) if it names an unknown preset."""
    presets = text.split(",")
    unknown = sorted(set(presets) - set(MODEL_PRESETS))
    if unknown or not presets:
        raise SystemExit(f"--presets must name only {list(MODEL_PRESETS)}; got {presets}")
    return presets


VARIANT_OVERRIDE = "@"
"""Separates a variant's name from overrides of its config: `ma-shadow@sync.rounds_nice=19@sync.max_round_share=0.05`
runs `ma-shadow` with those two settings, so a candidate setting is measured side by side with the variant
as it is, in the same invocation."""


def variant_base(variant: str) -> str:
    """The table entry a variant runs: its name without the `@` overrides."""
    return variant.split(VARIANT_OVERRIDE)[0]


def parse_variants(text: str, table: Mapping[str, Any], option: str) -> list[str]:
    """A comma-separated list of variants, each a key of `table` with optional `@dotted.key=value`
    overrides; refused (SystemExit) when empty, naming anything else, or with an override lacking `=`."""
    variants = [variant for variant in text.split(",") if variant]
    wrong = [variant for variant in variants if variant_base(variant) not in table
             or any("=" not in override for override in variant.split(VARIANT_OVERRIDE)[1:])]
    if wrong or not variants:
        raise SystemExit(f"{option} must name only {list(table)}, each optionally followed by "
                         f"{VARIANT_OVERRIDE}dotted.key=value overrides; got {variants}")
    return variants


def variant_arguments(variant: str, table: Mapping[str, Sequence[str]], rest: Sequence[str] = ()) -> list[str]:
    """The harness arguments of `variant` (`parse_variants`): its table entry, then `rest` (the run's
    own arguments and the command line's overrides), then the variant's own overrides, which win."""
    overrides = variant.split(VARIANT_OVERRIDE)[1:]
    own = [part for override in overrides for part in (f"--{override.partition('=')[0]}", override.partition("=")[2])]
    return [*table[variant_base(variant)], *rest, *own]


SYNTHETIC_HELDOUT = ["--data.synthetic.eval_batches", "128"]
"""Held-out synthetic set of the quality benchmarks: 128 x 512 = 65,536 samples, 4x the example's
default, since they compare AUCs to 0.002 and the held-out set's own sampling noise must stay
well below that."""


def harness_script(arguments: Sequence[str], output: Path) -> list[str]:
    """The harness and its arguments, as torchrun runs it on every rank: progress off, results to `output`."""
    return [str(TRAIN_SCRIPT), *arguments, "--train.progress", "false", "--output", str(output)]


def run_example(
    label: str, nproc: int, arguments: Sequence[str], output: Path, attempts: int = 1,
    environment: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run the example on `nproc` ranks with `arguments` (and `environment` over this process's);
    returns its results, or exits naming `label` after `attempts` failed jobs. A retry is announced with the failed job's output tail: a long
    matrix should survive a rare crash (e.g. a rank aborting in gloo's teardown after it wrote its
    results) without hiding it."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *harness_script(arguments, output)]
    for attempt in range(1, attempts + 1):
        output.unlink(missing_ok=True)
        job = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(environment or {})})
        if job.returncode == 0:
            return json.loads(output.read_text())
        print(f"{label} failed (exit {job.returncode}, attempt {attempt} of {attempts}):\n"
              f"{(job.stdout + job.stderr)[-4000:]}", flush=True)
    raise SystemExit(f"{label} failed {attempts} time(s); its output is above")


HOSTS_JOB_TIMEOUT_S = 900.0
"""The longest one job across hosts may take (start-up of the production preset's tables included)
before it is killed."""


def run_across_hosts(label: str, arguments: Sequence[str], output: Path, nproc_per_host: int, rate: str,
                     slow_links: Mapping[int, int] | None = None, hosts: int = 2) -> dict[str, Any]:
    """The example across `hosts` simulated hosts (`ctrkit.cluster`), `nproc_per_host` consecutive
    ranks each, every link at `rate` (`slow_links`: host -> bits/s instead); its results with
    `wire_bytes_sent`, what every host sent on its link. Exits naming `label` with the agents'
    output tails if the job fails or hangs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    output.unlink(missing_ok=True)
    with Cluster(hosts, rate=rate) as cluster:
        for host, bits in (slow_links or {}).items():
            cluster.set_rate(host, bits)
        agents = cluster.torchrun(harness_script(arguments, output), nproc_per_host, env=env, capture=True)
        outcomes = []
        for agent in agents:
            try:
                outcomes.append((agent.communicate(timeout=HOSTS_JOB_TIMEOUT_S)[0], agent.returncode))
            except subprocess.TimeoutExpired:
                cluster.close()
                outcomes.append((agent.communicate()[0], None))
        ok = all(code == 0 for _, code in outcomes)
        sent = sum(cluster.wire_bytes(host)[1] for host in range(hosts)) if ok else 0
    if not ok:
        tails = "\n".join(f"--- host {host}: exit {code} ---\n{text[-3000:]}" for host, (text, code) in enumerate(outcomes))
        raise SystemExit(f"{label} failed:\n{tails}")
    result = json.loads(output.read_text())
    result["wire_bytes_sent"] = sent
    return result


@contextlib.contextmanager
def replica_store() -> Iterator[str]:
    """A replica store (`python -m shadowgba.replica_store`) on a free local port while the block
    runs: its `host:port`, for `sync.replica_jobs.store`."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "shadowgba.replica_store", "--host", "127.0.0.1", "--port",
                                str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


def start_replica_group(group: int, groups: int, store: str, nproc: int, arguments: Sequence[str], output: Path,
                        environment: Mapping[str, str] | None = None, max_restarts: int = 0) -> subprocess.Popen:
    """Start replica group `group` of `groups` as a torchrun job of its own (`nproc` ranks, its agent
    restarting it up to `max_restarts` times), meeting the others at the replica store `store`;
    the running agent, its output captured (stdout and stderr together)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
               f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
               "--monitor-interval=0.5", *harness_script([
                   *arguments, "--sync.replica_jobs.store", store, "--sync.replica_jobs.num_groups", str(groups),
                   "--sync.replica_jobs.group", str(group)], output)]
    # the harness imports its package (benchmarks/dlrm) by its own folder, which no inherited
    # PYTHONSAFEPATH may take off the path
    env = {**{key: value for key, value in os.environ.items() if key != "PYTHONSAFEPATH"}, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]), **(environment or {})}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
