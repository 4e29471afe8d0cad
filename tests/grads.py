"""Gradients of a parallel model as world 1 would see them, for layout-equality tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moefold.moe.experts import is_expert
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import group_size
from moefold.parallel.sharding import gather_full, is_sequence_parallel, shards_of


def reduced_full_grads(model: nn.Module, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """Each parameter's gradient reduced the way the trainer reduces it (sequence-parallel partials
    over tp; experts over edp, the rest over dp x cp; averaged over dp), gathered to full shape.

    Collective over every group of ``dims``: all ranks call it with the same model structure.
    """
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        if is_sequence_parallel(p) and dims.tp > 1:
            dist.all_reduce(g, group=dims.tp_group)
        group = dims.edp_group if is_expert(p) else dims.dp_cp_group
        if group_size(group) > 1:
            dist.all_reduce(g, group=group)
        out[name] = gather_full(g / dims.dp, shards_of(p))
    return out
