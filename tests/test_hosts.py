"""Every layout across simulated hosts (`ctrkit.cluster`): network namespaces on one switch, each
rank's bytes to a peer on another host crossing a link, started per host as multi-node torchrun.

Run by `make test-hosts`. They need root (tests/conftest.py: without it a plain run skips them,
saying why, and `make test-hosts` fails saying so). No test sets GLOO_SOCKET_IFNAME: the job must
find its interface itself, whatever the host name resolves to.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import pytest

from ctrkit.cluster import Cluster
from shadowgba.ps.wire import INLINE_TENSOR_BYTES
from tests import fault_table

pytestmark = [
    pytest.mark.hosts,
    pytest.mark.timeout(400),
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
        except subprocess.TimeoutExpired:  # the agent and its ranks (a session of their own)
            os.killpg(agent.pid, signal.SIGKILL)
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


# ------------------------------------------------------------------------------------ network faults
class FaultJob:
    """`tests/cluster_job.py` as one torchrun agent per host: each rank trains for `seconds` and
    reports (wall time, steps, rounds) as it goes, and its end (error included) in `out`."""

    def __init__(self, cluster: Cluster, nprocs: Sequence[int], config: str, out: Path, seconds: float,
                 extra: Sequence[str] = ()) -> None:
        self.out = out
        self.ranks = sum(nprocs)
        script = [str(ROOT / "tests/cluster_job.py"), "--config", str(ROOT / "examples/configs" / config),
                  "--seconds", str(seconds), "--out", str(out), *extra]
        self.agents = cluster.torchrun(script, nprocs, env=environment(), capture=True)

    def progress(self, rank: int) -> list[dict]:
        path = self.out / f"rank{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for_rounds(self, ranks: Sequence[int], rounds: int, timeout_s: float = 90) -> None:
        """Until each of `ranks` has reported `rounds` sync rounds (training and syncing across the links)."""
        deadline = time.monotonic() + timeout_s
        while not all(self.progress(rank) and self.progress(rank)[-1]["rounds"] >= rounds for rank in ranks):
            assert time.monotonic() < deadline, f"no {rounds} rounds within {timeout_s} s: {self.finish(1)}"
            time.sleep(0.2)

    def finish(self, timeout_s: float, agent_grace_s: float = 15.0) -> list[tuple[int | None, str]]:
        """Each agent's (exit code, output), once every rank has written its end and the agents have
        had `agent_grace_s` more to exit (or `timeout_s` passed): torchrun's agent on a cut-off
        host waits for the others in its exit barrier for minutes (`exit_barrier_timeout`), after
        its ranks have ended. An agent still running then is killed, and its code reads None."""
        deadline = time.monotonic() + timeout_s
        ended_by = None
        while time.monotonic() < deadline and any(agent.poll() is None for agent in self.agents):
            if ended_by is None and all((self.out / f"rank{rank}.json").exists() for rank in range(self.ranks)):
                ended_by = time.monotonic() + agent_grace_s
            if ended_by is not None and time.monotonic() > ended_by:
                break
            time.sleep(0.2)
        return finish(self.agents, 0.1)

    def record(self, rank: int) -> dict:
        return json.loads((self.out / f"rank{rank}.json").read_text())

    def between(self, rank: int, start: float, end: float) -> tuple[int, int]:
        """(steps, rounds) rank `rank` made between the wall times `start` and `end`, from its reports."""
        inside = [report for report in self.progress(rank) if start <= report["t"] <= end]
        assert len(inside) >= 2, f"rank {rank} reported nothing between {start} and {end}"
        return inside[-1]["steps"] - inside[0]["steps"], inside[-1]["rounds"] - inside[0]["rounds"]


def error_line(record: dict) -> str | None:
    """What the error a cluster_job rank ended with says of the cause (the library's own sentence,
    after any raw backend text; None: it ended without one)."""
    if record["error"] is None:
        return None
    traceback = record["error"]["traceback"].strip()
    said = traceback.rsplit("shadowgba: ", 1)[1].splitlines()[0] if "shadowgba: " in traceback else traceback.splitlines()[-1]
    return said[:200]


def test_a_link_down_for_less_than_the_timeout_costs_nothing(tmp_path: Path) -> None:
    """Host 1's link down for 5 s (sync.timeout_s 30): both ranks train on through it, the rounds
    stop while it is down and resume once it is back, nothing is named, replicas end identical."""
    with Cluster(2, rate="1gbit") as cluster:
        job = FaultJob(cluster, [1, 1], "ma.yaml", tmp_path, seconds=20, extra=["--sync.timeout_s", "30"])
        job.wait_for_rounds([0, 1], 5)
        cluster.link_down(1)
        down = time.time()
        time.sleep(5)
        cluster.link_up(1)
        up = time.time()
        outcomes = job.finish(120)
    records = [job.record(rank) for rank in range(2)]
    during = [job.between(rank, down + 0.5, up - 0.5) for rank in range(2)]
    after = [job.between(rank, up, up + 1e9) for rank in range(2)]
    named = [word for _, output in outcomes for word in ("PeerLost", "heartbeat", "cut off") if word in output]
    fault_table.record("a host's link down for 5 s (sync.timeout_s 30)", "flat ma, 2 hosts x 1",
                       exit_codes=[code for code, _ in outcomes], steps_while_down=[steps for steps, _ in during],
                       rounds_while_down=[rounds for _, rounds in during], rounds_after=[rounds for _, rounds in after],
                       named=named, identical_replicas=records[0]["checksum"] == records[1]["checksum"])
    assert_finished(outcomes)
    assert all(record["error"] is None for record in records)
    assert records[0]["checksum"] == records[1]["checksum"]  # the final sync: identical replicas
    for rank, ((steps_down, rounds_down), (_, rounds_after)) in enumerate(zip(during, after)):
        assert steps_down > 100, f"rank {rank} stopped training while the link was down"
        assert rounds_down <= 1, f"the fault did not fire: rank {rank} made {rounds_down} rounds while cut off"
        assert rounds_after >= 5, f"rank {rank}'s rounds did not resume: {rounds_after}"
    assert not named


def test_a_link_down_past_the_timeout_ends_every_rank_naming_the_unreachable_one(tmp_path: Path) -> None:
    """Host 1 cut off for good (sync.timeout_s 6): rank 0 ends naming rank 1, rank 1 ends saying it
    is cut off, both within the timeout plus the notice board's (`NOTICE_TIMEOUT_S`) and a margin."""
    from shadowgba.job.notices import NOTICE_TIMEOUT_S

    timeout_s = 6.0
    with Cluster(2, rate="1gbit") as cluster:
        job = FaultJob(cluster, [1, 1], "ma.yaml", tmp_path, seconds=60, extra=["--sync.timeout_s", str(timeout_s)])
        job.wait_for_rounds([0, 1], 5)
        cluster.link_down(1)
        down = time.time()
        outcomes = job.finish(90)
    records = [job.record(rank) for rank in range(2)]
    fault_table.record(f"a host's link down for good (sync.timeout_s {timeout_s:g})", "flat ma, 2 hosts x 1",
                       exit_codes=[code for code, _ in outcomes],
                       ended_after_s=[record["ended_at"] - down for record in records],
                       said=[error_line(record) for record in records])
    for rank, (code, output) in enumerate(outcomes):
        assert code == 1, f"host {rank}: exit {code}\n{output[-3000:]}"
        assert records[rank]["ended_at"] - down < timeout_s + NOTICE_TIMEOUT_S + 5, records[rank]["ended_at"] - down
    assert "trainer 1 (rank 1) stopped its heartbeat" in records[0]["error"]["traceback"], records[0]["error"]
    assert "this rank (rank 1) could not reach the job's store" in records[1]["error"]["traceback"], records[1]["error"]
    assert "rank 0" not in records[1]["error"]["traceback"].split("shadowgba:", 1)[-1]  # the healthy host is not blamed
    _, rounds_after = job.between(0, down + 1, down + timeout_s - 1)
    assert rounds_after == 0, "the fault did not fire"


