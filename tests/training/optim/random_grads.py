"""Reduced gradients for the optimizer tests: the same full random gradient on every layout, each rank's slice
written into its parameters' main grads, and the world's gradient norm checked against the full one."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from moefold.parallel.sharding import full_shape, local_slice, shards_of


def set_random_grads(params: dict[str, nn.Parameter], step: int, optimizer, where: object) -> dict[str, torch.Tensor]:
    """Write step ``step``'s full gradients (seeded by name) into ``params``' main grads (the reduced gradient of
    this rank's slices); check ``optimizer.grad_norm()`` against their norm (collective). Returns them full."""
    full_grads = {}
    for name, p in params.items():
        gen = torch.Generator().manual_seed(step * 7919 + zlib.crc32(name.encode()))
        full_grads[name] = torch.randn(full_shape(p), generator=gen)
        p.main_grad.copy_(local_slice(full_grads[name], shards_of(p)))
    norm = float(optimizer.grad_norm())
    ref_norm = float(torch.sqrt(sum(g.double().square().sum() for g in full_grads.values())))
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (where, norm, ref_norm)
    return full_grads


def step_both(optimizer, reference: torch.optim.Optimizer, ref_params: dict[str, torch.Tensor],
              full_grads: dict[str, torch.Tensor], step: int, base_lr: float) -> tuple[float, float]:
    """Step ``optimizer`` and the single-process ``reference`` (over full ``ref_params``) with step ``step``'s lr
    (``base_lr * (step + 1)``) and a clip coefficient of 0.5. Returns (lr, clip coefficient)."""
    lr, coef = base_lr * (step + 1), 0.5
    optimizer.step(lr, coef)
    for group in reference.param_groups:
        group["lr"] = lr
    for name, p in ref_params.items():
        p.grad = full_grads[name] * coef
    reference.step()
    return lr, coef
