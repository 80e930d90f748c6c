"""The package's import rules (docs/design.md, "The job's package"), checked on the code itself.

- `shadowgba/job/` imports nothing from `shadowgba/ps/`: membership does not depend on the transport.
- `shadowgba/ps/` imports nothing from the runtimes, the factory or `serving`: the transport is a
  layer below them.
- A job without servers loads no module of `shadowgba/ps/` (nor GBA's runtime): in a fresh
  interpreter, a flat ma job is configured, joined, trained a few steps and closed, then
  `sys.modules` is read.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiprocess import free_port

ROOT = Path(__file__).resolve().parent.parent
IMPORT = re.compile(r"^\s*(?:from|import)\s+(shadowgba(?:\.\w+)*)", re.MULTILINE)

FLAT_JOB = """
import sys
import torch
import shadowgba
from shadowgba.config import SyncConfig

config = SyncConfig(algo="ma", interval_ms=1.0)
job = shadowgba.join(config, backend="gloo")
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with shadowgba.dense_sync(model, optimizer, job):
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
print(sorted(name for name in sys.modules
             if name.startswith("shadowgba.ps") or name in ("shadowgba.gba.runtime", "shadowgba.serving")))
"""


def imports_of(folder: str) -> dict[str, set[str]]:
    """Per file under `folder` (relative to the repository), the shadowgba modules it imports."""
    return {str(path.relative_to(ROOT)): set(IMPORT.findall(path.read_text()))
            for path in sorted((ROOT / folder).rglob("*.py"))}


def test_the_job_package_never_imports_the_transport() -> None:
    offending = {path: sorted(name for name in names if name.startswith("shadowgba.ps"))
                 for path, names in imports_of("shadowgba/job").items()}
    assert not {path: names for path, names in offending.items() if names}


def test_the_transport_never_imports_the_runtimes_or_the_factory() -> None:
    above = ("shadowgba.shadow", "shadowgba.gba", "shadowgba.factory", "shadowgba.serving")
    offending = {path: sorted(name for name in names if name.startswith(above))
                 for path, names in imports_of("shadowgba/ps").items()}
    assert not {path: names for path, names in offending.items() if names}


@pytest.mark.timeout(120)
def test_a_job_without_servers_loads_no_module_of_the_transport() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "WORLD_SIZE": "1"}
    done = subprocess.run([sys.executable, "-c", FLAT_JOB], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
