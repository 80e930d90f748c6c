"""Resident memory of a trainer under each sync runtime, and of a dense server, against the dense size.

    .venv/bin/python benchmarks/memory_probe.py [--steps 200] [--cases none,bmuf-shadow,gba]

Every case runs in fresh spawned gloo processes (2 trainers; GBA adds 1 dense server) on the
production preset's dense net (MLPerf DLRM's bottom and top MLPs, 2,368,897 parameters; no
tables, so what grows is the dense path alone). Each trainer trains `--warmup` steps without any
runtime (training's own allocations settle: Adam's moments, autograd's buffers), resets its peak
(`/proc/self/clear_refs`), reads its RSS, builds the runtime, trains `--steps` more and reads its
peak again. `extra` is that peak minus the RSS before the runtime, in MiB and in dense sizes;
`held` is what the runtime's attributes hold in tensors (`held_tensors`, de-duplicated by
storage), `reported` what its `metrics.memory()` says. The `none` case trains the same steps
without a runtime: training's own growth, the floor of every other case.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BOTTOM = (13, 512, 256, 128)
TOP = (479, 1024, 1024, 512, 256, 1)
"""The production preset's MLPs (examples/configs/presets/production.yaml): the top MLP's input is
the bottom's 128 outputs plus the 351 pairwise interactions of 27 features."""
BATCH = 128

SHADOW_CASES = {f"{algo}-{mode}": (algo, mode) for algo in ("ma", "easgd", "bmuf") for mode in ("shadow", "foreground")}
CASES = ("none", *SHADOW_CASES, "sync", "gba")
M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameter: blocks from this size on are mmapped and unmapped when freed."""


def mlp(sizes: tuple[int, ...]) -> list[nn.Module]:
    """Linear layers of `sizes` with ReLU between them."""
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return layers[:-1]


class DenseNet(nn.Module):
    """The production DLRM's dense part: bottom MLP on the dense features, top MLP on its output
    beside (random) interaction features."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = nn.Sequential(*mlp(BOTTOM))
        self.top = nn.Sequential(*mlp(TOP))

    def forward(self, dense: torch.Tensor, interactions: torch.Tensor) -> torch.Tensor:
        return self.top(torch.cat([self.bottom(dense), interactions], dim=1))


def status_kib(field: str) -> int:
    """A `/proc/self/status` memory field (VmRSS, VmHWM) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    """Make VmHWM the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def held_tensors(root: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `root` through attributes and containers of shadowgba /
    sync_algos / torch objects, one per storage (views of one buffer count once), except what the
    user owns (`model`, its parameters and gradients, `optimizer`): what a runtime holds of its
    own, counted from the outside, to check its `metrics.memory()` against."""
    seen = {id(model), id(optimizer)}
    storages = {t.untyped_storage().data_ptr() for p in model.parameters() for t in (p, p.grad) if t is not None}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.numel() and obj.untyped_storage().data_ptr() not in storages:
                storages.add(obj.untyped_storage().data_ptr())
                yield obj
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
            stack.extend(obj)
        elif type(obj).__module__.split(".")[0] in ("shadowgba", "sync_algos", "torch") and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """The bytes of the storages of `tensors`."""
    return sum(t.untyped_storage().nbytes() for t in tensors)


def train_steps(model: DenseNet, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """`steps` steps of MSE regression on random inputs."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        dense = torch.randn(BATCH, BOTTOM[0], generator=generator)
        interactions = torch.randn(BATCH, TOP[0] - BOTTOM[-1], generator=generator)
        loss = model(dense, interactions).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def build_runtime(case: str, model: DenseNet, optimizer: torch.optim.Optimizer, ps: Any) -> Any:
    """The case's runtime, not started (None for `none`); `ps`: the job's `Transport` (gba cases)."""
    from shadowgba import SyncConfig
    from shadowgba.config import from_dict
    from shadowgba.gba.config import GBAConfig
    from shadowgba.gba.runtime import GBASync
    from shadowgba.shadow.runtime import ShadowSync

    if case == "none":
        return None
    if case in SHADOW_CASES:
        algo, mode = SHADOW_CASES[case]
        config = SyncConfig(algo=algo, mode=mode, interval_ms=10.0, foreground_every=4, first_round_after=0,
                            log_interval_s=0.0)
        return ShadowSync(model, optimizer, config)
    config = from_dict(GBAConfig, {"initial_mode": case})
    return GBASync(model, optimizer, config, ps.roles, local_batch_size=BATCH, transport=ps)


def measure_trainer(case: str, ps: Any, warmup: int, steps: int, seed: int) -> dict[str, Any]:
    """One trainer's numbers for `case` (see the module docstring)."""
    torch.manual_seed(0)
    model = DenseNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    train_steps(model, optimizer, warmup, seed)
    reset_peak()
    before = status_kib("VmRSS")
    runtime = build_runtime(case, model, optimizer, ps)
    started = time.monotonic()
    if runtime is None:
        train_steps(model, optimizer, steps, seed + 1)
        held = reported = 0
        rounds = 0
    else:
        with runtime:
            train_steps(model, optimizer, steps, seed + 1)
            held = tensor_bytes(held_tensors(runtime, model, optimizer))
            reported = runtime.metrics.summary()["memory_bytes"]
            rounds = runtime.metrics.rounds
    return {
        "case": case, "dense_bytes": dense_bytes, "rss_before_kib": before, "peak_kib": status_kib("VmHWM"),
        "held_bytes": held, "reported_bytes": reported, "rounds": rounds, "seconds": time.monotonic() - started,
    }


def fix_mmap_threshold(mib: float) -> None:
    """What `MALLOC_MMAP_THRESHOLD_` in the environment does, from inside the process: a fixed
    threshold, so glibc never raises it to the largest block freed (up to 32 MiB) and keeps freed
    dense-sized blocks resident in its arenas (one per thread that allocates)."""
    if not ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, int(mib * 2**20)):
        raise OSError("mallopt(M_MMAP_THRESHOLD) refused")


