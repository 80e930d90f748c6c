"""Test-only fault injection: one place where the harness kills one of its own trainers on purpose.

    SHADOWGBA_TEST_KILL_AT_STEP=1:15   # trainer 1 SIGKILLs itself right after step 15 (and its checkpoint)

It fires only in a job's first attempt (`TORCHELASTIC_RESTART_COUNT`, 0 when unset), so the job
that torchrun restarts (`--max-restarts`) runs through. Before dying it appends one JSON line
`{"trainer", "step", "restart_count", "pid"}` to `SHADOWGBA_TEST_FAULT_LOG` (when set) and prints
it to stderr, so a test can assert that the fault fired and where; and a run that was armed but
ended before the step raises instead of passing silently.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from shadowgba.ps.transport import restart_count  # re-exported: the harness reads it here

KILL_ENV = "SHADOWGBA_TEST_KILL_AT_STEP"
LOG_ENV = "SHADOWGBA_TEST_FAULT_LOG"


class KillAt:
    """The armed fault of trainer `trainer_index`, if `SHADOWGBA_TEST_KILL_AT_STEP` names it."""

    def __init__(self, trainer_index: int) -> None:
        self.trainer_index = trainer_index
        self.step: int | None = None
        spec = os.environ.get(KILL_ENV)
        if not spec:
            return
        try:
            trainer, step = (int(part) for part in spec.split(":"))
        except ValueError:
            raise ValueError(f"{KILL_ENV} must be TRAINER:STEP (two integers), got {spec!r}") from None
        if trainer == trainer_index and restart_count() == 0:
            self.step = step

    def after_step(self, step: int) -> None:
        """Kill this process (SIGKILL, no clean-up of any kind) if the fault is due at `step`."""
        if self.step is None or step != self.step:
            return
        record = {"trainer": self.trainer_index, "step": step, "restart_count": restart_count(), "pid": os.getpid()}
        line = json.dumps(record)
        if os.environ.get(LOG_ENV):
            with open(os.environ[LOG_ENV], "a") as log:
                log.write(line + "\n")
                log.flush()
                os.fsync(log.fileno())
        print(f"fault injection: {line}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def check_fired(self, last_step: int) -> None:
        """Raise if the fault was armed for this attempt but the run ended before reaching it."""
        if self.step is not None:
            raise RuntimeError(f"{KILL_ENV} armed trainer {self.trainer_index} at step {self.step}, "
                               f"but the run ended at step {last_step} without firing")
