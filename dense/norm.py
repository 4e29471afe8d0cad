"""RMSNorm with fp32 statistics, numerically the HF ``LlamaRMSNorm`` family (Qwen3, Mixtral, DeepSeek-V3), and
its zero-centred-gamma variant (HF ``Qwen3NextRMSNorm``, Megatron's ``--apply-layernorm-1p``).

The weight is replicated across TP. Under sequence parallelism each rank normalises only its
sequence shard, so the weight's gradient is partial: the ``sequence_parallel`` flag marks it
(``mark_sequence_parallel``) for an all-reduce over the tp group. Nothing crosses ranks here.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moefold.parallel.sharding import mark_sequence_parallel


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim.

    forward(x [..., hidden]) -> [..., hidden] in ``x.dtype``: statistics in fp32, the normalised
    value cast back to the input dtype, then multiplied by the weight (HF order, so bf16 results
    match HF bit for bit).

    ``zero_centered_gamma``: the stored weight is ``gamma - 1`` (initialised to 0, so weight decay pulls the
    scale towards 1, not 0) and the output is ``(x_normalised * (1 + weight))`` computed in fp32 and cast
    once, the order of HF ``Qwen3NextRMSNorm``.
    """

    def __init__(self, hidden: int, eps: float = 1e-6, *, sequence_parallel: bool = False,
                 zero_centered_gamma: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"RMSNorm hidden={hidden!r} must be a positive integer")
        if not eps > 0:
            raise ValueError(f"RMSNorm eps={eps!r} must be > 0")
        self.hidden, self.eps, self.zero_centered_gamma = hidden, float(eps), zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(init(hidden, dtype=dtype, device=device))
        if sequence_parallel:
            mark_sequence_parallel(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.hidden:
            raise ValueError(f"RMSNorm(hidden={self.hidden}) got an input of shape {tuple(x.shape)}")
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered_gamma:
            return (x32 * (1.0 + self.weight.float())).to(input_dtype)
        return self.weight * x32.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}" + (", zero_centered_gamma" if self.zero_centered_gamma else "")