def test_a_servers_host_cut_off_ends_every_trainer_naming_the_server(tmp_path: Path) -> None:
    """GBA, a trainer on each of hosts 0 and 1 and the server on host 2, whose link goes down for
    good: each trainer ends naming ps0 within the timeout and a margin (no server restart is
    configured). One rank a host: torchrun's agent stops a host's other ranks once one of them
    exits with an error, which would cut a second trainer's own end short."""
    timeout_s = 6.0
    with Cluster(3, rate="1gbit") as cluster:
        job = FaultJob(cluster, [1, 1, 1], "gba.yaml", tmp_path, seconds=60,
                       extra=["--sync.timeout_s", str(timeout_s), "--sync.ps.rpc_timeout_s", str(timeout_s)])
        job.wait_for_rounds([0, 1], 5)
        cluster.link_down(2)
        down = time.time()
        outcomes = job.finish(90)
    records = [job.record(rank) for rank in range(3)]
    fault_table.record(f"a server's host cut off for good (sync.timeout_s {timeout_s:g}, no server restart)",
                       "gba, 2 trainers + 1 server, 3 hosts", exit_codes=[code for code, _ in outcomes],
                       ended_after_s=[record["ended_at"] - down for record in records],
                       said=[error_line(record) for record in records[:2]])
    for host in (0, 1):
        assert outcomes[host][0] == 1, outcomes[host][1][-3000:]
    server = job.record(2)  # it ends too: its trainers depart after the timeout, and it stops
    assert server["server"] and server["ended_at"] - down < 2 * timeout_s + 10, server
    for rank in range(2):
        record = job.record(rank)
        assert record["error"] is not None and "ps0" in record["error"]["message"], record["error"]
        assert record["ended_at"] - down < 2 * timeout_s + 10, record["ended_at"] - down
        assert job.between(rank, down + 1, down + timeout_s - 1)[1] == 0, "the fault did not fire"


