"""Latent MoE (Megatron-Core 0.16's ``--moe-latent-size``, NVIDIA's latent experts): the routed experts and the
token exchange run at a smaller width L than the model's H.

    x [T, H] --router (at H)--> routing
    x [T, H] --down [L, H]--> [T, L] --dispatch--> experts (H_expert = L) --combine--> [T, L] --up [H, L]--> [T, H]

The two projections are plain linears without bias (Megatron's ``fc1_latent_proj`` / ``fc2_latent_proj``,
``parallel_mode="duplicated"``): replicated over attention tp, each tp rank projecting its own tokens (its
sequence shard, or its 1/tp slice without sequence parallelism), so their gradients are partial sums over tp
(marked ``mark_sequence_parallel``; the trainer all-reduces them), like the router's weight. The shared experts
stay at H. Nothing crosses ranks here; the dispatcher moves L-wide rows instead of H-wide ones.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moefold.parallel.sharding import mark_sequence_parallel, normal_init, set_init


class LatentProjection(nn.Module):
    """``y [T, out] = x [T, in] @ weight.T``; weight [out, in] in the model dtype, replicated over tp.
    ``seed``: of the constructor's draw (the two projections of a layer take different ones)."""

    def __init__(self, in_features: int, out_features: int, init_std: float, *, seed: int = 0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        mark_sequence_parallel(self.weight)
        set_init(self.weight, normal_init(init_std))
        if not self.weight.is_meta:
            # replicated: the constructor's value must be the same on every rank and device (a seeded CPU draw,
            # copied in, as the router's); init_parameters() overwrites it layout-independently
            draw = torch.empty(out_features, in_features).normal_(0.0, init_std,
                                                                  generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                self.weight.copy_(draw)

    def forward(self, x_TI: Tensor) -> Tensor:
        return torch.nn.functional.linear(x_TI.to(self.weight.dtype), self.weight)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}"
