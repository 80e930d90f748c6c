"""Train a TorchRec DLRM on synthetic CTR data with shadowgba (or a baseline) and report the numbers.

    torchrun --standalone --nproc_per_node=2 benchmarks/train_dlrm.py --config examples/configs/bmuf.yaml \
        [--sync.interval_ms 20 ...] [--output results.json]
    torchrun --standalone --max-restarts=3 --nproc_per_node=2 benchmarks/train_dlrm.py --config examples/configs/ma.yaml \
        --checkpoint-dir ckpt --checkpoint-every 500 --resume     # a restarted attempt resumes by itself
    torchrun --standalone --nproc_per_node=3 benchmarks/train_dlrm.py --config examples/configs/gba_ps_embeddings.yaml
    torchrun --standalone --nproc_per_node=2 benchmarks/train_dlrm.py --config examples/configs/ma.yaml --preset production

`sync.algo` picks how the dense replicas meet, through `shadowgba.dense_sync`: ma / easgd / bmuf /
easgd_ps (the shadow runtime) or gba (sync all-reduce or GBA over parameter-server ranks,
`sync.ps.num_servers`); `baseline` runs none (purely local training), ddp (TorchRec's default dense
DDP) or pma (torch's periodic model averaging every `sync.foreground_every` steps) instead. The tables are sharded by TorchRec over the
trainers or hosted on the servers (`model.embeddings`); `straggler` slows chosen trainers. The run
reports held-out AUC and log loss next to the planted teacher's ceiling, all trainers' throughput over
a common timed window after warm-up, the sync metrics (and the servers' for GBA), and how far the
dense replicas are apart at the end; with `train.eval_every_samples`, a held-out `curve` against
samples seen. Every rank's CPU seconds in that window (per sample trained in it) and peak resident
memory, servers included, and each trainer's peak above its memory before the sync runtime was built
(`resources`). `--preset small | production` sets the model's shape and its data
(`examples/configs/presets/`). One torch thread per rank, gloo on CPU, NCCL on GPUs.

Modules: `dlrm.config` (the config tree and the model presets), `dlrm.model` (building the DLRM),
`dlrm.job` (trainer and server roles, which sync, every rank's resources), `dlrm.pma` (the pma
baseline), `dlrm.loop` (training loop, stopping, timing, evaluation), `dlrm.curve` (the held-out
curve during training), `dlrm.checkpoints` (`--checkpoint-dir`, `--checkpoint-every`, `--resume`:
atomic checkpoints and exact resume), `dlrm.faults` (test-only fault injection).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from dlrm.checkpoints import CheckpointOptions, JobCheckpoints
from dlrm.config import ExperimentConfig, preset_names, preset_overrides
from dlrm.faults import FaultInjector, restart_count
from dlrm.host import MiB
from dlrm.curve import heldout_curve
from dlrm.job import (
    Interval, ResourceMeter, StepWallClock, applied_samples, dense_sync, gather_resources, join, paired_trainers,
    resource_summary, timed_window,
)
from dlrm.loop import (
    StopRule, common_window, evaluate, replica_spread, global_steps_per_s, sum_over_trainers, train,
)
from dlrm.model import DENSE_OPTIMIZERS, build_model
from shadowgba.config import ConfigError, load_config, to_dict
from shadowgba.integrations.torchrec import fused_table_shards
from shadowgba.network import use_interface_to_master
from ctrkit.evaluation import all_gather_rows, log_loss, roc_auc
import shadowgba
from ctrkit.ctr_data import CTRData
from ctrkit.datasets import open_dataset
from ctrkit.synthetic import SyntheticCTR


def run(
    config: ExperimentConfig, device: torch.device, backend: str, checkpoints: CheckpointOptions | None = None
) -> dict[str, Any] | None:
    """Every rank: join the job, serve or train; then every rank's resources over the timed window
    (collective). Trainers return every number of the run, servers None."""
    wall_start = time.perf_counter()
    meter = ResourceMeter()
    data = open_dataset(config.data)
    job = join(config, data, backend)  # a server rank serves in here until every trainer is done
    results, window, members = None, [], ()
    if not job.is_server:
        try:
            results, window, members = run_trainer(config, data, job, device, checkpoints or CheckpointOptions(),
                                                   meter)
            results["wall_s"] = time.perf_counter() - wall_start
        finally:
            job.close()
    by_rank = gather_resources(meter, job, window, members)
    if results is None or by_rank is None:
        return None
    return {**results, "resources": resource_summary(by_rank, results["samples_in_window"], results["dense_mib"])}


def run_trainer(
    config: ExperimentConfig, data: CTRData, job: shadowgba.Job, device: torch.device, options: CheckpointOptions,
    meter: ResourceMeter,
) -> tuple[dict[str, Any], list[Interval], tuple[int, ...]]:
    """Build, train (from the latest checkpoint with --resume), close the sync, evaluate; the results,
    the timed window as wall-clock intervals and the ranks of the trainers still in the job. What
    follows the training loop runs on those (`Job.survivors`): a trainer that departed a job with
    servers (`sync.ps.on_trainer_lost: continue`) costs only its own work, not the result."""
    roles = job.roles
    torch.manual_seed(config.train.seed)
    model = build_model(config, data, job, device)
    betas = {"betas": (config.train.adam_beta1, 0.999)} if config.train.dense_optimizer == "adam" else {}
    optimizer = DENSE_OPTIMIZERS[config.train.dense_optimizer](model.dense_params, lr=config.train.dense_lr, **betas)
    meter.mark_before_sync()
    sync = dense_sync(config, model.module, optimizer, job)
    gba = sync if config.algo == "gba" else None
    num_trainers = len(roles.trainer_ranks)
    stop = StopRule(config.train, config.lockstep, roles, device, applied_samples(gba, config) if gba else None,
                    paired_trainers(config, job), config.data.batch_size)
    curve = heldout_curve(config, model.module, data, roles, device, sync, stop)
    checkpoints = JobCheckpoints(options, config, model, optimizer, sync, job) if options.directory else None
    fault = FaultInjector.from_env(roles.trainer_index, model.dense_params)
    clock = StepWallClock()

    def between_steps(step: int, elapsed_s: float) -> float:
        clock.step_ended(elapsed_s)
        paused = curve.after_step(step, elapsed_s)
        if checkpoints is not None:  # left out of the training clock, as evaluation; see "checkpoint"
            paused += checkpoints.after_step(step)
        clock.paused(paused)
        fault.after_step(step)
        return paused

    with sync or contextlib.nullcontext():
        joined = isinstance(sync, shadowgba.DenseSync) and sync.joined_running_job  # holds the running job's replica
        start_step = checkpoints.resume(position_only=joined) if checkpoints is not None else 0  # after start()
        batches = data.train_batches(roles.trainer_index, num_trainers,
                                     checkpoints.data_position if checkpoints is not None else 0)
        stats = train(model, optimizer, batches, config.train, stop, config.straggler,
                      (lambda: gba.global_step) if gba else None, device, between_steps, start_step)
        if checkpoints is not None:
            checkpoints.close()  # the last async save is committed
        fault.check_fired(stats.steps)
        # read before close(): closing in sync mode moves every trainer to "local"
        training_mode = {"mode": gba.mode, "mode_switches": gba.metrics.summary()["mode_switches"]} if gba else {}
    if model.ps_embeddings is not None:
        model.ps_embeddings.flush()
    survivors = job.survivors()  # they meet: every surviving trainer's row gradients have landed
    roles = dataclasses.replace(roles, trainer_group=survivors.group, trainer_ranks=survivors.ranks)
    window = common_window(stats, config.data.batch_size, roles, device)
    wall_window = clock.intervals(*timed_window(stats, roles, device))
    spread = spread_among(model.dense_params, roles.trainer_group)
    table_spread = None
    if job.layout is not None:  # each rank's table shards against their replicas in the other groups
        shards = [tensor for shard in fused_table_shards(model.module) for tensor in shard.tensors]
        table_spread = spread_among(shards, survivors.replica_group)
    quality = evaluate(model.module, data, roles, device)
    curve.finish(quality, stats.step_end_s[-1])
    ceiling = data.teacher_heldout() if isinstance(data, SyntheticCTR) else None  # only synthetic data has one
    sync_summary = sync.metrics.summary() if sync else {}
    return {
        "world_size": dist.get_world_size(),
        "trainers": num_trainers,
        "departed_trainers": list(survivors.departed),
        # the first survivor writes the results; with a torchrun job per replica group, so does each
        # group's first rank (each job has an --output of its own)
        "writer": roles.rank == survivors.ranks[0] or (job.replica_store is not None and job.layout.position == 0),
        "servers": roles.num_servers,
        "steps": stats.steps,  # trainer 0's, since the job's start (before a resume included)
        "steps_this_run": stats.steps - start_step,
        "steps_by_trainer": all_gather_rows(torch.tensor([stats.steps], device=device), roles.trainer_group).tolist(),
        "restart_count": restart_count(),
        "checkpoint": checkpoints.summary() if checkpoints is not None else None,
        **window,
        "samples_per_s_per_trainer": window["samples_per_s_total"] / len(survivors.ranks),
        **quality,
        "curve": curve.points,
        "eval_s_during_training": curve.eval_s,  # trainer 0's; left out of window_s and the curve's elapsed_s
        **({"teacher_auc": roc_auc(*ceiling), "teacher_log_loss": log_loss(*ceiling)} if ceiling else {}),
        "dense_params": sum(param.numel() for param in model.dense_params),
        "dense_mib": sum(param.numel() * param.element_size() for param in model.dense_params) / MiB,
        "dense_replica_max_abs_diff": spread,
        "table_replica_max_abs_diff": table_spread,
        "samples_computed_total": sum_over_trainers(stats.steps * config.data.batch_size, roles, device),
        "straggler_sleep_s_total": sum_over_trainers(stats.straggler_sleep_s, roles, device),
        "straggler_overrun_fraction_by_trainer": all_gather_rows(  # simulated compute that did not hold
            torch.tensor([stats.straggler_overrun_fraction], device=device), roles.trainer_group).tolist(),
        "sync": sync_summary,
        "sync_rounds_by_trainer": all_gather_rows(  # "sync" is trainer 0's; each trainer's own rounds
            torch.tensor([sync.metrics.rounds if sync else 0], device=device), roles.trainer_group).tolist(),
        **{f"{key}_by_trainer": all_gather_rows(  # each trainer's own: NaN / Inf it skipped, its heals, and
            # its longest gap between two dense rounds, in its own steps
            torch.tensor([sync_summary.get(key, 0)], device=device), roles.trainer_group
        ).tolist() for key in ("nonfinite_steps_skipped", "nonfinite_replicas_healed",
                               "sync_gap_steps_max_between_rounds")},
        "gba": {
            **training_mode, "global_step": stats.global_steps[1], "global_steps_per_s": global_steps_per_s(stats),
            "dense_shards": gba.server_stats(),
            "embedding_shards": model.ps_embeddings.server_stats() if model.ps_embeddings else [],
        } if gba else {},
        **({"step_end_at": stats.step_end_at} if config.train.record_step_times else {}),
        "config": to_dict(config),
    }, wall_window, survivors.ranks


def spread_among(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> float | None:
    """`replica_spread` of `tensors` over `group`, or None where the group has one member (a lone
    surviving trainer, a replica group whose other groups were lost): a replica against itself
    reads 0.0 whatever it holds, which would pass every check of identical replicas."""
    return replica_spread(tensors, group) if dist.get_world_size(group) > 1 else None


def _device() -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device, "nccl"
    return torch.device("cpu"), "gloo"


def _init_process_group(backend: str) -> None:
    """`init_process_group` from torchrun's environment. In a restarted attempt (torchrun
    `--max-restarts`) the store torchrun's agent hosts still holds the previous attempt's keys, among
    them the dead workers' gloo addresses, and gloo's full-mesh connect of the new attempt reads
    those ("Connection refused"; torch 2.13, reproduced with a two-line script): the new attempt's
    keys get a prefix of their own."""
    use_interface_to_master()
    attempt = restart_count()
    if not attempt:
        dist.init_process_group(backend)
        return
    store, rank, world_size = next(dist.rendezvous("env://"))
    dist.init_process_group(backend, store=dist.PrefixStore(f"restart_{attempt}", store), rank=rank,
                            world_size=world_size)


def _summary(results: dict[str, Any], output: Path) -> str:
    """A few lines a user reads once: what ran, how fast, how good, what the sync did and what memory
    and CPU the job took, each number named in words (all of them, and more, are in `output`)."""
    config = results["config"]
    algo = config["baseline"] or config["sync"]["algo"]
    how = f"{config['sync']['mode']} mode" if algo in ("ma", "easgd", "bmuf", "easgd_ps") else (
        f"{results['gba']['mode']} mode" if results["gba"] else "baseline")
    lines = [
        f"{algo} ({how}): {results['trainers']} trainers, {results['servers']} servers, "
        f"{results['dense_params']:,} dense parameters ({results['dense_mib']:.1f} MiB)"
        + (f", preset {results['preset']}" if results["preset"] else ""),
        f"  throughput   {results['samples_per_s_total']:,.0f} samples/s "
        f"({results['samples_per_s_per_trainer']:,.0f} per trainer), over the {results['window_s']:.1f} s "
        "in which every trainer was training",
    ]
    quality = f"  held-out     AUC {results['auc']:.4f}, log loss {results['log_loss']:.4f}"
    if "teacher_auc" in results:
        quality += f" (the planted teacher's ceiling: AUC {results['teacher_auc']:.4f})"
    lines.append(quality)
    sync = results["sync"]
    if sync:
        gap = sync.get("sync_gap_steps_mean")
        lines.append(
            f"  sync         {sync['rounds']} rounds ({sync['rounds_per_s']:.1f}/s); "
            + (f"a round's result reached the weights every {gap:.1f} steps on average; " if gap is not None else "")
            + f"the training loop spent {sync['training_sync_s']:.3f} s in sync code"
        )
    resources = results["resources"]
    lines.append(
        f"  memory       peak {resources['trainer_peak_rss_mib_max']:,.0f} MiB per trainer"
        + (f", {resources['server_peak_rss_mib_max']:,.0f} MiB per server"
           if resources["server_peak_rss_mib_max"] is not None else "")
        + f"; {resources['trainer_extra_rss_mib_max']:,.0f} MiB of a trainer's added after the sync was built "
        "(training, batches and sync together)"
    )
    if sync and "memory_bytes" in sync:
        model_bytes = sync["memory_bytes"] - sync.get("lane_bytes", 0)
        lines.append(f"  sync memory  {model_bytes / 2**20:.2f} MiB held by the sync runtime "
                     f"({model_bytes / 2**20 / results['dense_mib']:.1f}x the dense parameters)"
                     + (f", and {sync['lane_bytes'] / 2**20:.2f} MiB of same-host lanes to the servers "
                        "(sync.ps.lane_mb per channel and direction)" if sync.get("lane_bytes") else ""))
    if resources["cpu_s_per_sample"] is not None:
        lines.append(f"  CPU          {1e3 * resources['cpu_s_per_sample']:.3f} ms per sample trained (all ranks)")
    lines.append(f"  full record  {output}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="YAML file; keys mirror ExperimentConfig (benchmarks/dlrm/config.py)")
    parser.add_argument("--preset", choices=preset_names(),
                        help="model preset (examples/configs/presets/): its model and data sections go over "
                             "--config's, under the command line's --dotted.key overrides")
    parser.add_argument("--output", type=Path, default=Path("runs/train_dlrm.json"),
                        help="where the first trainer still in the job (rank 0 unless it departed) writes every "
                             "number and the config as JSON (default: %(default)s)")
    parser.add_argument("--checkpoint-dir", type=Path, help="save checkpoints here (step_00000NNN folders)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                        help="steps between checkpoints (default: none)")
    parser.add_argument("--checkpoint-keep", type=int, default=2, metavar="K", help="keep the last K (default: 2)")
    parser.add_argument("--checkpoint-async", action="store_true", help="write checkpoints in the background")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest good checkpoint in --checkpoint-dir, if there is one "
                             "(fails when there are checkpoints and every one is corrupted)")
    parser.add_argument("--resume-allow-fresh-start", action="store_true",
                        help="with --resume: when every checkpoint is corrupted, train from step 0 instead of failing")
    args, overrides = parser.parse_known_args(argv)
    checkpoints = CheckpointOptions(args.checkpoint_dir, args.checkpoint_every, args.resume, args.checkpoint_keep,
                                    args.checkpoint_async, args.resume_allow_fresh_start)
    try:
        config = load_config(ExperimentConfig, args.config,
                             [*(preset_overrides(args.preset) if args.preset else []), *overrides])
        checkpoints.check(config)
    except ConfigError as error:
        raise SystemExit(f"config error: {error}") from None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's: refused before any process group exists
    try:
        config.sync.check_world_size(world_size)
    except ConfigError as error:
        raise SystemExit(f"config error: sync.{error}") from None
    try:
        config.straggler.check(world_size - config.sync.ps.num_servers)
    except ConfigError as error:
        raise SystemExit(f"config error: straggler.{error}") from None
    torch.set_num_threads(1)
    device, backend = _device()
    _init_process_group(backend)
    try:
        results = run(config, device, backend, checkpoints)
        if results is not None and results["writer"]:
            results["preset"] = args.preset
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(results, indent=2) + "\n")
            print(_summary(results, args.output), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every result is written and every process group destroyed: leave without interpreter
    # finalization. During it, torch's C++ threads occasionally abort a finished rank ("terminate
    # called without an active exception": 4 of 96 benchmark-matrix jobs), failing a job whose work
    # is done. Nothing of ours needs to run at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