def test_a_link_throttled_to_1_percent_is_a_network_straggler_the_other_host_trains_through(tmp_path: Path) -> None:
    """Host 1's link at 1% of 1 Gbit/s (10 Mbit/s) while ma trains a 1M-parameter MLP (4 MB a
    round): the rounds slow to the link's pace, and neither host's training waits for them.
    Compared with the same job's own steps before the throttle; the bound is loose (the 2 cores
    are shared by both hosts) but far above a job that waits for its rounds, where a step would
    take a 4 MB round at 10 Mbit/s (>= 3 s). A round across the throttled link has taken up to
    about 10 s (0.1 rounds/s), so the throttled window is twice that: a window of 10 s once held
    no round's end at all."""
    drain_s, throttled_s = 2.0, 20.0  # the link's queue drains, then the window measured
    with Cluster(2, rate="1gbit") as cluster:
        job = FaultJob(cluster, [1, 1], "ma.yaml", tmp_path, seconds=45, extra=["--width", "1024"])
        job.wait_for_rounds([0, 1], 5)
        fast = time.time()
        time.sleep(6)
        cluster.set_rate(1, "10mbit")
        slow = time.time()
        time.sleep(drain_s + throttled_s)
        cluster.set_rate(1, "1gbit")
        outcomes = job.finish(120)
    records = [job.record(rank) for rank in range(2)]
    before = [job.between(rank, fast, slow) for rank in range(2)]
    during = [job.between(rank, slow + drain_s, slow + drain_s + throttled_s) for rank in range(2)]
    fault_table.record(f"a host's link throttled to 1% (10 Mbit/s) for {drain_s + throttled_s:g} s (the last {throttled_s:g} s measured)",
                       "flat ma, 2 hosts x 1, 1M dense",
                       exit_codes=[code for code, _ in outcomes],
                       steps_per_s_before=[steps / (slow - fast) for steps, _ in before],
                       steps_per_s_throttled=[steps / throttled_s for steps, _ in during],
                       rounds_per_s_before=[rounds / (slow - fast) for _, rounds in before],
                       rounds_per_s_throttled=[rounds / throttled_s for _, rounds in during],
                       identical_replicas=records[0]["checksum"] == records[1]["checksum"])
    assert_finished(outcomes)
    assert records[0]["checksum"] == records[1]["checksum"]  # the final sync: identical replicas
    for rank, ((steps_before, rounds_before), (steps_during, rounds_during)) in enumerate(zip(before, during)):
        rate_before, rate_during = steps_before / (slow - fast), steps_during / throttled_s
        assert rounds_during >= 1, f"rank {rank}: no round while throttled"
        assert rounds_during / throttled_s < rounds_before / (slow - fast) / 3, \
            f"the fault did not fire: rank {rank}'s rounds kept their pace ({rounds_before}, then {rounds_during})"
        assert rate_during > 0.5 * rate_before, f"rank {rank} waited for the throttled link: {rate_before} -> {rate_during} steps/s"


