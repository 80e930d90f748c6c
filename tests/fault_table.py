"""What each network-fault test measured, for the benchmark's fault table (`benchmarks/bench_hosts.py --faults`).

A fault test of `tests/test_hosts.py` / `tests/test_hosts_elastic.py` calls `record` with its fault,
its layout and what it measured (times from the fault, steps, rounds, who was named) before it
asserts, so a run that fails still leaves its figures. `record` appends one JSON line to the file
named by `FAULT_TABLE_ENV` and does nothing when it is unset (a plain `make test-hosts`). The
benchmark runs the tests with it set, and takes pass, fail or hang from pytest's own report: the
test is the one place where a fault is injected and judged.
"""

from __future__ import annotations

import json
import os
from typing import Any

FAULT_TABLE_ENV = "SHADOWGBA_FAULT_TABLE"
"""The file (JSON lines) the fault tests' measurements go to, when set."""


def record(fault: str, layout: str, **measured: Any) -> None:
    """The running test's measurements: `fault` and `layout` the table's row, `measured` its figures
    (JSON-able). The test is named as pytest's report names it."""
    path = os.environ.get(FAULT_TABLE_ENV)
    if not path:
        return
    test = os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].rsplit(" ", 1)[0]  # "test_x[param] (call)"
    with open(path, "a") as table:
        table.write(json.dumps({"test": test, "fault": fault, "layout": layout, "measured": measured}) + "\n")
