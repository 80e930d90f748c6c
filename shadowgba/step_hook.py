"""Marking the step boundary without changing the user's loop: wrap `step` on optimizer instances.

Wrapping the instance (not the class, not torch's global optimizer hooks) works for torch
optimizers, TorchRec's KeyedOptimizer / CombinedOptimizer (which do not run torch's step hooks)
and TorchRec's train pipelines, which call `optimizer.step()` themselves. `remove()` restores the
class's method by deleting the instance attribute.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


class StepHook:
    """Runs `on_step` at every optimizer step: after the original step, or instead of it. With
    `before_step`, the original step runs only if `before_step(optimizer)` says so (a step whose
    gradients hold NaN / Inf is skipped); `on_step` runs either way."""

    def __init__(self, optimizers: Sequence[Any], on_step: Callable[[], None], replace_step: bool = False,
                 before_step: Callable[[Any], bool] | None = None) -> None:
        for optimizer in optimizers:
            if not callable(getattr(optimizer, "step", None)):
                raise TypeError(f"{type(optimizer).__name__} has no step() to hook")
        self.optimizers = list(optimizers)
        self._on_step = on_step
        self._replace_step = replace_step
        self._before_step = before_step

    def install(self) -> None:
        for optimizer in self.optimizers:
            original = optimizer.step

            def step(*args: Any, _original: Callable[..., Any] = original, _optimizer: Any = optimizer,
                     **kwargs: Any) -> Any:
                run = not self._replace_step and (self._before_step is None or self._before_step(_optimizer))
                result = _original(*args, **kwargs) if run else None
                self._on_step()
                return result

            optimizer.step = step

    def remove(self) -> None:
        for optimizer in self.optimizers:
            vars(optimizer).pop("step", None)
