"""A MoE layer's outputs and gradients on one rank of a layout against the world-1 layer's (in a spawned world)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moefold.moe.experts import is_expert
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import gather_full, is_sequence_parallel, shards_of

# one 4-rank world's MoE layouts: (label, ParallelConfig, dispatcher, sequence parallel)
LAYOUTS = [  # (label, ParallelConfig, dispatcher, sequence parallel)
    ("ep2 alltoall", ParallelConfig(ep=2), "alltoall", False),
    ("ep4 alltoall", ParallelConfig(ep=4), "alltoall", False),
    ("ep2 allgather", ParallelConfig(ep=2), "allgather", False),
    ("etp2 alltoall", ParallelConfig(etp=2), "alltoall", False),
    ("ep2xetp2 allgather", ParallelConfig(ep=2, etp=2), "allgather", False),
    ("tp2 sp ep2", ParallelConfig(tp=2, ep=2), "alltoall", True),
    ("tp2 no-sp", ParallelConfig(tp=2), "alltoall", False),
]


def layer_failures(label: str, layer: nn.Module, dims: ParallelDims, pairs: list[tuple[str, torch.Tensor,
                   torch.Tensor]], ref_grads: dict[str, torch.Tensor], tol: float) -> list[str]:
    """``pairs``: (name, this rank's tensor, world 1's) compared elementwise; each parameter's gradient summed over
    its data-parallel group (and over tp when sequence-parallel), gathered whole, against ``ref_grads`` (world 1's
    summed over the dp shares), within ``tol`` x its largest magnitude. A collective: every rank calls it."""
    failures = []
    for name, a, b in pairs:
        if not torch.allclose(a.float(), b.float(), atol=tol, rtol=tol):
            failures.append(f"{label} {name}: max err {(a.float() - b.float()).abs().max():.3g}")
    for name, p in layer.named_parameters():
        grad = p.grad.float()
        dist.all_reduce(grad, group=dims.edp_group if is_expert(p) else dims.dp_group)
        if is_sequence_parallel(p) and not is_expert(p):
            dist.all_reduce(grad, group=dims.tp_group)
        full, ref_grad = gather_full(grad, shards_of(p)), ref_grads[name].float()
        scale = max(1.0, float(ref_grad.abs().max()))
        if not torch.allclose(full, ref_grad, atol=tol * scale, rtol=tol):
            failures.append(f"{label} grad {name}: max err {(full - ref_grad).abs().max():.3g}")
    return failures
