"""Live control: change sync frequency while a job runs by editing a small YAML file.

    # control.yaml, named by sync.control_file
    interval_ms: 200        # shadow mode pacing: the least time between two rounds
    interval_steps: 2       # and not before the fastest rank has taken this many steps
    max_round_share: 0.1    # and the rounds take at most this share of the wall time
    max_step_cost: 0.02     # and cost the training threads at most this share of their time
    max_gap_steps: 10       # but a round starts at most this many steps after the last one
    warn_gap_steps: 100     # warn when a rank goes this many steps without a round
    foreground_every: 50    # foreground mode period

Each rank polls the file (at most once a second) and applies a change at its next round. Ranks may
apply it at different steps: rounds pair across ranks by their order, not by step number, and the
stop flag ends them together (see `sync_algos.base`), so no collective can be left unmatched. A file
that cannot be read or fails validation is logged and ignored; the job keeps its settings.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

from shadowgba.config import LIVE_FIELDS, ConfigError, check_live_fields, load_config

logger = logging.getLogger("shadowgba")


@dataclasses.dataclass
class LiveSettings:
    """The settings a control file may change; absent keys stay as they are. Each one means what the
    `SyncConfig` field of its name means, and must be what that one must be (`LIVE_FIELDS`)."""

    interval_ms: float | None = None
    """New shadow-mode pacing, >= 0."""
    interval_steps: int | None = None
    """New shadow-mode pacing in the fastest rank's steps, >= 0."""
    max_round_share: float | None = None
    """New most share of the wall time the rounds may take, in (0, 1]."""
    max_step_cost: float | None = None
    """New most share of the training threads' time the rounds may cost them, in (0, 1]."""
    max_gap_steps: int | None = None
    """New floor on the round rate: the most steps of the fastest rank between two round starts, >= 0."""
    warn_gap_steps: int | None = None
    """New sync gap past which a rank warns, >= 0 (0: no warning)."""
    foreground_every: int | None = None
    """New foreground-mode period in training steps, >= 1."""

    def __post_init__(self) -> None:
        check_live_fields(self, LIVE_FIELDS)


class ControlFile:
    """Watches one file; `poll()` returns new settings when the file changed since the last poll."""

    POLL_INTERVAL_S = 1.0

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._seen_mtime: float | None = None
        self._next_poll = 0.0

    def poll(self) -> LiveSettings | None:
        now = time.monotonic()
        if now < self._next_poll:
            return None
        self._next_poll = now + self.POLL_INTERVAL_S
        try:
            mtime = os.stat(self.path).st_mtime
        except FileNotFoundError:
            return None
        if mtime == self._seen_mtime:
            return None
        self._seen_mtime = mtime
        try:
            settings = load_config(LiveSettings, self.path)
        except ConfigError as error:
            logger.warning("shadowgba: ignoring control file %s: %s", self.path, error)
            return None
        logger.info("shadowgba: control file %s: %s", self.path, settings)
        return settings
