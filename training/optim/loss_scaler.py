"""Loss scaling for fp16 training (``--fp16``), Megatron's ``ConstantGradScaler`` / ``DynamicGradScaler``.

fp16 has 5 exponent bits: gradients below 2^-24 flush to zero. The loss is multiplied by ``scale`` before
backward, so the gradients are ``scale`` times larger while they are fp16; the fp32 main gradients are
divided by it again before clipping and the update (the trainer folds ``1 / scale`` into the clip factor, so
unscaling costs no extra pass over the gradients).

An overflow (a non-finite gradient anywhere) is decided from the step's global gradient norm, which the
trainer already all-reduces over the world: one collective, so every rank sees the same flag and skips the
same step. ``update(found_inf)`` then follows Megatron's ``DynamicGradScaler.update`` exactly
(``megatron/core/optimizer/grad_scaler.py``):

- overflow: the growth tracker restarts, the hysteresis tracker drops by one, and once it reaches 0 the scale
  is multiplied by ``backoff_factor`` (0.5; never below ``min_scale``);
- no overflow: after ``growth_interval`` (``--loss-scale-window``) clean steps in a row the scale is multiplied
  by ``growth_factor`` (2) and the hysteresis tracker refilled.

With a static ``--loss-scale`` the scale never changes (an overflowing step is still skipped).

State (``state_dict``): plain Python numbers (scale, growth tracker, hysteresis tracker), stored in the
checkpoint's ``meta.json``: loading it unpickles nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class LossScaler:
    """The loss scale and its trackers. ``dynamic=False``: a constant ``scale`` (``--loss-scale``)."""

    scale: float
    dynamic: bool = True
    min_scale: float = 1.0
    growth_interval: int = 1000
    hysteresis: int = 2
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_tracker: int = 0
    hysteresis_tracker: int = -1   # -1: filled with ``hysteresis`` at construction

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"loss scale {self.scale} must be a finite number > 0")
        if not 0 < self.min_scale <= self.scale:
            raise ValueError(f"--min-loss-scale={self.min_scale} must be > 0 and <= --initial-loss-scale={self.scale}")
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(f"--loss-scale-window={self.growth_interval} and --hysteresis={self.hysteresis} must "
                             "be >= 1")
        if not (self.growth_factor > 1.0 and 0.0 < self.backoff_factor < 1.0):
            raise ValueError(f"growth factor {self.growth_factor} must be > 1, backoff {self.backoff_factor} in (0, 1)")
        if self.hysteresis_tracker < 0:
            self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """After a step: back off on overflow (after ``hysteresis`` of them), grow after a clean window."""
        if not self.dynamic:
            return
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale = self.scale * self.growth_factor

    @property
    def at_minimum(self) -> bool:
        """The scale cannot back off further: an overflow now is not a scaling problem."""
        return not self.dynamic or self.scale <= self.min_scale

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved (a static scale keeps the run's ``--loss-scale``)."""
        if self.dynamic:
            self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


__all__ = ["LossScaler"]
