"""The examples run as shipped, and the README's code cannot rot: every Python block is an excerpt of
an example script that this file runs, and every YAML block is a config that loads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shadowgba.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_every_python_block_of_the_readme_is_an_excerpt_of_an_example_script() -> None:
    sources = {path.name: path.read_text() for path in EXAMPLES}
    python_blocks = blocks("python")
    assert len(python_blocks) >= 3
    for block in python_blocks:
        assert any(block in source for source in sources.values()), f"not in any of {sorted(sources)}:\n{block}"


@pytest.mark.parametrize("index", range(len(blocks("yaml"))))
def test_every_yaml_block_of_the_readme_loads(index: int, tmp_path: Path) -> None:
    from dlrm.config import ExperimentConfig

    path = tmp_path / "block.yaml"
    path.write_text(blocks("yaml")[index])
    load_config(ExperimentConfig, path)  # strict: an unknown key or a bad value raises


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("script", "config", "nproc", "expected"),
    [
        ("torchrec_dlrm.py", "gba.yaml", 3, "gba: rounds="),  # TorchRec pipeline, 2 trainers + 1 server
        ("plain_loop.py", "easgd_ps.yaml", 3, "easgd_ps: final loss"),  # plain loop, S-EASGD centre on the server
        ("torchrec_2d.py", "bmuf_2d.yaml", 4, "(group 1): "),  # 2 replica groups x 2 ranks
        # an algorithm registered in the user's script, its options read from sync.partial_ma
        ("own_algorithm.py", "ma.yaml", 2, "partial_ma: final loss"),
    ],
)
def test_example_scripts_run_as_shipped(script: str, config: str, nproc: int, expected: str) -> None:
    assert {path.name for path in EXAMPLES} == {"torchrec_dlrm.py", "plain_loop.py", "torchrec_2d.py",
                                                "own_algorithm.py"}  # each run here
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(ROOT / "examples" / script), "--config", str(ROOT / "examples/configs" / config), "--steps", "60",
    ]
    if script.startswith("torchrec"):
        command += ["--batch-size", "64"]
    if script == "own_algorithm.py":  # rounds every 5 steps from the first, in the foreground: 12, and the final one
        command += ["--sync.algo", "partial_ma", "--sync.partial_ma.pull", "0.5", "--sync.mode", "foreground",
                    "--sync.foreground_every", "5", "--sync.first_round_after", "0"]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONSAFEPATH"}  # a script's folder on its path
    job = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=150, env=env)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-4000:]
    assert expected in output and "steps=60" in output, output[-4000:]
    if script == "own_algorithm.py":
        assert "rounds=13 " in output, output[-4000:]
