"""The transformer block: pre-norm attention + residual, pre-norm FFN + residual.

The attention and the FFN are modules handed in, so the same block carries GQA or MLA and a
dense MLP or the MoE layer. Parameter names follow HF (``input_layernorm``, ``self_attn``,
``post_attention_layernorm``, ``mlp``). Under sequence parallelism the block's input and output
are this rank's sequence shard ``[S/tp, B, H]``; the norms are replicated with partial
gradients (marked ``mark_sequence_parallel``), and the attention/FFN modules gather and
reduce-scatter the sequence themselves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from moefold.dense.norm import RMSNorm
from moefold.dense.recompute import check_recompute, checkpointed


class TransformerBlock(nn.Module):
    """forward(x [S, B, H] (or [S/tp, B, H] with SP), position_ids [S] int64) -> (x, extra).

    ``attention(x, position_ids) -> x``. ``ffn(x)`` returns a Tensor or ``(Tensor, extra)`` (the
    MoE layer's losses/statistics); ``extra`` is returned as is, None for a plain FFN.

    ``recompute``: "full" checkpoints the whole block (non-reentrant ``torch.utils.checkpoint``);
    "selective" is done inside the attention module (its config's ``recompute``); "none" keeps
    everything. The FFN must be free of forward side effects for "full" (it runs twice).
    """

    def __init__(self, hidden: int, attention: nn.Module, ffn: nn.Module, norm_eps: float = 1e-6, *,
                 sequence_parallel: bool = False, recompute: str = "none", dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.recompute = check_recompute(recompute, "TransformerBlock recompute")
        self._checkpoint_block = recompute == "full"  # "selective" is the attention module's business
        self.hidden, self.sequence_parallel = hidden, sequence_parallel
        kw = {"sequence_parallel": sequence_parallel, "dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(hidden, norm_eps, **kw)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden, norm_eps, **kw)
        self.mlp = ffn

    def _body(self, x: Tensor, position_ids: Tensor, **ffn_kwargs: Any) -> tuple[Tensor, Any]:
        x = x + self.self_attn(self.input_layernorm(x), position_ids)
        out = self.mlp(self.post_attention_layernorm(x), **ffn_kwargs)
        out, extra = out if isinstance(out, tuple) else (out, None)
        return x + out, extra

    def forward(self, x: Tensor, position_ids: Tensor, **ffn_kwargs: Any) -> tuple[Tensor, Any]:
        """``ffn_kwargs`` go to the FFN (e.g. the MoE layer's ``global_state``)."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"TransformerBlock(hidden={self.hidden}) got x of shape {tuple(x.shape)}")
        return checkpointed(self._body, x, position_ids, enabled=self._checkpoint_block, **ffn_kwargs)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, sp={self.sequence_parallel}, recompute={self.recompute}"