@pytest.mark.parametrize("on_group_lost", ["fail", "continue"])
def test_2d_a_host_cut_off_past_the_timeout_ends_every_rank_naming_the_unreachable_ones(on_group_lost: str,
                                                                                         tmp_path: Path) -> None:
    """2 hosts x 2 ranks, one replica group a host; host 1 cut off for good while training (the
    harness's progress line on host 0 says it is). Host 1's ranks say they are cut off (each that
    ends on its own; torchrun's agent may stop the second). `on_group_lost: fail` (the default):
    host 0's ranks end too, naming ranks 2 and 3 (host 1's), within the timeout plus the notice
    board's bound and a margin. `continue`: host 0's group trains on to its last step and writes
    the result, without host 1's group."""
    from shadowgba.job.notices import NOTICE_TIMEOUT_S

    timeout_s, steps = 10.0, 2500
    bound_s = timeout_s + NOTICE_TIMEOUT_S + 60
    out = tmp_path / "out.json"
    with Cluster(2, rate="1gbit") as cluster:
        script = [str(ROOT / "benchmarks/train_dlrm.py"), "--config", str(ROOT / "examples/configs/ma_2d.yaml"),
                  "--output", str(out), *SMALL_RUN, "--train.steps", str(steps if on_group_lost == "continue" else 100000),
                  "--train.progress", "true", "--sync.timeout_s", str(timeout_s), "--sync.on_group_lost", on_group_lost]
        agents = cluster.torchrun(script, 2, env=environment(), log_dir=tmp_path, torchrun_args=["--tee", "3"])
        deadline = time.monotonic() + 120
        while "step " not in (tmp_path / "host0.log").read_text():  # trainer 0 has trained for 5 s
            assert time.monotonic() < deadline and all(agent.poll() is None for agent in agents), \
                (tmp_path / "host0.log").read_text()[-3000:]
            time.sleep(0.2)
        cluster.link_down(1)
        down = time.monotonic()
        if on_group_lost == "fail":
            codes = [agents[0].wait(timeout=bound_s)]  # host 1's agent waits in torchrun's exit barrier
        else:  # both agents wait in torchrun's exit barrier for the other host's (cut off): the result is the end
            while not out.exists() and time.monotonic() < down + 240:
                time.sleep(0.5)
        ended = time.monotonic() - down
        while "could not reach the job's store" not in (tmp_path / "host1.log").read_text() and time.monotonic() < down + bound_s:
            time.sleep(0.2)
        logs = [(tmp_path / f"host{host}.log").read_text() for host in range(2)]
    results = json.loads(out.read_text()) if out.exists() else None
    fault_table.record(f"a host's link down for good (sync.timeout_s {timeout_s:g}, on_group_lost {on_group_lost})",
                       "2D ma_2d, 2 hosts x 2 (a replica group a host)",
                       host0_exit_code=codes[0] if on_group_lost == "fail" else None,
                       ended_after_s=ended if on_group_lost == "fail" else None,
                       result_after_s=ended if results is not None else None,
                       host0_steps=None if results is None else results["steps_by_trainer"],
                       replica_groups_lost=None if results is None else results["sync"]["replica_groups_lost"])
    for host, log in enumerate(logs):
        for local in (0, 1):  # torchrun's --tee prefixes each rank's lines with [default<local rank>]
            said = "\n".join(line for line in log.splitlines() if line.startswith(f"[default{local}]"))
            if host == 1:
                if f"[rank{2 + local}]: shadowgba.errors" in said:  # it ended on its own, saying why
                    assert f"this rank (rank {2 + local}) could not reach the job's store" in said, said[-4000:]
            elif on_group_lost == "continue":  # host 0's ranks drop host 1's group (ranks 2, 3)
                assert "so replica group 1 (ranks 2, 3) is out" in said, said[-4000:]
            else:  # host 0's ranks name host 1's (ranks 2, 3), and never each other
                assert any(f"(rank {peer}) stopped its heartbeat" in said for peer in (2, 3)), said[-4000:]
                assert not any(f"(rank {peer}) stopped its heartbeat" in said for peer in (0, 1)), said[-4000:]
    # host 1's agent stops a rank's sibling once that rank exits with an error: the later of the two
    # may be stopped before it says anything (seen once), but the first one always ends on its own
    assert "could not reach the job's store" in logs[1], logs[1][-4000:]
    if on_group_lost == "fail":
        assert codes == [1], logs[0][-3000:]
        assert ended < timeout_s + NOTICE_TIMEOUT_S + 30, ended
        return
    assert results is not None, logs[0][-4000:]
    assert results["departed_trainers"] == [2, 3] and results["steps_by_trainer"] == [steps, steps], results
    assert results["sync"]["replica_groups_lost"] == 1, results["sync"]
    # host 0's two ranks hold identical dense replicas; their table shards have no replica left to compare
    assert results["dense_replica_max_abs_diff"] == 0.0 and results["table_replica_max_abs_diff"] is None, results
    assert "the rounds go on over ranks 0, 1" in logs[0], logs[0][-4000:]


