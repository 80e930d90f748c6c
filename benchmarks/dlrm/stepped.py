"""What the harness's baselines that sync in the step share: a context manager that runs its work
after every `optimizer.step()` while entered, and counts it in `SyncMetrics` like ShadowSync's."""

from __future__ import annotations

import abc
import types
from typing import Any

from shadowgba.metrics import SyncMetrics
from shadowgba.step_hook import StepHook


class AfterEveryStep(abc.ABC):
    """While entered, `optimizer.step()` is followed by `_after_step()`; `metrics` has ShadowSync's keys."""

    def __init__(self, optimizer: Any) -> None:
        self.metrics = SyncMetrics()
        self._hook = StepHook([optimizer], self._after_step)

    def __enter__(self) -> "AfterEveryStep":
        self._hook.install()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: types.TracebackType | None) -> None:
        self._hook.remove()

    @abc.abstractmethod
    def _after_step(self) -> None:
        """The baseline's work after one optimizer step."""
