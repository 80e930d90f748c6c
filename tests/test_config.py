"""Bad configs fail at start-up with a message that names the key and what is allowed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shadowgba.config import ConfigError, SyncConfig, load_config, parse_overrides


@dataclasses.dataclass
class Job:
    """A job config nesting SyncConfig, as applications do."""

    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    """Synchronization."""
    steps: int = 10
    """Training steps."""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_map_onto_dataclasses(tmp_path: Path) -> None:
    path = write(tmp_path, "sync:\n  algo: easgd\n  options: {beta: 0.5}\nsteps: 3\n")
    job = load_config(Job, path, ["--sync.algo", "bmuf", "--sync.interval_ms=20", "--sync.options", "{nesterov: false}"])
    assert job.sync.algo == "bmuf" and job.sync.interval_ms == 20.0 and job.steps == 3
    assert job.sync.algorithm_config().nesterov is False


@pytest.mark.parametrize(
    "text,overrides,message",
    [
        ("sync: {algo: sgdx}", [], r"sync\.algo: unknown algorithm 'sgdx'; allowed: \['bmuf', 'easgd', 'easgd_ps', 'gba', 'ma', 'none', 'ddp', 'pma'\]"),
        ("sync: {algorithm: ma}", [], r"sync\.algorithm: unknown key; allowed keys: \[.*'algo'.*\]"),
        ("sync: {mode: async}", [], r"sync\.mode: 'async' is not allowed; allowed values: \['shadow', 'foreground'\]"),
        ("sync: {interval_ms: -1}", [], r"sync\.interval_ms must be >= 0, got -1"),
        ("sync: {foreground_every: 0}", [], r"sync\.foreground_every must be >= 1"),
        ("sync: {interval_ms: fast}", [], r"sync\.interval_ms: expected a number, got 'fast'"),
        ("sync: {final_sync: 1}", [], r"sync\.final_sync: expected true or false, got 1"),
        ("sync: {algo: bmuf, options: {block_momentum: 1.5}}", [], r"sync\.options\.block_momentum must be in \[0, 1\)"),
        ("sync: {algo: easgd, options: {eta: 0.1}}", [], r"sync\.options\.eta: unknown key; allowed keys: \['alpha', 'beta'\]"),
        ("steps: 2.5", [], r"steps: expected an integer, got 2\.5"),
        ("", ["--sync.writeback", "locked"], r"sync\.writeback: 'locked' is not allowed; allowed values: \['handoff', 'hogwild'\]"),
        ("- just\n- a list", [], r"must hold a mapping, not list"),
        ("sync: {algo: [", [], r"is not valid YAML"),
    ],
)
def test_bad_configs_name_the_key_and_the_allowed_values(tmp_path: Path, text: str, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(Job, write(tmp_path, text), overrides)


def test_missing_file_and_malformed_overrides_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file .*nope.yaml"):
        load_config(Job, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="override --sync.algo has no value"):
        parse_overrides(["--sync.algo"])
    with pytest.raises(ConfigError, match="expected an override like --sync.algo=bmuf, got 'bmuf'"):
        parse_overrides(["bmuf"])
