"""moefold's learning rate at every step equals Megatron-Core 0.16.1's ``OptimizerParamScheduler`` (warmup from
``--lr-warmup-init``, then cosine / linear / constant / WSD decay), stepped the way Megatron-LM steps it (by the
global batch size, with iteration-based warmup and decay lengths converted to samples)."""

from __future__ import annotations

import pytest
import torch

from moefold.training.optim.lr_schedule import LRSchedule
from tests.megatron_compat import patch_for_cpu, require_megatron


def _megatron_lrs(steps, gbs, lr, min_lr, warmup, decay, style, init=0.0, wsd_iters=0, wsd_style="linear"):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = OptimizerParamScheduler(opt, init_lr=init, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup * gbs,
                                    lr_decay_steps=decay * gbs, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=decay * gbs, wd_incr_style="constant",
                                    wsd_decay_steps=wsd_iters * gbs if style == "WSD" else None,
                                    lr_wsd_decay_style=wsd_style)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])   # the lr the optimizer step of this iteration uses
        sched.step(increment=gbs)
    return out


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_lr_equals_megatron_scheduler(style):
    require_megatron()
    patch_for_cpu()
    for init in (0.0, 1e-4):
        ours = LRSchedule(lr=3e-3, min_lr=3e-4, warmup_iters=5, decay_iters=20, style=style, warmup_init=init)
        theirs = _megatron_lrs(25, 8, 3e-3, 3e-4, 5, 20, style, init)
        assert [ours(s) for s in range(25)] == pytest.approx(theirs, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("wsd_style", [("linear", "linear"), ("cosine", "cosine"), ("1-sqrt", "minus_sqrt"),
                                       ("exponential", "exponential")], ids=lambda s: s[0])
def test_wsd_equals_megatron_scheduler(wsd_style):
    require_megatron()
    patch_for_cpu()
    ours = LRSchedule(lr=2e-3, min_lr=1e-4, warmup_iters=3, decay_iters=20, style="WSD", wsd_decay_iters=6,
                      wsd_decay_style=wsd_style[0])
    theirs = _megatron_lrs(24, 4, 2e-3, 1e-4, 3, 20, "WSD", wsd_iters=6, wsd_style=wsd_style[1])
    assert [ours(s) for s in range(24)] == pytest.approx(theirs, rel=1e-12, abs=1e-15)


def test_warmup_starts_at_zero_like_megatron():
    require_megatron()
    patch_for_cpu()
    theirs = _megatron_lrs(6, 4, 1.0, 0.0, 4, 10, "linear")
    ours = LRSchedule(lr=1.0, min_lr=0.0, warmup_iters=4, decay_iters=10, style="linear")
    assert theirs[:5] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [ours(s) for s in range(5)] == theirs[:5]
    old = LRSchedule(lr=1.0, min_lr=0.0, warmup_iters=4, decay_iters=10, style="linear", warmup_skip_zero=True)
    assert [old(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
