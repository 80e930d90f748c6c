"""Checkpoints and exact resume (shadowgba.checkpoint, the harness's --checkpoint-dir / --resume).

Spawned jobs are shared where the assertions are independent: one 2-rank job runs every exact-resume
case without servers (uninterrupted vs stopped-and-resumed, per algorithm) and then the refusal
cases; one 3-rank group runs the cases with parameter servers, the PS-table round trip and
tests/test_batches.py's malformed batches on a tiny DMP; two
torchrun jobs with a trainer killed mid-run (one with a parameter server) cover restart and resume.

Jobs with servers are asynchronous by design; the deterministic configuration in which a run is
reproducible, and so can be compared with a stopped-and-resumed one, is (`_server_run`):
- gba in GBA mode, 2 trainers + 1 server, global-batch aggregation: after each step every trainer
  waits until it holds the parameters of that step's global step (`GBASync.wait_for_global_step`),
  i.e. zero staleness, so every global batch holds exactly that step's two pushes (a sum of two is
  the same in either order); with PS tables each trainer also flushes its row pushes and the
  trainers meet in a barrier, so the next lookup reads the rows after that global batch was applied.
  Fixed seeds, one torch thread. Then resumed at step k, in a new job, from the uninterrupted run's
  checkpoint of step k (what a run stopped there saves) == uninterrupted, for the dense
  weights, the TorchRec-sharded tables and their fused Adagrad state, the PS tables with their
  row-wise Adagrad accumulators, buffers and counters, and the dense shards' parameters, Adam state
  and global step.
- easgd_ps (S-EASGD), 1 trainer + 2 servers, foreground rounds, Hogwild PS tables flushed every
  step: reproducible, and exact the same way, the EASGD centre included (gathered from both servers'
  slices by `Job.centre()`, a `Stateful`, and loaded back onto them). The same job checks that the
  centre refuses a state of another server count, another length or holding NaN, changing nothing.
  Over TorchRec-sharded tables too (`easgd_ps_torchrec`): its dense optimizer is TorchRec's
  `KeyedOptimizerWrapper`, which a resuming job loads before its first step.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiprocess import run_ranks, run_shared

REPO = Path(__file__).resolve().parents[1]
STEPS, STOP_AT = 8, 4
SMALL = [
    "--train.warmup_steps", "0", "--train.progress", "false", "--sync.foreground_every", "2",
    "--sync.first_round_after", "0",
    "--data.synthetic.num_tables", "3", "--data.synthetic.num_embeddings", "100",
    "--data.synthetic.batch_size", "32", "--data.synthetic.eval_batches", "2",
    "--data.synthetic.calibration_samples", "2048",
]
EXACT_CASES = {
    "ma": ["--config", "examples/configs/ma.yaml", "--sync.mode", "foreground", "--sync.foreground_every", "3"],
    "easgd": ["--config", "examples/configs/easgd.yaml", "--sync.mode", "foreground", "--sync.foreground_every", "3"],
    "bmuf": ["--config", "examples/configs/bmuf.yaml", "--sync.mode", "foreground", "--sync.foreground_every", "3"],
    "gba_sync": ["--config", "examples/configs/sync_allreduce.yaml"],
}
ASYNC_CASES = {"ma", "gba_sync"}
"""Cases whose checkpoints are written in the background (dcp.async_save), committed at the next save or close."""


def _config(args: list[str], steps: int) -> Any:
    from dlrm.config import ExperimentConfig
    from shadowgba.config import load_config

    path = Path(args[1])
    return load_config(ExperimentConfig, REPO / path, [*args[2:], *SMALL, "--train.steps", str(steps)])


def _trainer_entries(path: Path, world_size: int) -> dict[str, Any]:
    """Every trainer's own blobs of one checkpoint (replica, optimizers, runtime), read with DCP alone."""
    import torch.distributed.checkpoint as dcp

    from shadowgba.serialized import state_from_bytes

    template = {
        part: {f"trainer{rank}": b"" for rank in range(world_size)} for part in ("model", "dense_optimizer", "sync")
    }
    dcp.load(template, checkpoint_id=str(path), no_dist=True)
    return {part: {key: state_from_bytes(blob, key) for key, blob in blobs.items()} for part, blobs in template.items()}


def _max_abs_diff(first: Any, second: Any) -> float:
    if isinstance(first, torch.Tensor):
        if not first.is_floating_point():
            return 0.0 if torch.equal(first, second) else float("inf")
        return (first - second).abs().max().item() if first.numel() else 0.0
    if isinstance(first, dict):
        assert sorted(map(str, first)) == sorted(map(str, second))
        return max((_max_abs_diff(first[key], second[key]) for key in first), default=0.0)
    if isinstance(first, (list, tuple)):
        assert len(first) == len(second)
        return max((_max_abs_diff(a, b) for a, b in zip(first, second)), default=0.0)
    return 0.0 if first == second else float("inf")


