"""`make test-hosts` where simulated hosts cannot be made (no root, no network namespaces): it fails
saying why, instead of passing with every test skipped, while `make test` (which leaves the hosts
tests out) runs there as before.

When the suite runs as root (as CI does), the commands run as root without any capability (the
bounding set dropped before they start): a container that cannot make network namespaces.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
PR_CAPBSET_DROP = 24


def _test_hosts_command() -> list[str]:
    """The command `make test-hosts` runs, with this interpreter (its prerequisite, the install of
    .venv, not remade)."""
    dry = subprocess.run(["make", "-s", "-n", "-o", ".venv/.installed", "test-hosts", f"PY={sys.executable}"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return shlex.split(dry.stdout.strip().splitlines()[-1])


def _drop_capabilities() -> None:
    """In the child before it runs its command: empty the capability bounding set, so that the
    command runs as root with no capability at all."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in range(64):
        libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)


def _unprivileged(command: list[str]) -> subprocess.CompletedProcess[str]:
    """`command` in the checkout, without any capability when this process is root (else as it is)."""
    demote = _drop_capabilities if os.geteuid() == 0 else None
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([*command, "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True,
                          preexec_fn=demote, timeout=100)


def test_make_test_hosts_fails_naming_why_where_hosts_cannot_be_made_and_make_test_is_unaffected() -> None:
    gated = _unprivileged(_test_hosts_command())
    said = gated.stdout + gated.stderr
    assert gated.returncode != 0, said[-3000:]
    assert "simulated hosts need" in said and "make test-hosts cannot run here" in said, said[-3000:]
    # make test's selection (this file, collected only: the suite's imports would cost seconds) runs there
    plain = _unprivileged([sys.executable, "-m", "pytest", "-q", "--co", "-m", "not hosts", __file__])
    assert plain.returncode == 0 and "1 test collected" in plain.stdout, plain.stdout + plain.stderr
