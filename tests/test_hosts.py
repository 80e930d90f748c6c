"""Every layout across simulated hosts (`ctrkit.cluster`): network namespaces on one switch, each
rank's bytes to a peer on another host crossing a link, started per host as multi-node torchrun.

Run by `make test-hosts` (they need root; without it they skip, saying so). No test sets
GLOO_SOCKET_IFNAME: the job must find its interface itself, whatever the host name resolves to.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import pytest

from ctrkit import cluster as cluster_module
from ctrkit.cluster import Cluster
from shadowgba.ps.channel import INLINE_TENSOR_BYTES

pytestmark = [
    pytest.mark.hosts,
    pytest.mark.timeout(400),
    pytest.mark.skipif(cluster_module.unavailable_reason() is not None,
                       reason=str(cluster_module.unavailable_reason())),
]

ROOT = Path(__file__).resolve().parents[1]
SMALL_RUN = [
    "--train.steps", "300", "--train.warmup_steps", "20", "--train.progress", "false",
    "--data.synthetic.eval_batches", "8", "--sync.interval_ms", "20",
]


def environment() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name != "GLOO_SOCKET_IFNAME"}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run_job(cluster: Cluster, nprocs: Sequence[int], config: str, output: Path, extra: Sequence[str] = (),
            timeout_s: float = 240, hosts: Sequence[int] | None = None) -> list[tuple[int | None, str]]:
    """`benchmarks/train_dlrm.py` with `config` as one torchrun agent per host; (exit code or None if
    it hung past `timeout_s`, output) per agent."""
    script = [str(ROOT / "benchmarks/train_dlrm.py"), "--config", str(ROOT / "examples/configs" / config),
              "--output", str(output), *SMALL_RUN, *extra]
    agents = cluster.torchrun(script, nprocs, hosts=hosts, env=environment(), capture=True)
    return finish(agents, timeout_s)


def finish(agents: Sequence[subprocess.Popen], timeout_s: float) -> list[tuple[int | None, str]]:
    """Each agent's (exit code, or None when it was still running after `timeout_s`; its output)."""
    def wait(agent: subprocess.Popen) -> tuple[int | None, str]:
        try:
            output, _ = agent.communicate(timeout=timeout_s)
            return agent.returncode, output
        except subprocess.TimeoutExpired:
            agent.kill()
            return None, agent.communicate()[0]

    with ThreadPoolExecutor(len(agents)) as pool:
        return list(pool.map(wait, agents))


def assert_finished(outcomes: list[tuple[int | None, str]]) -> None:
    failed = [(index, code, output) for index, (code, output) in enumerate(outcomes) if code != 0]
    assert not failed, "\n".join(f"--- host {index}: exit {code} ---\n{output[-3000:]}" for index, code, output in failed)


@pytest.mark.parametrize("algo", ["ma", "bmuf"])
def test_flat_shadow_sync_across_two_hosts_ends_with_identical_replicas(algo: str, tmp_path: Path) -> None:
    """1 rank per host. Host 1 has a second interface listed before its link to host 0 (what a
    "first NIC" choice takes, and from which host 0 cannot be reached): the job must pick eth0."""
    with Cluster(2, rate="1gbit", extra_interface=[1] if algo == "ma" else []) as cluster:
        outcomes = run_job(cluster, [1, 1], f"{algo}.yaml", tmp_path / "out.json")
        wire = [cluster.wire_bytes(host) for host in range(2)]
        extra = cluster.wire_bytes(1, "eth1") if algo == "ma" else None
    assert_finished(outcomes)
    results = json.loads((tmp_path / "out.json").read_text())
    assert results["world_size"] == 2 and results["steps"] == 300
    assert results["dense_replica_max_abs_diff"] == 0.0
    rounds = results["sync"]["rounds"]
    assert rounds > 10
    # every round sent host 1's replica to host 0 over the link (gloo's ring: at least half of it each way)
    assert wire[1][1] >= rounds * results["dense_params"] * 4 / 2, (wire, rounds)
    if extra is not None:
        assert extra[1] < 100_000, f"the job used host 1's other interface: {extra}"


def test_2d_layout_shards_within_hosts_and_replicates_across_them(tmp_path: Path) -> None:
    """2 hosts x 2 ranks, `sharding_group_size` 2: each host is one replica group (its TorchRec
    all-to-all on the host), and the replica groups' rounds cross the link."""
    with Cluster(2, rate="1gbit") as cluster:
        outcomes = run_job(cluster, [2, 2], "ma_2d.yaml", tmp_path / "out.json", ["--train.steps", "200"])
        wire = [cluster.wire_bytes(host) for host in range(2)]
    assert_finished(outcomes)
    results = json.loads((tmp_path / "out.json").read_text())
    assert results["world_size"] == 4 and results["steps"] == 200
    assert results["dense_replica_max_abs_diff"] == 0.0
    assert results["table_replica_max_abs_diff"] == 0.0
    assert results["sync"]["rounds"] > 5
    assert min(sent for _, sent in wire) > 1_000_000, wire  # table fragments and dense rounds crossed


def test_gba_with_ps_tables_and_the_server_on_a_host_of_its_own(tmp_path: Path) -> None:
    """Two trainers on host 0, the server on host 1 (the last rank): every push, lookup and watch
    goes over gloo TCP across the link, not through the same-host shared memory."""
    with Cluster(2, rate="1gbit") as cluster:
        outcomes = run_job(cluster, [2, 1], "gba_ps_embeddings.yaml", tmp_path / "out.json",
                           ["--train.steps", "200", "--model.over_arch_layer_sizes", "[1024, 1]"])
        wire = [cluster.wire_bytes(host) for host in range(2)]
    assert_finished(outcomes)
    results = json.loads((tmp_path / "out.json").read_text())
    assert results["trainers"] == 2 and results["servers"] == 1
    assert results["dense_params"] * 4 > 2 * INLINE_TENSOR_BYTES  # a push would take a same-host lane
    pushes = sum(shard["pushes"] for shard in results["gba"]["dense_shards"])
    assert pushes >= 200, results["gba"]["dense_shards"]
    assert wire[1][0] >= pushes * results["dense_params"] * 4, (wire, pushes)  # every dense push reached the server's link


def test_a_wrong_gloo_socket_ifname_is_named_on_every_rank_before_any_group(tmp_path: Path) -> None:
    with Cluster(2) as cluster:
        env = {**environment(), "GLOO_SOCKET_IFNAME": "eth7"}
        script = [str(ROOT / "benchmarks/train_dlrm.py"), "--config", str(ROOT / "examples/configs/ma.yaml"),
                  "--output", str(tmp_path / "out.json"), *SMALL_RUN]
        started = time.monotonic()
        outcomes = finish(cluster.torchrun(script, 1, env=env, capture=True), 120)
        elapsed = time.monotonic() - started
    for code, output in outcomes:
        assert code not in (0, None), output[-2000:]
        assert "GLOO_SOCKET_IFNAME=eth7: this host has no interface 'eth7' with an IPv4 address" in output, output[-2000:]
        assert "its interfaces: lo, eth0" in output
    assert elapsed < 60