def _shared_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Rank body: every exact-resume case, then the refusal cases."""
    import torch.distributed as dist
    from train_dlrm import run

    from dlrm.checkpoints import CheckpointOptions

    torch.set_num_threads(1)
    out: dict[str, Any] = {"exact": {}}
    for name, args in EXACT_CASES.items():
        whole, split = Path(root, name, "whole"), Path(root, name, "split")
        background = name in ASYNC_CASES
        full = run(_config(args, STEPS), torch.device("cpu"), "gloo",
                   CheckpointOptions(whole, STOP_AT, async_save=background))
        run(_config(args, STOP_AT), torch.device("cpu"), "gloo", CheckpointOptions(split, STOP_AT, async_save=background))
        resumed = run(_config(args, STEPS), torch.device("cpu"), "gloo",
                      CheckpointOptions(split, STOP_AT, resume=True, async_save=background))
        case = {"full": full, "resumed": resumed}
        if rank == 0:
            a = _trainer_entries(whole / f"step_{STEPS:08d}", world_size)
            b = _trainer_entries(split / f"step_{STEPS:08d}", world_size)
            case["diff"] = {part: _max_abs_diff(a[part], b[part]) for part in a}
            case["moved"] = _max_abs_diff(a["model"], _trainer_entries(whole / f"step_{STOP_AT:08d}", world_size)["model"])
        out["exact"][name] = {key: value for key, value in case.items() if key not in ("full", "resumed")}
        out["exact"][name]["results"] = {
            key: {field: value[field] for field in ("steps", "steps_this_run", "log_loss", "samples_computed_total")}
            | {"resumed_from": value["checkpoint"]["resumed_from_step"]}
            for key, value in (("full", full), ("resumed", resumed))
        }
        dist.barrier()
    out["refusals"] = _refusals(rank, Path(root, "refusals"))
    return out


def _refusals(rank: int, directory: Path) -> dict[str, Any]:
    """Corrupted, truncated, other-setup and half-written checkpoints: refused, the previous one loads."""
    import torch.distributed as dist

    from shadowgba.checkpoint import Checkpointer, PerTrainer, Setup, TrainState
    from shadowgba.errors import CheckpointError

    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 3)
    setup = Setup.of("ma", model.named_parameters(), 2, 0)
    checkpointer = Checkpointer(directory, setup, keep_last=3, process_group=dist.group.WORLD)
    train = TrainState(rank)
    state = {"model": PerTrainer(model, rank), "train": train}
    saved = {}
    for step in (2, 4, 6):
        with torch.no_grad():
            model.weight.fill_(step + rank)
        train.step = step
        checkpointer.save(step, state)
        saved[step] = model.weight.clone()
    out: dict[str, Any] = {"kept": [step for step, _ in checkpointer.checkpoints()]}
    # corrupt step 6 (one flipped byte), truncate step 4: load_latest falls back to step 2
    if rank == 0:
        data_file = sorted(checkpointer.path_of(6).glob("*.distcp"))[0]
        raw = bytearray(data_file.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data_file.write_bytes(bytes(raw))
        truncated = sorted(checkpointer.path_of(4).glob("*.distcp"))[-1]
        truncated.write_bytes(truncated.read_bytes()[:-7])
        # a crashed save leaves a temporary folder; it is never loaded
        (directory / ".tmp-step_00000008").mkdir()
    dist.barrier()
    for step in (6, 4):
        try:
            checkpointer.load(checkpointer.path_of(step), state)
            out[f"load_{step}"] = "loaded"
        except CheckpointError as error:
            out[f"load_{step}"] = str(error)
    with torch.no_grad():
        model.weight.zero_()
    out["latest"] = checkpointer.load_latest(state)
    out["restored"] = torch.equal(model.weight, saved[2]) and train.step == 2
    # a checkpoint of another setup: refused naming the difference, by load and load_latest
    for label, other in {
        "algo": Setup.of("bmuf", model.named_parameters(), 2, 0),
        "trainers": Setup("ma", setup.dense, 4, 0),
        "servers": Setup("ma", setup.dense, 2, 1),
        "dense": Setup("ma", (("weight", 12), ("bias", 4)), 2, 0),
    }.items():
        foreign = Checkpointer(directory, other, process_group=dist.group.WORLD)
        try:
            foreign.load_latest(state)
            out[f"setup_{label}"] = "loaded"
        except CheckpointError as error:
            out[f"setup_{label}"] = str(error)
    out["still_loads"] = checkpointer.load(checkpointer.path_of(2), state)
    out["tmp_left"] = sorted(path.name for path in directory.glob(".tmp-*"))
    # every kept checkpoint damaged (step 2's metadata truncated too): a resume fails, listing each
    if rank == 0:
        meta = checkpointer.path_of(2) / "shadowgba.json"
        meta.write_text(meta.read_text()[:20])
    dist.barrier()
    try:
        out["all_damaged"] = checkpointer.load_latest(state)
    except CheckpointError as error:
        out["all_damaged"] = str(error)
    train.step = 99
    out["fresh_start"] = checkpointer.load_latest(state, allow_fresh_start=True), train.step
    return out


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ranks(_shared_job, 2, str(tmp_path_factory.mktemp("ckpt")), timeout_s=150)[0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("algo", list(EXACT_CASES))
def test_a_run_stopped_and_resumed_ends_exactly_where_an_uninterrupted_one_does(shared: dict, algo: str) -> None:
    case = shared["exact"][algo]
    full, resumed = case["results"]["full"], case["results"]["resumed"]
    assert resumed["resumed_from"] == STOP_AT and full["resumed_from"] is None
    assert full["steps"] == resumed["steps"] == STEPS and resumed["steps_this_run"] == STEPS - STOP_AT
    assert resumed["samples_computed_total"] == full["samples_computed_total"]
    assert case["moved"] > 1e-4  # the steps after the checkpoint did change the replicas
    for part, diff in case["diff"].items():  # every trainer's replica, dense optimizer and runtime state
        assert diff <= 1e-6, f"{algo}: {part} differs by {diff}"
    assert resumed["log_loss"] == pytest.approx(full["log_loss"], abs=1e-6)


@pytest.mark.timeout(180)
def test_corrupted_and_truncated_checkpoints_are_refused_and_the_previous_one_loads(shared: dict) -> None:
    refusals = shared["refusals"]
    assert refusals["kept"] == [2, 4, 6]
    assert "step_00000006 is corrupted" in refusals["load_6"] and "CRC-32" in refusals["load_6"]
    assert "step_00000004 is truncated" in refusals["load_4"]
    assert refusals["latest"] == 2 and refusals["restored"]
    assert refusals["still_loads"] == 2


@pytest.mark.timeout(180)
def test_a_resume_with_every_checkpoint_corrupted_fails_listing_each_unless_a_fresh_start_is_allowed(
        shared: dict) -> None:
    refusals = shared["refusals"]
    damaged = refusals["all_damaged"]
    assert isinstance(damaged, str) and "none of the 3 checkpoints" in damaged and "start over from step 0" in damaged
    assert "allow_fresh_start=True" in damaged  # the error names the way out
    assert "step_00000006 is corrupted" in damaged and "step_00000004 is truncated" in damaged
    assert "step_00000002 is corrupted or incomplete: cannot read shadowgba.json" in damaged
    assert refusals["fresh_start"] == (None, 99)  # nothing loaded, nothing changed


@pytest.mark.timeout(180)
def test_a_checkpoint_of_another_setup_is_refused_naming_the_difference(shared: dict) -> None:
    refusals = shared["refusals"]
    assert "sync algo 'ma', this job runs 'bmuf'" in refusals["setup_algo"]
    assert "made by 2 trainers, this job has 4" in refusals["setup_trainers"]
    assert "0 parameter servers, this job has 1" in refusals["setup_servers"]
    assert "dense parameter 1 is bias (3 elements) there, bias (4 elements) here" in refusals["setup_dense"]
    assert refusals["tmp_left"] == []  # a new Checkpointer removes what a crashed save left


def _killed_and_restarted(tmp_path: Path, nproc: int, config: list[str], kill: str) -> tuple[list, dict, Path]:
    """A torchrun job (`--max-restarts=1`, checkpoints every 10 of 30 steps, `--resume`) whose trainer
    `kill` names SIGKILLs itself: the fault records and rank 0's results of the restarted attempt."""
    from tests.multiprocess import free_port

    output, fault_log, directory = tmp_path / "results.json", tmp_path / "faults.jsonl", tmp_path / "ckpt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}", "--max-restarts=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.5",
        "benchmarks/train_dlrm.py", *config, *SMALL,
        "--train.steps", "30", "--checkpoint-dir", str(directory), "--checkpoint-every", "10", "--resume",
        "--output", str(output),
    ]
    env = {**os.environ, "SHADOWGBA_TEST_KILL_AT_STEP": kill, "SHADOWGBA_TEST_FAULT_LOG": str(fault_log),
           "OMP_NUM_THREADS": "1"}
    process = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=130)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    fired = [json.loads(line) for line in fault_log.read_text().splitlines()]
    return fired, json.loads(output.read_text()), directory


