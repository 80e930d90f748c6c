"""The example end to end under torchrun: single node, and two agents rendezvousing over c10d."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shadowgba.config import load_config
from tests.multiprocess import free_port

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
SMALL_RUN = [
    "--train.steps", "400", "--train.warmup_steps", "20", "--train.progress", "false",
    "--data.eval_batches", "16", "--sync.interval_ms", "20",
]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def run_example(launcher_args: list[str], config: str, output: Path, extra: list[str] = ()) -> subprocess.Popen:
    command = torchrun(
        *launcher_args, str(ROOT / "examples/train_dlrm.py"),
        "--config", str(ROOT / "examples/configs" / config), "--output", str(output), *SMALL_RUN, *extra,
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout_s: float = 240) -> str:
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError(f"torchrun hung:\n{output[-4000:]}") from None
    assert process.returncode == 0, output[-4000:]
    return output


def test_two_rank_bmuf_run_ends_with_identical_replicas_and_a_useful_model(tmp_path: Path) -> None:
    output = tmp_path / "bmuf.json"
    log = finish(run_example(["--standalone", "--nproc_per_node=2"], "bmuf.yaml", output))
    results = json.loads(output.read_text())
    assert results["world_size"] == 2 and results["steps"] == 400
    assert results["dense_replica_max_abs_diff"] == 0.0  # final sync: replicas identical
    assert results["sync"]["rounds"] > 10
    # a constant predictor scores AUC 0.5; the planted teacher bounds what is reachable
    assert results["auc"] > 0.65, results
    assert results["auc"] <= results["teacher_auc"] + 0.01
    assert "auc:" in log and "samples_per_s_total:" in log


def test_two_torchrun_agents_rendezvous_over_c10d_and_train_together(tmp_path: Path) -> None:
    """As across machines: one agent per 'node', c10d rendezvous on loopback."""
    endpoint = f"127.0.0.1:{free_port()}"
    launcher = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", "--rdzv_id=shadowgba-test"]
    outputs = [tmp_path / "node0.json", tmp_path / "node1.json"]
    agents = [run_example(launcher, "easgd.yaml", output) for output in outputs]
    for agent in agents:
        finish(agent)
    written = [json.loads(path.read_text()) for path in outputs if path.exists()]
    assert len(written) == 1, "exactly one agent hosts global rank 0, which writes the results"
    (results,) = written
    assert results["world_size"] == 2
    assert results["dense_replica_max_abs_diff"] == 0.0
    assert results["sync"]["rounds"] > 10


def test_a_bad_config_fails_before_any_process_group_with_the_key_named(tmp_path: Path) -> None:
    process = run_example(["--standalone", "--nproc_per_node=1"], "bmuf.yaml", tmp_path / "x.json", ["--sync.algo", "sgdx"])
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "config error: sync.algo: unknown algorithm 'sgdx'; allowed:" in output


@pytest.mark.parametrize("path", sorted((ROOT / "examples/configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from train_dlrm import ExperimentConfig
    finally:
        sys.path.remove(str(ROOT / "examples"))
    config = load_config(ExperimentConfig, path)
    assert config.sync.algo == path.stem
