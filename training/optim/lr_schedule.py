"""Learning-rate schedules: linear warmup, then cosine / linear / constant / WSD decay to ``min_lr``.

A schedule is a pure function of the optimizer step (0-based index of the step about to run), so its
checkpointed state is only that step; resuming at any layout gives the same learning rates.

WSD (warmup-stable-decay, MiniCPM): after warmup the rate stays at ``lr`` until the last
``wsd_decay_iters`` steps, which decay to ``min_lr`` (``wsd_decay_style``: linear, cosine or
1-sqrt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_STYLES = ("cosine", "linear", "constant", "WSD")
WSD_STYLES = ("linear", "cosine", "1-sqrt")


@dataclass(frozen=True)
class LRSchedule:
    """lr(step) for ``step`` in [0, decay_iters); held at ``min_lr`` after ``decay_iters``.

    lr:               peak rate (after warmup)
    min_lr:           final rate
    warmup_iters:     steps of linear warmup from lr/warmup to lr
    decay_iters:      step at which the decay ends (usually train_iters)
    style:            one of DECAY_STYLES
    wsd_decay_iters:  WSD only: length of the final decay phase
    wsd_decay_style:  WSD only: shape of the final decay, one of WSD_STYLES
    """

    lr: float
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int = 1
    style: str = "cosine"
    wsd_decay_iters: int = 0
    wsd_decay_style: str = "linear"

    def __post_init__(self) -> None:
        if not self.lr >= 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr={self.min_lr} <= lr={self.lr}")
        if self.warmup_iters < 0:
            raise ValueError(f"warmup_iters={self.warmup_iters} must be >= 0")
        if self.decay_iters < 1:
            raise ValueError(f"decay_iters={self.decay_iters} must be >= 1")
        if self.style not in DECAY_STYLES:
            raise ValueError(f"lr decay style {self.style!r}; valid: {', '.join(DECAY_STYLES)}")
        if self.wsd_decay_style not in WSD_STYLES:
            raise ValueError(f"wsd_decay_style={self.wsd_decay_style!r}; valid: {', '.join(WSD_STYLES)}")
        if self.style == "WSD" and not 0 <= self.wsd_decay_iters <= self.decay_iters - self.warmup_iters:
            raise ValueError(f"wsd_decay_iters={self.wsd_decay_iters} must lie in [0, decay_iters - warmup_iters = "
                             f"{self.decay_iters - self.warmup_iters}]")

    def __call__(self, step: int) -> float:
        if step < self.warmup_iters:
            return self.lr * (step + 1) / self.warmup_iters
        if self.style == "constant":
            return self.lr
        if step >= self.decay_iters:
            return self.min_lr
        span = self.lr - self.min_lr
        if self.style == "WSD":
            start = self.decay_iters - self.wsd_decay_iters
            if step < start or self.wsd_decay_iters == 0:
                return self.lr
            t = (step - start + 1) / self.wsd_decay_iters
            if self.wsd_decay_style == "linear":
                return self.lr - span * t
            if self.wsd_decay_style == "cosine":
                return self.min_lr + span * 0.5 * (1 + math.cos(math.pi * t))
            return self.min_lr + span * (1 - math.sqrt(t))
        t = (step - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        if self.style == "linear":
            return self.lr - span * t
        return self.min_lr + span * 0.5 * (1 + math.cos(math.pi * t))