def _kill_of(record: dict[str, Any]) -> dict[str, Any]:
    """A fault record without what differs from run to run (pid, time)."""
    return {key: record.get(key) for key in ("kind", "trainer", "step", "restart_count")}


@pytest.mark.timeout(150)
def test_a_killed_trainer_restarts_under_torchrun_and_finishes_from_its_checkpoint(tmp_path: Path) -> None:
    fired, results, directory = _killed_and_restarted(
        tmp_path, 2, ["--config", "examples/configs/bmuf.yaml", "--sync.mode", "foreground"], "1:15")
    assert [_kill_of(record) for record in fired] == [{"kind": "kill", "trainer": 1, "step": 15, "restart_count": 0}]
    assert results["restart_count"] == 1
    assert results["checkpoint"]["resumed_from_step"] == 10
    assert results["steps"] == 30 and results["steps_this_run"] == 20
    assert results["samples_computed_total"] == 30 * 32 * 2
    assert results["dense_replica_max_abs_diff"] == 0.0
    assert sorted(path.name for path in directory.iterdir()) == ["step_00000020", "step_00000030"]


@pytest.mark.timeout(150)
def test_a_parameter_server_job_restarts_under_torchrun_and_finishes_from_its_checkpoint(tmp_path: Path) -> None:
    """GBA with PS-hosted tables, 2 trainers + 1 server: the restarted attempt's RPC rendezvous must not
    read the dead attempt's addresses in torchrun's agent store (`shadowgba.job.rendezvous.attempt_store`)."""
    fired, results, directory = _killed_and_restarted(
        tmp_path, 3, ["--config", "examples/configs/gba_ps_embeddings.yaml"], "0:15")
    assert [_kill_of(record) for record in fired] == [{"kind": "kill", "trainer": 0, "step": 15, "restart_count": 0}]
    assert results["restart_count"] == 1 and (results["trainers"], results["servers"]) == (2, 1)
    assert results["checkpoint"]["resumed_from_step"] == 10
    assert results["steps"] == 30 and results["steps_this_run"] == 20
    assert sorted(path.name for path in directory.iterdir()) == ["step_00000020", "step_00000030"]


