"""Bad configs fail at start-up with a message that names the key and what is allowed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shadowgba.config import ConfigError, SyncConfig, load_config, parse_overrides
from shadowgba.gba.config import GBAConfig
from sync_algos.bmuf import BMUFConfig


ROOT = Path(__file__).resolve().parents[1]


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
    path = write(tmp_path, "sync:\n  algo: easgd\n  easgd: {beta: 0.5}\nsteps: 3\n")
    job = load_config(Job, path, ["--sync.algo", "bmuf", "--sync.interval_ms=20", "--sync.bmuf.nesterov", "false"])
    assert job.sync.algo == "bmuf" and job.sync.interval_ms == 20.0 and job.steps == 3
    assert isinstance(job.sync.bmuf, BMUFConfig) and job.sync.algorithm_config() is job.sync.bmuf
    assert job.sync.bmuf.nesterov is False
    assert job.sync.easgd.beta == 0.5  # another algorithm's section stays typed and valid, just unused


def test_changing_the_algorithm_leaves_no_options_behind_in_the_wrong_place(tmp_path: Path) -> None:
    """The README's `--sync.algo easgd` on a bmuf file: bmuf's options stay in bmuf's section."""
    path = write(tmp_path, "sync:\n  algo: bmuf\n  bmuf: {block_lr: 1.0, nesterov: true}\n")
    config = load_config(SyncConfig, path, ["--sync.algo", "easgd"], section="sync")
    assert config.algo == "easgd" and config.algorithm_config() is config.easgd
    assert config.section == "easgd" and load_config(SyncConfig, path, ["--algo", "easgd_ps", "--ps.num_servers", "1"],
                                                      section="sync").section == "easgd"


def test_a_section_of_a_larger_job_file_loads_alone_and_ignores_the_application_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "sync:\n  algo: gba\n  gba: {initial_mode: sync}\nmodel: {embedding_dim: 8}\n")
    config = load_config(SyncConfig, path, ["--model.embedding_dim", "4", "--sync.timeout_s", "9"], section="sync")
    assert isinstance(config.gba, GBAConfig) and config.gba.initial_mode == "sync" and config.timeout_s == 9.0
    with pytest.raises(ConfigError, match=r"sync\.gba\.queue_size must be >= 1"):
        load_config(SyncConfig, path, ["--sync.gba.queue_size", "0"], section="sync")


def test_several_servers_may_restart_under_s_easgd(tmp_path: Path) -> None:
    """The centre's slices need no common cut (unlike GBA's dense shards, refused above)."""
    text = "sync: {algo: easgd_ps, ps: {num_servers: 2, num_trainers: 2, checkpoint_dir: ckpt, server_restart_s: 30}}"
    ps = load_config(Job, write(tmp_path, text), []).sync.ps
    assert (ps.num_servers, ps.server_restart_s, ps.checkpoint_dir) == (2, 30.0, "ckpt")


