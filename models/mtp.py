"""Multi-token prediction (DeepSeek-V3 MTP): extra modules that predict the token ``k + 1`` ahead.

Depth ``k`` (1-based) combines the previous depth's normalised hidden state ``h^{k-1}`` (depth 0: the main
model's last block output after the final norm, the output head's input) with the embedding of the input
tokens shifted ``k`` to the left, as Megatron-Core 0.16 does (it moves the final norm into the decoder
block when MTP is on, ``transformer_block.py``, and each MTP layer passes its ``final_layernorm`` output on)::

    h'^k = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)])      (concat order of DeepSeek/Megatron)
    h^k  = final_layernorm_k(Block_k(h'^k))                       (a full transformer block, MoE FFN)
    logits^k = OutputHead(h^k)                                    (embedding and head shared with the model)

and is trained on the labels shifted ``k`` to the left (the last ``k`` positions masked). The MTP
loss is ``mean_k L_k`` and enters the training loss as ``mtp_loss_scaling_factor * mean_k L_k``
(Megatron/DeepSeek: the factor divided by the number of depths, summed). HF names per depth
(``model.layers.{num_layers + k - 1}.``): ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``
(our ``final_layernorm``) and the block's usual names.

Under context parallelism the shift needs tokens held by other CP ranks: ``shift_left`` gathers the
(small, integer) token tensors over cp, shifts, and re-splits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from moefold.dense.block import TransformerBlock
from moefold.dense.context_parallel import gather_from_context_parallel, split_for_context_parallel
from moefold.dense.documents import Documents
from moefold.dense.linear import ColumnParallelLinear
from moefold.dense.norm import RMSNorm
from moefold.models.config import ModelConfig
from moefold.models.layer_factory import build_block
from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import Group, group_size
from moefold.parallel.sharding import mark_sequence_parallel


def shift_left(x_SB: Tensor, k: int, fill: int | float, cp_group: Group, cp_rank: int) -> Tensor:
    """``x`` shifted ``k`` positions to the left along the sequence (dim 0), ``fill`` entering on the right.

    ``x_SB`` is this rank's CP part of a ``[S, ...]`` tensor (no gradient). With cp > 1 it is
    all-gathered over ``cp_group``, shifted and split again (one all-gather of S*B values).
    """
    cp = group_size(cp_group)
    full = gather_from_context_parallel(x_SB, cp_group, 0) if cp > 1 else x_SB
    out = torch.full_like(full, fill)
    if k < full.shape[0]:
        out[: full.shape[0] - k] = full[k:]
    return split_for_context_parallel(out, cp_rank, cp, 0) if cp > 1 else out


class MTPModule(nn.Module):
    """One MTP depth. forward(hidden [S, B, H], embedded [S, B, H], position_ids [S], documents) -> (hidden, moe
    extra); ``documents``: the sample's packed documents (``dense.documents``), or None.

    Activations are the SP shard ``[S/tp, B, H]`` under sequence parallelism. ``eh_proj`` ``[H, 2H]``
    is replicated over tp (it runs on the shard under SP: partial gradient, marked sequence-parallel).
    """

    def __init__(self, config: ModelConfig, index: int, dims: ParallelDims, options: ModelOptions, *,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        H, sp = config.hidden_size, options.sequence_parallel and dims.tp > 1
        kw = {"sequence_parallel": sp, "zero_centered_gamma": config.norm_zero_centered_gamma,
              "dtype": options.torch_dtype, "device": device}
        self.index = index
        self.enorm = RMSNorm(H, config.norm_eps, **kw)
        self.hnorm = RMSNorm(H, config.norm_eps, **kw)
        self.eh_proj = ColumnParallelLinear(2 * H, H, None, init_std=options.init_std, dtype=options.torch_dtype,
                                            device=device)
        if sp:
            mark_sequence_parallel(self.eh_proj.weight)
        self.block: TransformerBlock = build_block(config, index, dims, options, device=device)
        self.final_layernorm = RMSNorm(H, config.norm_eps, **kw)

    def forward(self, hidden: Tensor, embedded: Tensor, position_ids: Tensor, documents: Documents | None = None,
                **ffn_kwargs: Any) -> tuple[Tensor, Any]:
        h = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.block(h, position_ids, documents, **ffn_kwargs)
