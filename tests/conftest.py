"""The gate of the tests marked `hosts` (jobs across simulated hosts, `ctrkit.cluster`): where a
cluster cannot be made (not root, no network namespaces, no pyroute2) they skip, naming why, in a
plain run of the suite; with `--require-hosts` (what `make test-hosts` passes) the run fails at
once, naming why, rather than pass with every test skipped."""

from __future__ import annotations

import pytest

from ctrkit.cluster import unavailable_reason


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--require-hosts", action="store_true", default=False,
                     help="fail, instead of skipping the tests marked hosts, where simulated hosts cannot be made "
                          "(make test-hosts)")


def pytest_configure(config: pytest.Config) -> None:
    reason = unavailable_reason()
    if reason is not None and config.getoption("require_hosts"):
        raise pytest.UsageError(f"make test-hosts cannot run here: {reason}. It needs root with network namespaces "
                                "(as CI runs it); `make test` leaves these tests out")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = unavailable_reason()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("hosts") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
