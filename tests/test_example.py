"""The example end to end under torchrun: single node, and two agents rendezvousing over c10d."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shadowgba.config import ConfigError, load_config
from tests.multiprocess import free_port

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
SMALL_RUN = [
    "--train.steps", "400", "--train.warmup_steps", "20", "--train.progress", "false",
    "--data.synthetic.eval_batches", "16", "--sync.interval_ms", "20",
]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def run_example(launcher_args: list[str], config: str, output: Path, extra: list[str] = ()) -> subprocess.Popen:
    command = torchrun(
        *launcher_args, str(ROOT / "benchmarks/train_dlrm.py"),
        "--config", str(ROOT / "examples/configs" / config), "--output", str(output), *SMALL_RUN, *extra,
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout_s: float = 240) -> str:
    """The output of `process`, which must exit 0 within `timeout_s` (else it is killed)."""
    failure, output = wait(process, timeout_s)
    assert failure is None, f"torchrun {failure}:\n{output[-4000:]}"
    return output


def finish_together(processes: list[subprocess.Popen], timeout_s: float = 240) -> list[str]:
    """The outputs of all `processes`, waited for at once; if any fails or hangs, report every one's
    output tail (a torchrun agent that hangs usually waits in its exit barrier for another agent)."""
    with ThreadPoolExecutor(len(processes)) as pool:
        outcomes = list(pool.map(lambda process: wait(process, timeout_s), processes))
    if any(failure for failure, _ in outcomes):
        raise AssertionError("\n".join(
            f"--- process {index}: {failure or 'exited 0'} ---\n{output[-3000:]}"
            for index, (failure, output) in enumerate(outcomes)
        ))
    return [output for _, output in outcomes]


def wait(process: subprocess.Popen, timeout_s: float) -> tuple[str | None, str]:
    """(why `process` failed or hung, or None if it exited 0; its output). A hung process is killed."""
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        return f"hung for {timeout_s:.0f} s", output
    return (None if process.returncode == 0 else f"exited {process.returncode}"), output


@pytest.fixture(scope="module")
def two_agents(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One 2-rank BMUF run launched as across machines: one torchrun agent per 'node', c10d rendezvous
    on loopback. Both tests below read it (one torchrun start-up, not two); each agent is told its
    own output path, and only the one hosting global rank 0 writes."""
    endpoint = f"127.0.0.1:{free_port()}"
    launcher = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", "--rdzv_id=shadowgba-test"]
    directory = tmp_path_factory.mktemp("two_agents")
    outputs = [directory / "node0.json", directory / "node1.json"]
    logs = finish_together([run_example(launcher, "bmuf.yaml", output) for output in outputs])
    return {"written": [path for path in outputs if path.exists()], "log": "\n".join(logs)}


def test_two_rank_bmuf_run_ends_with_identical_replicas_and_a_useful_model(two_agents: dict) -> None:
    (output,) = two_agents["written"]
    log = two_agents["log"]
    results = json.loads(output.read_text())
    assert results["world_size"] == 2 and results["steps"] == 400
    assert results["dense_replica_max_abs_diff"] == 0.0  # final sync: replicas identical
    assert results["sync"]["rounds"] > 10
    # a constant predictor scores AUC 0.5; the planted teacher bounds what is reachable
    assert results["auc"] > 0.65, results
    assert results["auc"] <= results["teacher_auc"] + 0.01
    assert "held-out     AUC" in log and "samples/s" in log and f"full record  {output}" in log


def test_two_torchrun_agents_rendezvous_over_c10d_and_train_together(two_agents: dict) -> None:
    """As across machines: one agent per 'node', c10d rendezvous on loopback."""
    written = [json.loads(path.read_text()) for path in two_agents["written"]]
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


def experiment_config(path: Path | None = None, overrides: list[str] = ()) -> object:
    from dlrm.config import ExperimentConfig

    return load_config(ExperimentConfig, path, overrides)


GBA_CONFIGS = {"gba", "gba_ps_embeddings", "sync_allreduce", "async_ps"}
TWO_D_CONFIGS = {"bmuf_2d": "bmuf", "ma_2d": "ma", "torchrec_2d": "torchrec_2d"}
"""The 2D layout's configs (`sync.sharding_group_size`) and what keeps their replicas together."""


@pytest.mark.parametrize("path", sorted((ROOT / "examples/configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    config = experiment_config(path)
    assert config.algo == ("gba" if path.stem in GBA_CONFIGS else TWO_D_CONFIGS.get(path.stem, path.stem))
    assert (config.sync.sharding_group_size == 2) == (path.stem in TWO_D_CONFIGS)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--sync.ps.num_servers", "1"], "sync.ps.num_servers: parameter servers need sync.algo gba or easgd_ps, not 'ma'"),
        (["--model.embeddings", "ps"], "model.embeddings: ps needs sync.algo gba or easgd_ps and sync.ps.num_servers >= 1"),
        (["--sync.algo", "easgd_ps"], "sync.ps.num_servers: sync.algo easgd_ps keeps the EASGD centre on the servers"),
        (["--sync.algo", "gba"], "sync.ps.num_servers: sync.gba.initial_mode gba needs at least one parameter server"),
        (["--train.global_samples", "100"], "train.global_samples: counted by the GBA global step; needs sync.algo"),
        (["--baseline", "pma", "--sync.algo", "gba", "--sync.gba.initial_mode", "sync", "--sync.ps.num_servers", "1"],
         "sync.ps.num_servers: the pma baseline runs without parameter servers"),
        (["--sync.algo", "gba", "--sync.ps.num_servers", "1", "--model.embeddings", "ps"],
         "train.embedding_optimizer: PS tables support sgd and rowwise_adagrad, not adagrad"),
    ],
)
def test_combinations_that_cannot_run_are_refused_naming_the_keys(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        experiment_config(overrides=overrides)