def trim_periodically(period_s: float) -> None:
    """A daemon thread that hands glibc's freed pages back to the system (`malloc_trim`, every
    arena) every `period_s`: the alternative to a fixed threshold that costs nothing per allocation."""
    trim = ctypes.CDLL("libc.so.6").malloc_trim

    def run() -> None:
        while True:
            time.sleep(period_s)
            trim(0)

    threading.Thread(target=run, name="malloc-trim", daemon=True).start()


def probe_rank(rank: int, world_size: int, case: str, warmup: int, steps: int,
               mmap_threshold_mib: float | None = None, trim_every_s: float | None = None) -> dict[str, Any]:
    """A rank of one case: trainers measure themselves; a GBA server measures its peak over the job."""
    torch.set_num_threads(1)
    if mmap_threshold_mib is not None:
        fix_mmap_threshold(mmap_threshold_mib)
    if trim_every_s is not None:
        trim_periodically(trim_every_s)
    if case not in ("sync", "gba"):
        return measure_trainer(case, None, warmup, steps, seed=rank)
    from shadowgba.gba.runtime import serve_dense_shard
    from shadowgba.ps.start import start_transport

    ps = start_transport(1 if case == "gba" else 0)
    roles = ps.roles
    if not roles.is_server:
        try:
            return measure_trainer(case, ps, warmup, steps, seed=roles.trainer_index)
        finally:
            ps.stop()
    reset_peak()
    before = status_kib("VmRSS")
    serve_dense_shard(ps)
    ps.stop()  # serves until every trainer has left
    return {"case": "gba-server", "rss_before_kib": before, "peak_kib": status_kib("VmHWM")}


def row(result: dict[str, Any], dense_bytes: int) -> str:
    """One line of the report."""
    extra_mib = (result["peak_kib"] - result["rss_before_kib"]) / 1024
    dense_mib = dense_bytes / 2**20
    line = f"{result['case']:18s} extra {extra_mib:7.1f} MiB = {extra_mib / dense_mib:5.1f}x dense"
    if "held_bytes" in result:
        line += (f"  held {result['held_bytes'] / dense_bytes:4.1f}x  reported {result['reported_bytes'] / dense_bytes:4.1f}x"
                 f"  rounds {result['rounds']:4d}  {result['seconds']:.0f}s")
    return line


def main() -> None:
    from tests.multiprocess import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--warmup", type=int, default=30, help="steps before the runtime is built")
    parser.add_argument("--steps", type=int, default=200, help="steps with the runtime")
    parser.add_argument("--mmap-threshold-mib", type=float, default=None,
                        help="fix glibc's mmap threshold in every rank (`fix_mmap_threshold`)")
    parser.add_argument("--trim-every-s", type=float, default=None,
                        help="malloc_trim in every rank this often (`trim_periodically`)")
    args = parser.parse_args()
    for case in args.cases.split(","):
        results = run_ranks(probe_rank, 3 if case == "gba" else 2, case, args.warmup, args.steps,
                            args.mmap_threshold_mib, args.trim_every_s, timeout_s=900.0)
        dense_bytes = next(r["dense_bytes"] for r in results if "dense_bytes" in r)
        for result in results:
            print(row(result, dense_bytes), flush=True)


if __name__ == "__main__":
    main()
