"""Weight prediction for GBA trainers (`GBAConfig.lookahead`): compute each gradient on the
parameters it will be applied to, extrapolated, rather than on the ones received.

A GBA gradient computed on the parameters of global step t is applied at global step k >= t: its
staleness is s = k - t (one step for equal-speed trainers that do not wait, about the slowdown for
a straggler). Adam's consecutive updates are strongly alike (its first moment averages about the
last 10 gradients at beta1 = 0.9), so the parameters s steps on are close to

    w_pred = w_t + s_hat * v,    v = (w_t - w_t') / (t - t')

with v the parameters' velocity per global step between the trainer's last two installs and s_hat
its recent staleness (a moving average of what its answered pushes report). The gradient at
w_pred is then nearly the one the shards would have computed at w_k. Why it matters: a delay
shrinks the learning rates at which momentum stays stable by a large factor (docs/gba.md, "What
one step of staleness costs"), and the production preset trains near that edge, so one step of
staleness cost more AUC than plain async's several. This is the weight-prediction family of delay
compensation (as in pipeline-parallel training), chosen over DC-ASGD's server-side correction
`g + lambda g*g*(w_k - w_t)` because it needs no copy of past parameters on the shards and no
lambda to tune.

The trainer keeps three extra flat vectors (the received parameters, the velocity and the
prediction, so that no step allocates); the live parameters, which forward and backward read, are
the prediction, except inside `received()` (an evaluation mid-run: the model is what the shards
hold, not where it is predicted to go). Exact installs (entering GBA, lockstep waits, the closing
pull, a server's restart) set the live parameters to the received ones and forget the velocity.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from shadowgba.dense import DenseParams

SMOOTHING = 0.2
"""Weight of the newest staleness in the moving average (about the last 5 to 10 pushes)."""
LONGEST_GAP = 8
"""A velocity is measured only between installs at most this many global steps apart: past it
(a switch, a long pause) the two parameter vectors say little about the next steps."""


class Lookahead:
    """One trainer's received parameters, their velocity and its staleness; training thread only,
    except `observe` (the pusher thread: one float written, read at the next install)."""

    def __init__(self, dense: DenseParams, scale: float) -> None:
        """`scale` (`GBAConfig.lookahead`): the prediction's reach, as a multiple of the trainer's
        recent staleness; 0 turns it off (the live parameters are the received ones)."""
        self._dense = dense
        self.scale = scale
        self.staleness = 0.0
        """Moving average of this trainer's answered pushes' staleness, in global steps."""
        self._received = dense.empty() if scale > 0 else None
        self._velocity = dense.empty() if scale > 0 else None
        self._live = dense.empty() if scale > 0 else None
        self._tokens: list[int | None] = []
        """Per shard, the global step of the received slice; None: unknown (velocity invalid)."""

    def held_tensors(self) -> dict[str, torch.Tensor]:
        """For `metrics.memory()`: the received parameters, their velocity and the prediction."""
        buffers = {"received": self._received, "velocity": self._velocity, "prediction": self._live}
        return {f"lookahead_{name}": buffer for name, buffer in buffers.items() if buffer is not None}

    def observe(self, staleness: int) -> None:
        """A push was answered: its gradient was applied `staleness` global steps after the step of
        the parameters it was computed on."""
        self.staleness = (1 - SMOOTHING) * self.staleness + SMOOTHING * max(0, staleness)

    def install(self, slices: list[torch.Tensor | None], tokens: list[int], bounds: list[tuple[int, int]],
                exact: bool) -> None:
        """Install the shards' slices (None: that shard's is unchanged) received at `tokens`; the
        live parameters become the prediction, or the received values when `exact` or off."""
        if self._received is None or self._velocity is None or self._live is None:
            for piece, (start, _) in zip(slices, bounds):
                if piece is not None:
                    self._dense.copy_from(piece, start)
            return
        if exact or len(self._tokens) != len(tokens):
            self._tokens = [None] * len(tokens)
        for index, (piece, (start, end)) in enumerate(zip(slices, bounds)):
            if piece is None:
                continue
            received, velocity, known = self._received[start:end], self._velocity[start:end], self._tokens[index]
            gap = tokens[index] - known if known is not None else 0
            if not 0 < gap <= LONGEST_GAP:  # also after an exact install, which forgot the tokens
                velocity.zero_()
            else:
                torch.sub(piece, received, out=velocity).div_(gap)
            received.copy_(piece)
            self._tokens[index] = tokens[index]
        reach = 0.0 if exact else self.scale * self.staleness
        if reach == 0:
            self._dense.copy_from(self._received)
        else:
            self._dense.copy_from(torch.add(self._received, self._velocity, alpha=reach, out=self._live))

    @contextlib.contextmanager
    def received(self) -> Iterator[None]:
        """Inside, the live parameters are the received ones; after, what was live before. Training
        thread, between steps (installs happen there too)."""
        if self._received is None or self._live is None or not self._tokens:  # off, or nothing received in GBA
            yield
            return
        self._dense.copy_to(self._live)
        self._dense.copy_from(self._received)
        try:
            yield
        finally:
            self._dense.copy_from(self._live)

    def forget(self) -> None:
        """Leaving GBA: the next install is treated as the first (no velocity across a switch)."""
        self._tokens = []
        self.staleness = 0.0
