"""The built wheel as a user installs it: into a fresh virtual environment that holds torch and nothing
else of the development stack (no TorchRec, no fbgemm, no checkout on the path), next to that torch
without replacing it, and the plain PyTorch example runs from outside the repository (ma: the
algorithms share everything but their maths, which the rest of the suite runs on every one).

Creating the environment and installing torch into it is most of this file's time (about a minute
on 2 loaded cores with torch 2.13's CPU wheel; two with torch 2.14's CUDA wheel and its libraries)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TORCH = torch.__version__.split("+")[0]
"""The torch the user already has: the version this suite runs on."""


def user_environment() -> dict[str, str]:
    """This process's environment as a user's shell has it: no PYTHONPATH (nothing of the checkout
    leaks in), and Python writing the bytecode of what it imports, as it does by default (torch is
    installed without it; this machine's PYTHONDONTWRITEBYTECODE would have every process of the
    example compile torch's modules anew)."""
    left_out = ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE")
    return {key: value for key, value in os.environ.items() if key not in left_out}


def run(command: list[str], cwd: Path, timeout_s: float) -> str:
    """Run `command` in the user's environment (`user_environment`) and return its standard output;
    it must exit 0."""
    done = subprocess.run(command, cwd=cwd, env={**user_environment(), "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `pip wheel --no-deps` builds from this checkout."""
    out = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out),
         str(ROOT)], cwd=out, timeout_s=120)
    (built,) = out.glob("shadowgba-*.whl")
    return built


@pytest.fixture(scope="module")
def user_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding this suite's torch version (and its own dependencies) only.
    It gets no pip of its own (seeding one costs more than half of creating it): this suite's pip
    installs into it (`pip --python`), without byte-compiling torch's thousands of modules (Python
    compiles those it imports when it imports them)."""
    venv = tmp_path_factory.mktemp("user") / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=venv.parent, timeout_s=60)
    pip(venv, "install", "--no-compile", f"torch=={TORCH}", timeout_s=240)
    return venv


def pip(venv: Path, command: str, *args: str, timeout_s: float = 120) -> str:
    """This suite's pip `command`, run on the environment `venv`."""
    return run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), command, "--quiet", *args],
               cwd=venv.parent, timeout_s=timeout_s)


@pytest.mark.timeout(420)
def test_the_wheel_installs_next_to_the_user_s_torch_and_the_plain_example_runs_from_outside_the_repository(
    wheel: Path, user_env: Path, tmp_path: Path
) -> None:
    python = str(user_env / "bin/python")
    names = run([python, "-m", "zipfile", "-l", str(wheel)], cwd=tmp_path, timeout_s=30)
    assert "shadowgba/" in names and "sync_algos/" in names and "ctrkit/" not in names

    # Resolving the wheel with its dependencies keeps the installed torch and adds only PyYAML and numpy
    # (which torch does not require; the PS channel reads its frames through it).
    report = pip(user_env, "install", "--dry-run", "--report", "-", str(wheel))
    planned = {item["metadata"]["name"].lower(): item["metadata"]["version"]
               for item in json.loads(report)["install"]}
    assert planned.keys() == {"shadowgba", "pyyaml", "numpy"}, planned

    pip(user_env, "install", "--no-deps", str(wheel))
    pip(user_env, "install", "pyyaml", "numpy")
    probe = run([python, "-c", "import importlib.util as u, shadowgba, torch; print(shadowgba.__file__, torch.__version__, "
                 "[name for name in ('torchrec', 'fbgemm_gpu', 'ctrkit') if u.find_spec(name)])"],
                cwd=tmp_path, timeout_s=60)
    assert str(user_env) in probe and TORCH in probe and probe.strip().endswith("[]"), probe

    script = tmp_path / "plain_loop.py"  # the example copied out: its folder is the first on the path
    shutil.copy(ROOT / "examples/plain_loop.py", script)
    job = subprocess.run(
        [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
         "--config", str(ROOT / "examples/configs/ma.yaml"), "--steps", "30", "--sync.interval_ms=5"],
        cwd=tmp_path, env=user_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    assert job.returncode == 0, job.stdout[-4000:]
    assert "ma: final loss" in job.stdout and "steps=30" in job.stdout, job.stdout[-4000:]