# ---------------------------------------------------------------------------------- PS-hosted tables
def _ps_tables() -> list:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [EmbeddingBagConfig(name="users", num_embeddings=9, embedding_dim=4, feature_names=["user"]),
            EmbeddingBagConfig(name="items", num_embeddings=5, embedding_dim=3, feature_names=["item"])]


def _ps_batch(step: int) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ids = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(step))
    return KeyedJaggedTensor.from_lengths_sync(keys=["user", "item"], values=torch.cat([ids + 4, ids]),
                                               lengths=torch.ones(16, dtype=torch.int32))


PS_OPTIONS = dict(optimizer="rowwise_adagrad", lr=0.1, mode="aggregate", global_batch=12)
"""Row-wise Adagrad (accumulators to restore) in aggregate mode with a global batch of 1.5 pushes,
so that a checkpoint holds a half-full GBA buffer."""


def test_an_embedding_shard_exports_and_imports_everything_and_refuses_another_layout() -> None:
    from shadowgba.ps.embedding_shard import EmbeddingShard, PSEmbeddingConfig

    config = PSEmbeddingConfig(**PS_OPTIONS)
    shard = EmbeddingShard(_ps_tables(), config, 1, 2)
    for token in (0, 0, 1):
        shard.push({"users": (torch.tensor([1, 3, 3]), torch.ones(3, 4)), "items": (torch.tensor([1]), torch.ones(1, 3))},
                   8, token)
    exported = shard.export_state()
    copy = EmbeddingShard(_ps_tables(), PSEmbeddingConfig(**{**PS_OPTIONS, "seed": 5}), 1, 2)
    copy.import_state(exported)
    assert copy.stats() == shard.stats() and copy.stats()["pending_samples"] == 8
    assert _max_abs_diff(copy.export_state()["tables"], exported["tables"]) == 0.0
    other = EmbeddingShard(_ps_tables(), config, 0, 2)
    before = other.export_state()
    with pytest.raises(ValueError, match="import refused: state of shard layout .*'server_index': 1"):
        other.import_state(exported)
    assert _max_abs_diff(other.export_state()["tables"], before["tables"]) == 0.0


def _ps_job(rank: int, world_size: int, directory: str) -> dict[str, Any] | None:
    """1 trainer + 2 servers: train, checkpoint, train on, restore: tables and shard state as saved."""
    from shadowgba.checkpoint import Checkpointer, Setup, TrainState
    from shadowgba.ps.embedding import PSEmbeddingBagCollection
    from shadowgba.ps.embedding_shard import DEFAULT_SERVICE, EmbeddingShard, PSEmbeddingConfig
    from shadowgba.ps.start import start_transport

    config = PSEmbeddingConfig(**PS_OPTIONS)
    ps = start_transport(num_servers=2)
    roles = ps.roles
    if roles.is_server:
        ps.serve(DEFAULT_SERVICE, EmbeddingShard(_ps_tables(), config, roles.server_index, roles.num_servers))
        ps.stop()
        return None
    ebc = PSEmbeddingBagCollection(_ps_tables(), config, ps)

    def steps(first: int, last: int) -> None:
        for step in range(first, last):
            ebc(_ps_batch(step)).values().square().sum().backward()
            ebc.push_gradients()

    checkpointer = Checkpointer(directory, Setup("gba", (), 1, 2), process_group=roles.trainer_group)
    state = {"ps_embeddings": ebc, "train": TrainState(0)}
    steps(0, 3)
    checkpointer.save(3, state)
    saved = {name: ebc.read_table(name) for name in ("users", "items")}
    saved_stats = ebc.server_stats()
    steps(3, 6)
    ebc.flush()
    moved = max((ebc.read_table(name) - saved[name]).abs().max().item() for name in saved)
    loaded = checkpointer.load_latest(state)
    restored = max((ebc.read_table(name) - saved[name]).abs().max().item() for name in saved)
    out = {"loaded": loaded, "moved": moved, "restored": restored, "saved_stats": saved_stats,
           "stats": ebc.server_stats(), "nested": list(torch.nn.Sequential(ebc).state_dict())}
    ps.stop()
    return out



# ------------------------------------------------------------ exact resume in jobs with parameter servers
SERVER_STEPS, SERVER_STOP_AT = 6, 3
SERVER_CASES: dict[str, dict[str, Any]] = {
    "gba_torchrec": {"algo": "gba", "gba": {"initial_mode": "gba", "aggregation": "global_batch"},
                     "ps": {"num_servers": 1}},
    "gba_ps": {"algo": "gba", "gba": {"initial_mode": "gba", "aggregation": "global_batch"}, "ps": {"num_servers": 1}},
    "sync_ps": {"algo": "gba", "gba": {"initial_mode": "sync"}, "ps": {"num_servers": 1}},
    "easgd_ps": {"algo": "easgd_ps", "mode": "foreground", "foreground_every": 2, "first_round_after": 0,
                 "ps": {"num_servers": 2}},
    "easgd_ps_torchrec": {"algo": "easgd_ps", "mode": "foreground", "foreground_every": 2, "first_round_after": 0,
                          "ps": {"num_servers": 2}},
}
"""gba in GBA mode over TorchRec-sharded tables and over PS tables, gba in sync all-reduce mode over PS
tables (2 trainers + 1 server; sync mode over TorchRec tables is `EXACT_CASES`' gba_sync), and
easgd_ps over PS tables and over TorchRec-sharded ones (1 trainer + 2 servers: with two trainers
their exchanges with the centre would race), each on the 3 ranks of the shared group."""
PS_TABLE_CASES = {"gba_ps", "sync_ps", "easgd_ps"}