@pytest.mark.parametrize(
    "text,overrides,message",
    [
        ("sync: {algo: sgdx}", [], r"sync\.algo: unknown algorithm 'sgdx'; allowed: \['bmuf', 'easgd', 'easgd_ps', 'gba', 'ma'\]"),
        ("sync: {algo: none}", [], r"sync\.algo: unknown algorithm 'none'"),  # baselines are the harness's
        ("sync: {options: {beta: 0.5}}", [], r"sync\.options: unknown key"),
        ("sync: {algo: easgd_ps}", [], r"sync\.ps\.num_servers: sync\.algo easgd_ps keeps the EASGD centre on the servers"),
        ("sync: {algo: gba}", [], r"sync\.ps\.num_servers: sync\.gba\.initial_mode gba needs at least one parameter server"),
        ("sync: {ps: {num_servers: 1}}", [], r"sync\.ps\.num_servers: parameter servers need sync\.algo gba or easgd_ps, not 'ma'"),
        ("sync: {sharding_group_size: 2, ps: {num_servers: 1}}", [],
         r"sync\.ps\.num_servers: the 2D layout \(sharding_group_size 2\) runs on the trainers alone, with no "
         r"parameter servers; got ps\.num_servers 1 \(set it to 0\)"),
        ("sync: {algo: gba, ps: {num_servers: 1}, timeout_s: 30}", [],
         r"sync\.timeout_s: with parameter servers need ps\.rpc_timeout_s \(60\) <= timeout_s \(30\) <= ps\.trainer_timeout_s \(300\)"),
        ("sync: {algo: gba, ps: {num_servers: 2, num_trainers: 2, checkpoint_dir: ckpt, server_restart_s: 30}}", [],
         r"sync\.ps\.server_restart_s > 0 under gba needs exactly one server, got 2: the dense shards"),
        ("sync: {ps: {rpc_timeout_s: 400}}", [], r"sync\.ps\.rpc_timeout_s must be > 0 and <= trainer_timeout_s \(300\), got 400"),
        ("sync: {algorithm: ma}", [], r"sync\.algorithm: unknown key; allowed keys: \[.*'algo'.*\]"),
        ("sync: {mode: async}", [], r"sync\.mode: 'async' is not allowed; allowed values: \['shadow', 'foreground'\]"),
        ("sync: {interval_ms: -1}", [], r"sync\.interval_ms must be >= 0, got -1"),
        ("sync: {rounds_nice: 20}", [], r"sync\.rounds_nice must be in \[0, 19\], got 20"),
        ("sync: {foreground_every: 0}", [], r"sync\.foreground_every must be >= 1"),
        ("sync: {max_skipped_steps: 0}", [], r"sync\.max_skipped_steps must be >= 1, got 0"),
        ("sync: {interval_ms: fast}", [], r"sync\.interval_ms: expected a number, got 'fast'"),
        ("sync: {final_sync: 1}", [], r"sync\.final_sync: expected true or false, got 1"),
        ("sync: {algo: bmuf, bmuf: {block_momentum: 1.5}}", [], r"sync\.bmuf\.block_momentum must be in \[0, 1\)"),
        ("sync: {algo: easgd, easgd: {eta: 0.1}}", [], r"sync\.easgd\.eta: unknown key; allowed keys: \['alpha', 'beta'\]"),
        ("steps: 2.5", [], r"steps: expected an integer, got 2\.5"),
        ("", ["--sync.writeback", "locked"], r"sync\.writeback: 'locked' is not allowed; allowed values: \['handoff', 'hogwild'\]"),
        ("- just\n- a list", [], r"must hold a mapping, not list"),
        ("sync: {algo: [", [], r"is not valid YAML"),
        ("", ["--sync.timeout_s", ".inf"], r"sync\.timeout_s: expected a finite number, got inf"),
        ("", ["--sync.interval_ms", ".nan"], r"sync\.interval_ms: expected a finite number, got nan"),
        ("sync: {log_interval_s: -.inf}", [], r"sync\.log_interval_s: expected a finite number, got -inf"),
        ("sync: {tensorboard_dir: ''}", [], r"sync\.tensorboard_dir must be a directory path or null, got ''"),
        ("sync: {algo: easgd, easgd: {beta: .nan}}", [], r"sync\.easgd\.beta: expected a finite number, got nan"),
        ("sync: {algo: easgd, easgd: {alpha: .inf}}", [], r"sync\.easgd\.alpha: expected a finite number, got inf"),
        ("sync: {algo: bmuf, bmuf: {block_lr: .inf}}", [], r"sync\.bmuf\.block_lr: expected a finite number, got inf"),
        ("", ["--sync.bmuf.block_momentum", ".nan"], r"sync\.bmuf\.block_momentum: expected a finite number"),
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


def test_the_lane_size_is_read_from_the_ps_section_and_must_be_positive(tmp_path: Path) -> None:
    path = tmp_path / "big_lanes.yaml"
    path.write_text("sync:\n  algo: gba\n  ps: {num_servers: 1, lane_mb: 128}\n")
    assert load_config(SyncConfig, path, section="sync").ps.lane_mb == 128.0
    with pytest.raises((ConfigError, ValueError), match="lane_mb must be > 0, got 0"):
        load_config(SyncConfig, path, ["--sync.ps.lane_mb", "0"], section="sync")


def test_the_job_size_is_refused_before_any_process_group_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """`SyncConfig.check_world_size` on torchrun's WORLD_SIZE; the harness says it in one line and
    exits before it makes a process group."""
    import torch.distributed as dist
    from train_dlrm import main

    two_d = SyncConfig(sharding_group_size=2)
    two_d.check_world_size(4)
    with pytest.raises(ConfigError, match="sharding_group_size: 2 does not divide the job's 3 trainers"):
        two_d.check_world_size(3)
    with pytest.raises(ConfigError, match="ps.num_servers: 2 servers leave no trainer among the job's 2 ranks"):
        load_config(SyncConfig, None, ["--algo", "easgd_ps", "--ps.num_servers", "2"]).check_world_size(2)
    jobs = load_config(SyncConfig, None, ["--sharding_group_size", "2", "--on_group_lost", "continue",
                                          "--replica_jobs.store", "localhost:29700", "--replica_jobs.num_groups", "2",
                                          "--replica_jobs.group", "0"])
    with pytest.raises(ConfigError, match=r"replica_jobs: each torchrun job is one replica group of "
                                          r"sharding_group_size \(2\) ranks, but this one has 4"):
        jobs.check_world_size(4)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit, match="^config error: sync.sharding_group_size: 2 does not divide the job's 3 "
                                         "trainers into equal replica groups$"):
        main(["--config", str(ROOT / "examples/configs/ma_2d.yaml")])
    assert not dist.is_initialized()


@dataclasses.dataclass
class HalfConfig:
    fraction: float = 0.5
    """A share in (0, 1]."""

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")


def test_an_algorithm_registered_outside_the_package_reads_its_own_section(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """`sync.<name>` of an algorithm registered in a user's script is read, checked, overridden on the
    command line and written back like a built-in one's; only model algorithms may be registered so."""
    import sync_algos.registry
    from shadowgba.config import from_dict, to_dict
    from sync_algos.ma import ModelAveraging

    half = type("HalfAveraging", (ModelAveraging,), {"name": "half_ma", "Config": HalfConfig})
    monkeypatch.setitem(sync_algos.registry._ALGORITHMS, "half_ma", half)  # registered for this test only
    job = load_config(Job, write(tmp_path, "sync: {algo: half_ma, half_ma: {fraction: 0.25}}"),
                      ["--sync.half_ma.fraction", "0.75"])
    assert job.sync.algorithm_config() == HalfConfig(0.75)
    assert to_dict(job.sync)["half_ma"] == {"fraction": 0.75} and "registered" not in to_dict(job.sync)
    assert from_dict(SyncConfig, to_dict(job.sync)) == job.sync
    assert load_config(Job, write(tmp_path, "sync: {algo: half_ma}")).sync.algorithm_config() == HalfConfig()
    with pytest.raises(ConfigError, match=r"sync\.half_ma\.fraction must be in \(0, 1\], got 2\.0"):
        load_config(Job, write(tmp_path, "sync: {algo: half_ma, half_ma: {fraction: 2}}"))
    with pytest.raises(ConfigError, match=r"sync\.half_ma\.share: unknown key; allowed keys: \['fraction'\]"):
        load_config(Job, write(tmp_path, "sync: {algo: half_ma, half_ma: {share: 2}}"))
    with pytest.raises(ConfigError, match=r"sync\.registered: unknown key"):
        load_config(Job, write(tmp_path, "sync: {registered: {}}"))
    pushing = type("Pushing", (ModelAveraging,), {"name": "pushing", "Config": HalfConfig, "kind": "gradient"})
    monkeypatch.setitem(sync_algos.registry._ALGORITHMS, "pushing", pushing)
    with pytest.raises(ConfigError, match="'pushing' is a gradient algorithm; an algorithm registered outside"):
        load_config(Job, write(tmp_path, "sync: {algo: pushing}"))