@pytest.mark.parametrize(("kind", "failing"), [("kill", 0), ("fail", 1), ("term", 1), ("kill", 2), ("fail", 3),
                                               ("term", 3)])
def test_2d_one_torchrun_agent_per_group_the_survivors_of_either_groups_loss_write_the_result(
        kind: str, failing: int, tmp_path: Path) -> None:
    """2 hosts x 2 ranks, one torchrun agent a host and a replica group a host (`--nnodes 2`), ma,
    `sync.on_group_lost: continue`; host 0's agent serves the store the ranks met at. A rank of
    either group is killed, raises, or is SIGTERMed at step 20: its agent ends the group's other
    rank and exits at once (host 0's with its store); the other group agrees on the loss in the
    job's own store (`shadowgba.job.store`), trains to its last step, evaluates and writes the
    result."""
    steps, lost = 120, failing // 2
    fault_log, out = tmp_path / "faults.jsonl", tmp_path / "out.json"
    env = {**environment(), "SHADOWGBA_TEST_FAULTS": f"{kind}:{failing}:20", "SHADOWGBA_TEST_FAULT_LOG": str(fault_log)}
    script = [str(ROOT / "benchmarks/train_dlrm.py"), "--config", str(ROOT / "examples/configs/ma_2d.yaml"),
              "--output", str(out), *SMALL_RUN, "--train.steps", str(steps), "--sync.timeout_s", "10",
              "--sync.on_group_lost", "continue"]
    with Cluster(2) as cluster:
        agents = cluster.torchrun(script, 2, env=env, log_dir=tmp_path, torchrun_args=["--tee", "3"])
        lost_exit = agents[lost].wait(timeout=240)
        deadline = time.monotonic() + 120  # the surviving agent then waits in torchrun's exit barrier
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        logs = [(tmp_path / f"host{host}.log").read_text() for host in range(2)]
    fired = [json.loads(line) for line in fault_log.read_text().splitlines()]
    assert [(event["kind"], event["trainer"], event["step"]) for event in fired] == [(kind, failing, 20)]
    assert lost_exit == 1, logs[lost][-3000:]
    if kind == "fail":  # the user's exception, on the rank that raised it
        raised = [line for line in logs[lost].splitlines() if line.startswith(f"[default{failing % 2}]")]
        assert any("InjectedFailure" in line for line in raised), logs[lost][-3000:]
    survivor = logs[1 - lost]
    assert f"so replica group {lost} (ranks {2 * lost}, {2 * lost + 1}) is out" in survivor, survivor[-4000:]
    assert "could not reach the job's store" not in survivor, survivor[-4000:]
    assert out.exists(), survivor[-4000:]
    results = json.loads(out.read_text())
    assert results["departed_trainers"] == [2 * lost, 2 * lost + 1], results
    assert results["steps_by_trainer"] == [steps, steps] and results["sync"]["replica_groups_lost"] == 1, results
    assert results["dense_replica_max_abs_diff"] == 0.0 and 0.5 < results["auc"] < 1.0, results