def _plain(value: Any) -> Any:
    """`value` with sharded tensors as their local shards, serialized shard states decoded and objects
    as their fields: what this trainer holds, comparable with `_max_abs_diff`."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from shadowgba.serialized import state_from_bytes

    if isinstance(value, ShardedTensor):
        return [shard.tensor.detach().clone() for shard in value.local_shards()]
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (bytes, bytearray)):
        return _plain(state_from_bytes(value, "a serialized state"))
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if hasattr(value, "__dict__"):  # a shard's counters (e.g. StalenessCounts): compared by their fields
        return {"type": type(value).__name__, **_plain(vars(value))}
    return value


def _held_state(model: Any, optimizer: Any, sync: Any, tables: Any, centre: Any) -> dict[str, Any]:
    """Everything a resume must restore, as this trainer sees it: dense weights and its shards of the
    TorchRec tables, their fused optimizer state, the dense optimizer, the sync runtime's state (GBA:
    the dense shards' parameters, optimizer state and global step), the PS tables with their
    accumulators, buffers and counters and the S-EASGD centre (both gathered by trainer 0)."""
    state = {"model": _plain(model.state_dict()), "dense_optimizer": _plain(optimizer.state_dict()),
             "sync": _plain(sync.state_dict())}
    if hasattr(model, "fused_optimizer"):
        state["table_optimizer"] = _plain(model.fused_optimizer.state_dict())
    if tables is not None:
        state["ps_tables"] = _plain(tables.state_dict())
    if centre is not None:
        state["centre"] = _plain(centre.state_dict())
    return state


def _server_run(case: str, directory: Path, last: int, resume: bool) -> dict[str, Any] | None:
    """One run of `case` up to step `last`, checkpointing every SERVER_STOP_AT steps (from the latest
    checkpoint with `resume`); what the trainer held at the checkpoint it resumed from, at step
    SERVER_STOP_AT and at the end. Deterministic (module docstring): each step ends when every trainer
    holds the parameters of that step's global step, and, with PS tables, when every row push has landed."""
    import torch.distributed as dist

    import shadowgba
    from shadowgba.checkpoint import Checkpointer, ModelState, PerTrainer, Setup, TrainState
    from shadowgba.config import SyncConfig, from_dict
    from shadowgba.integrations.torchrec import dense_named_parameters
    from tests import tiny_dmp

    config = from_dict(SyncConfig, SERVER_CASES[case])
    trainers = dist.get_world_size() - config.ps.num_servers
    ps = case in PS_TABLE_CASES
    options = shadowgba.ps_table_options(config, trainers, tiny_dmp.BATCH, "rowwise_adagrad", 0.1) if ps else None
    job = shadowgba.join(config, tiny_dmp.table_configs() if ps else None, options)
    if job.is_server:
        return None
    try:
        index = job.trainer_index
        if ps:
            tables = job.ps_embeddings()
            torch.manual_seed(dist.get_rank())
            model = tiny_dmp.TinyRec(tables)
            optimizer = tiny_dmp.dense_optimizer(model.parameters(), stateful=True)
        else:
            tables = None
            model, optimizer = tiny_dmp.build(dmp_kwargs=job.dmp_kwargs(), stateful_optimizers=True)
        sync = shadowgba.dense_sync(model, optimizer, job, local_batch_size=tiny_dmp.BATCH, end_job=False)
        centre = job.centre() if config.algo == "easgd_ps" else None
        setup = Setup.of(config.algo, dense_named_parameters(model), trainers, config.ps.num_servers)
        checkpointer = Checkpointer(directory, setup, keep_last=3, process_group=job.trainer_group)
        train = TrainState(index)
        state: dict[str, Any] = {"model": ModelState(model, index), "dense_optimizer": PerTrainer(optimizer, index)}
        state.update({"embedding_optimizer": model.fused_optimizer} if tables is None else {"ps_embeddings": tables})
        state["sync"] = PerTrainer(sync, index)
        state.update({} if centre is None else {"centre": centre})
        state["train"] = train
        out: dict[str, Any] = {}
        with sync:
            if resume:
                out["resumed_from"] = checkpointer.load_latest(state)
                out["at_load"] = _held_state(model, optimizer, sync, tables, centre)
                dist.barrier(group=job.trainer_group)  # as at SERVER_STOP_AT below: nobody pushes while it is read
            for step in range(train.step, last):
                optimizer.zero_grad()
                loss, _ = model(tiny_dmp.batch(index, step))
                loss.backward()
                if tables is not None:
                    tables.push_gradients()
                optimizer.step()
                if tables is not None:
                    tables.flush()  # this trainer's row gradients have reached the shards
                    dist.barrier(group=job.trainer_group)  # everyone's: the global batch of rows is applied
                if config.algo == "gba":
                    sync.wait_for_global_step(step + 1)  # every trainer holds the parameters of this step
                train.step = step + 1
                if train.step % SERVER_STOP_AT == 0:
                    checkpointer.save(train.step, state)
                if train.step == SERVER_STOP_AT:
                    out["at_stop"] = _held_state(model, optimizer, sync, tables, centre)
                    # no trainer's next rows may reach the servers while trainer 0 reads their state (seen:
                    # 14 rows of step SERVER_STOP_AT + 1 pending in at_stop, none in the checkpoint)
                    dist.barrier(group=job.trainer_group)
            out["final"] = _held_state(model, optimizer, sync, tables, centre)
            if resume:
                out |= _fallback(checkpointer, state, directory, setup)
                if centre is not None:
                    out["centre_refusals"] = _centre_refusals(centre)
                out["after_fallback"] = _held_state(model, optimizer, sync, tables, centre)
        return out
    finally:
        job.close()


