"""Learning-rate schedules: linear warmup, then cosine / linear / constant / WSD decay to ``min_lr``.

Warmup follows Megatron-Core's ``OptimizerParamScheduler``: step ``s < warmup`` runs at
``warmup_init + (lr - warmup_init) * s / warmup``, so the first step runs at ``warmup_init`` (0 by default,
Megatron's ``--lr-warmup-init``) and step ``warmup`` at ``lr``. ``warmup_skip_zero`` keeps moefold's
earlier warmup, ``lr * (s + 1) / warmup``, whose first step already learns (nothing is spent at lr 0).

A schedule is a pure function of the optimizer step (0-based index of the step about to run), so its
checkpointed state is only that step; resuming at any layout gives the same learning rates.

WSD (warmup-stable-decay, MiniCPM): after warmup the rate stays at ``lr`` until the last
``wsd_decay_iters`` steps, which decay to ``min_lr`` (``wsd_decay_style``: linear, cosine, 1-sqrt (Megatron's
minus_sqrt) or exponential), with Megatron's step arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_STYLES = ("cosine", "linear", "constant", "WSD")
WSD_STYLES = ("linear", "cosine", "1-sqrt", "minus_sqrt", "exponential")   # minus_sqrt: Megatron's 1-sqrt


@dataclass(frozen=True)
class LRSchedule:
    """lr(step) for ``step`` in [0, decay_iters); held at ``min_lr`` after ``decay_iters``.

    lr:               peak rate (after warmup)
    min_lr:           final rate
    warmup_iters:     steps of linear warmup from warmup_init to lr
    warmup_init:      lr of step 0 (Megatron's --lr-warmup-init)
    warmup_skip_zero: warm up as lr * (step + 1) / warmup_iters (moefold's earlier convention)
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
    warmup_init: float = 0.0
    warmup_skip_zero: bool = False

    def __post_init__(self) -> None:
        if not self.lr >= 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr={self.min_lr} <= lr={self.lr}")
        if not 0 <= self.warmup_init <= self.lr:
            raise ValueError(f"need 0 <= warmup_init={self.warmup_init} <= lr={self.lr}")
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
            if self.warmup_skip_zero:
                return self.lr * (step + 1) / self.warmup_iters
            return self.warmup_init + (self.lr - self.warmup_init) * step / self.warmup_iters
        if self.style == "constant":
            return self.lr
        if step >= self.decay_iters:
            return self.min_lr
        span = self.lr - self.min_lr
        if self.style == "WSD":   # Megatron's: the decay's first step is the one after decay_iters - wsd
            start = self.decay_iters - self.wsd_decay_iters
            if step <= start or self.wsd_decay_iters == 0:
                return self.lr
            t = (step - start) / self.wsd_decay_iters
            if self.wsd_decay_style == "linear":
                return self.lr - span * t
            if self.wsd_decay_style == "cosine":
                return self.min_lr + span * 0.5 * (1 + math.cos(math.pi * t))
            if self.wsd_decay_style == "exponential":
                return self.min_lr + span * (2.0 * 0.5 ** t - 1.0)
            return self.min_lr + span * (1 - math.sqrt(t))
        t = (step - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        if self.style == "linear":
            return self.lr - span * t
        return self.min_lr + span * 0.5 * (1 + math.cos(math.pi * t))