def _fallback(checkpointer: Any, state: dict[str, Any], directory: Path, setup: Any) -> dict[str, Any]:
    """After the resumed run: its last checkpoint corrupted, `load_latest` restores the one before
    (tables, servers included); a checkpoint of another server count is refused, naming it."""
    import dataclasses

    import torch.distributed as dist

    from shadowgba.checkpoint import Checkpointer
    from shadowgba.errors import CheckpointError

    if checkpointer.rank == 0:
        data_file = sorted(checkpointer.path_of(SERVER_STEPS).glob("*.distcp"))[0]
        raw = bytearray(data_file.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data_file.write_bytes(bytes(raw))
    dist.barrier(group=checkpointer.group)
    out = {"fallback_step": checkpointer.load_latest(state)}
    other = Checkpointer(directory, dataclasses.replace(setup, servers=setup.servers + 1),
                         process_group=checkpointer.group)
    try:
        other.load_latest(state)
        out["other_servers"] = "loaded"
    except CheckpointError as error:
        out["other_servers"] = str(error)
    return out


def _centre_refusals(centre: Any) -> dict[str, str]:
    """What the S-EASGD centre answers to states it must refuse before any server changes (another
    server count, another length, NaN, not a state): each refusal's message, or "loaded"."""
    from shadowgba.errors import CheckpointError

    good = centre.state_dict()
    poisoned = good["centre"].clone()
    poisoned[3] = float("nan")
    bad = {"servers": {**good, "num_servers": good["num_servers"] + 1},
           "length": {**good, "centre": good["centre"][:-1]}, "nan": {**good, "centre": poisoned},
           "not_a_state": [good]}
    out = {}
    for name, state in bad.items():
        try:
            centre.load_state_dict(state)
            out[name] = "loaded"
        except CheckpointError as error:
            out[name] = str(error)
    return out


def _server_case(rank: int, world_size: int, root: str, case: str) -> dict[str, Any] | None:
    """Rank body of one case: a run to SERVER_STEPS, and one resumed from its checkpoint of step
    SERVER_STOP_AT in a new job (servers included). A run stopped there would have saved the same
    checkpoint: the configuration is deterministic and the save comes before anything a stop does."""
    import shutil

    import torch.distributed as dist

    whole = _server_run(case, Path(root, case, "whole"), SERVER_STEPS, resume=False)
    if rank == 0:
        name = f"step_{SERVER_STOP_AT:08d}"
        shutil.copytree(Path(root, case, "whole", name), Path(root, case, "split", name))
    dist.barrier()
    resumed = _server_run(case, Path(root, case, "split"), SERVER_STEPS, resume=True)
    return None if resumed is None else {"whole": whole, "resumed": resumed}


@pytest.fixture(scope="module")
def with_servers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Every job of this file on 3 ranks (with parameter servers), and tests/test_batches.py's, in one
    spawned group (`run_shared`)."""
    root = str(tmp_path_factory.mktemp("servers"))
    from tests.test_batches import malformed_on_one_trainer

    jobs = {case: (_server_case, (root, case)) for case in SERVER_CASES}
    return run_shared(3, {**jobs, "ps_state": (_ps_job, (str(Path(root, "ps_state")),)),
                          "batches": (malformed_on_one_trainer, ())}, timeout_s=240)


@pytest.mark.timeout(300)
def test_ps_tables_and_their_optimizer_state_come_back_from_a_checkpoint(with_servers: dict) -> None:
    out = with_servers["ps_state"][0]
    assert out["loaded"] == 3 and out["moved"] > 1e-3 and out["restored"] == 0.0
    assert out["stats"] == out["saved_stats"]  # pushes, global step, buffered samples, staleness
    assert any(stats["pending_samples"] for stats in out["stats"])
    assert out["nested"] == []  # inside a parent module's state_dict the tables add nothing


def _trainers_of(case: list[Any]) -> list[dict[str, Any]]:
    return [result for result in case if result is not None]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(SERVER_CASES))
def test_with_servers_a_run_stopped_and_resumed_ends_exactly_where_an_uninterrupted_run_does(with_servers: dict,
                                                                                            case: str) -> None:
    """gba in GBA and sync mode and easgd_ps (its centre on the servers included)."""
    runs = _trainers_of(with_servers[case])
    assert len(runs) == 3 - SERVER_CASES[case]["ps"]["num_servers"]
    for trainer, run in enumerate(runs):
        whole, resumed = run["whole"], run["resumed"]
        assert resumed["resumed_from"] == SERVER_STOP_AT
        if SERVER_CASES[case]["algo"] == "gba":
            mode = SERVER_CASES[case]["gba"]["initial_mode"]
            assert whole["final"]["sync"]["mode"] == resumed["final"]["sync"]["mode"] == mode
            assert whole["final"]["sync"]["optimizer"]["global_step"] == SERVER_STEPS
            assert resumed["final"]["sync"]["optimizer"]["global_step"] == SERVER_STEPS
        assert _max_abs_diff(whole["at_stop"]["model"], whole["final"]["model"]) > 1e-4  # the last steps trained
        assert set(whole["final"]) == set(resumed["final"])
        for part in whole["final"]:  # dense weights, tables, their optimizer state, the shards' state, the centre
            diff = _max_abs_diff(whole["final"][part], resumed["final"][part])
            assert diff <= 1e-6, f"{case}: trainer {trainer}'s {part} differs by {diff}"
    if SERVER_CASES[case]["algo"] == "easgd_ps":
        whole = runs[0]["whole"]
        assert whole["final"]["centre"]["num_servers"] == 2
        assert _max_abs_diff(whole["at_stop"]["centre"], whole["final"]["centre"]) > 1e-6  # rounds moved it
    if case == "gba_ps":
        gathered = runs[0]["resumed"]["final"]["ps_tables"]
        assert set(gathered["tables"]["t0"]) == {"weight", "accumulator"}
        shard = gathered["shards"]["server0"]
        assert shard["counters"]["pushes"] == 2 * SERVER_STEPS and shard["rule"]["global_step"] == SERVER_STEPS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(SERVER_CASES))
def test_with_servers_a_resume_restores_the_saved_state_bit_for_bit_and_a_corrupted_one_falls_back(
    with_servers: dict, case: str
) -> None:
    """Every case: the state as saved, a corrupted checkpoint skipped, another server count refused."""
    servers = SERVER_CASES[case]["ps"]["num_servers"]
    for trainer, run in enumerate(_trainers_of(with_servers[case])):
        saved, resumed = run["whole"]["at_stop"], run["resumed"]
        for part in saved:
            diff = _max_abs_diff(saved[part], resumed["at_load"][part])
            assert diff == 0.0, f"{case}: trainer {trainer}'s {part} after loading differs by {diff}"
        assert _max_abs_diff(resumed["at_load"]["model"], resumed["final"]["model"]) > 1e-4  # training went on
        assert resumed["fallback_step"] == SERVER_STOP_AT  # step 6 corrupted: step 3 is loaded instead
        for part in saved:  # the tables on the servers and the shards' state moved back to step 3
            assert _max_abs_diff(saved[part], resumed["after_fallback"][part]) == 0.0, f"{case}: {part}"
        assert f"made with {servers} parameter servers, this job has {servers + 1}" in resumed["other_servers"]
    if case == "easgd_ps":  # refused before the fallback's state above was compared: nothing changed
        refusals = _trainers_of(with_servers[case])[0]["resumed"]["centre_refusals"]
        length = len(_trainers_of(with_servers[case])[0]["whole"]["final"]["centre"]["centre"])
        assert "saved from 3 parameter servers, this job has 2" in refusals["servers"]
        assert f"holds {length} values of torch.float32, got ({length - 1},)" in refusals["length"]
        assert "refuses NaN or Inf values" in refusals["nan"]
        assert "S-EASGD centre state is a mapping with keys ['centre', 'num_servers'], got list" in refusals["not_a_state"]


def test_a_keyed_optimizer_that_has_not_stepped_loads_a_saved_state_without_a_step() -> None:
    """TorchRec's KeyedOptimizer refuses state for an unstepped optimizer (every optimizer of a job
    that resumes); `PerTrainer` gives it that state first, for a `CombinedOptimizer`'s parts too,
    without stepping: weight decay does not move the parameters and nothing hooked on `step` runs."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    from shadowgba.checkpoint import PerTrainer

    def build() -> tuple[dict[str, torch.nn.Parameter], CombinedOptimizer]:
        torch.manual_seed(0)
        params = {"a": torch.nn.Parameter(torch.randn(4, 3)), "b": torch.nn.Parameter(torch.randn(5))}
        parts = [(name, KeyedOptimizerWrapper({name: param}, lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5)))
                 for name, param in params.items()]
        return params, CombinedOptimizer(parts)

    params, stepped = build()
    for _ in range(3):
        stepped.zero_grad()
        sum((param ** 2).sum() for param in params.values()).backward()
        stepped.step()
    saved = PerTrainer(stepped, 0).state_dict()

    fresh_params, fresh = build()
    before = {name: param.detach().clone() for name, param in fresh_params.items()}
    with pytest.raises(ValueError, match="Different parameter count"):  # what TorchRec alone does
        fresh.load_state_dict(stepped.state_dict())
    fresh.step = lambda *args, **kwargs: pytest.fail("loading must not step")  # type: ignore[method-assign]
    PerTrainer(fresh, 0).load_state_dict(saved)
    for name, param in fresh_params.items():
        assert torch.equal(param, before[name])
    want, got = stepped.state_dict()["state"], fresh.state_dict()["state"]
    assert set(got) == set(want) == {"a.a", "b.b"}
    for key in want:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[key][field], want[key][field]), (key, field)


class _RunsCode:
    """What a crafted checkpoint could carry: an object whose unpickling calls a function (here
    `os.mkdir(marker)`, harmless and visible)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def test_a_crafted_checkpoint_entry_is_refused_without_running_its_code_and_plain_state_round_trips(
        tmp_path: Path) -> None:
    """Every serialized state the library loads (a trainer's blobs, a PS shard's state, a server's
    checkpoint file) goes through torch's weights_only unpickler: an entry carrying code is refused
    with a `CheckpointError` naming it, and the code never runs; what the library saves (RNG streams
    with numpy's, counters, configs as plain data) loads back."""
    import random

    import numpy

    from shadowgba.checkpoint import TrainState
    from shadowgba.serialized import state_from_bytes, state_to_bytes
    from shadowgba.errors import CheckpointError
    from shadowgba.ps.server_state import STATE_FILE, ServerCheckpoints
    from shadowgba.serialized import commit_folder

    marker = tmp_path / "ran"
    crafted = state_to_bytes({"step": 7, "payload": _RunsCode(marker)})
    torch.load(io.BytesIO(crafted), weights_only=False)  # the payload is live: an unrestricted load runs it
    assert marker.is_dir()
    marker.rmdir()

    with pytest.raises(CheckpointError, match="checkpoint entry 'trainer0' holds an object other than tensors"):
        state_from_bytes(crafted, "trainer0")
    train = TrainState(trainer_index=0, step=3)
    with pytest.raises(CheckpointError, match="'trainer0'"):
        train.load_state_dict({"trainer0": crafted})
    assert train.step == 3

    servers = ServerCheckpoints(tmp_path / "servers", server_index=0)
    servers.save(10, {"dense": {"configure": {"spec": {"name": "Adam"}}, "exported": torch.ones(3)}})
    forged = servers.folder / "forged"  # newer, crafted, with a manifest that fits: skipped, the one before loads
    forged.mkdir()
    (forged / STATE_FILE).write_bytes(crafted)
    commit_folder(forged, servers.path_of(20), 20, servers.setup, keep_last=5)
    step, state = servers.latest()
    assert step == 10 and torch.equal(state["dense"]["exported"], torch.ones(3))
    assert not marker.exists()

    torch.manual_seed(5), random.seed(5), numpy.random.seed(5)
    saved = TrainState(trainer_index=0, step=4, samples=128, data_position=2, extra={"note": [1, 2.5]}).state_dict()
    want = (torch.rand(2), random.random(), numpy.random.rand(2))
    torch.manual_seed(6), random.seed(6), numpy.random.seed(6)
    loaded = TrainState(trainer_index=0)
    loaded.load_state_dict(saved)
    got = (torch.rand(2), random.random(), numpy.random.rand(2))
    assert (loaded.step, loaded.samples, loaded.data_position, loaded.extra) == (4, 128, 2, {"note": [1, 2.5]})
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and numpy.array_equal(got[2], want[2])


def test_a_centre_slice_loads_a_checkpoints_values_and_refuses_another_slice_shape_dtype_or_nan() -> None:
    from shadowgba.ps.easgd_center import ElasticCenter

    centre = ElasticCenter()
    centre.init(4, 8, torch.zeros(4))
    centre.load(4, 8, torch.arange(4.0))
    assert torch.equal(centre.center(), torch.arange(4.0))
    refused = [((0, 4, torch.ones(4)), r"holds slice \[4, 8\), not \[0, 4\)"),
               ((4, 8, torch.ones(5)), r"holds 4 values of torch.float32, got \(5,\) of torch.float32"),
               ((4, 8, torch.ones(4, dtype=torch.float64)), r"got \(4,\) of torch.float64"),
               ((4, 8, torch.tensor([0.0, float("nan"), 0.0, 0.0])), "refuses NaN or Inf"),
               ((4, 8, [0.0] * 4), "must be a tensor, got list")]
    for args, message in refused:
        with pytest.raises(ValueError, match=message):
            centre.load(*args)
    assert torch.equal(centre.center(), torch.arange(4.0))  # nothing changed
    fresh = ElasticCenter()
    fresh.load(0, 4, torch.ones(4))  # before any trainer's init: it starts the slice, and init keeps it
    assert torch.equal(fresh.init(0, 4, torch.zeros(4)), torch.ones(4))  # where the trainer starts
    assert torch.equal(fresh.center(), torch.ones(4))
    # unless_moved (the elastic layout): loaded while no exchange has moved the slice, kept after
    assert centre.load(4, 8, torch.ones(4), unless_moved=True) and torch.equal(centre.center(), torch.ones(4))
    centre.pull(4, 8, torch.full((4,), 3.0), 0.5)
    assert not centre.load(4, 8, torch.zeros(4), unless_moved=True)
    assert torch.equal(centre.center(), torch.full((4,), 2.0))


@pytest.mark.timeout(300)
def test_a_malformed_batch_is_refused_by_the_trainer_that_got_it_before_torchrec_sees_it(with_servers: dict) -> None:
    """tests/test_batches.py's distributed case, run in this file's 3-rank group."""
    from tests.test_batches import assert_refused_by_the_trainer_that_got_it

    assert_refused_by_the_trainer_that_got_it(with_servers["batches"])


def test_a_ps_table_run_stopped_by_samples_may_resume_but_not_save() -> None:
    """Trainers over PS tables step independently, so under a `global_samples` stop no step is
    reached by all of them: a save (collective at one step) is refused at start-up, naming the
    flag, while a resume alone (one load before the first step) is allowed."""
    from dlrm.checkpoints import CheckpointOptions
    from dlrm.config import ExperimentConfig
    from shadowgba.config import load_config
    from shadowgba.errors import ConfigError

    config = load_config(ExperimentConfig, REPO / "examples/configs/gba_ps_embeddings.yaml",
                         ["--train.global_samples", "100000"])
    assert not config.lockstep
    with pytest.raises(ConfigError, match="--checkpoint-every: with PS tables trainers step independently"):
        CheckpointOptions(Path("ck"), every=10).check(config)
    CheckpointOptions(Path("ck"), resume=True).check(config)
