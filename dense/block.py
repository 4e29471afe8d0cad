"""The transformer block: pre-norm attention + residual, pre-norm FFN + residual.

The attention and the FFN are modules handed in, so the same block carries GQA, MLA or Gated DeltaNet
(every token mixer sits in the ``self_attn`` slot) and a dense MLP or the MoE layer. Parameter names
follow HF (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``). Under sequence
parallelism the block's input and output are this rank's sequence shard ``[S/tp, B, H]``; the norms are
replicated with partial gradients (marked ``mark_sequence_parallel``), and the attention/FFN modules gather
and reduce-scatter the sequence themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from moefold.dense.activation_offload import NO_OFFLOAD
from moefold.dense.norm import RMSNorm
from moefold.dense.recompute import CheckpointWithoutOutput, check_recompute, checkpointed


class TransformerBlock(nn.Module):
    """forward(x [S, B, H] (or [S/tp, B, H] with SP), position_ids [S] int64) -> (x, extra).

    ``attention(x, position_ids) -> x``. ``ffn(x)`` returns a Tensor or ``(Tensor, extra)`` (the
    MoE layer's losses/statistics); ``extra`` is returned as is, None for a plain FFN.

    ``recompute``: "full" checkpoints the whole block (non-reentrant ``torch.utils.checkpoint``;
    ``checkpoint_block``, which a decoder that groups layers itself turns off); "selective" is
    configured per module (``dense.recompute``): this block's own parts are ``recompute_layernorm``
    (both norms, output discarded) and ``recompute_ffn`` (the FFN checkpointed: Megatron's ``mlp``
    or ``moe``). The FFN must be free of forward side effects when recomputed (it runs twice).

    ``offload_attn_norm`` / ``offload_mlp_norm``: the regions the two norms run in (``dense.activation_offload``;
    ``NO_OFFLOAD`` unless the model offloads them).
    """

    def __init__(self, hidden: int, attention: nn.Module, ffn: nn.Module, norm_eps: float = 1e-6, *,
                 sequence_parallel: bool = False, recompute: str = "none", zero_centered_gamma: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.recompute = check_recompute(recompute, "TransformerBlock recompute")
        self.checkpoint_block = recompute == "full"
        self.recompute_layernorm = False
        self.recompute_ffn = False
        self.offload_attn_norm = self.offload_mlp_norm = NO_OFFLOAD
        self.hidden, self.sequence_parallel = hidden, sequence_parallel
        kw = {"sequence_parallel": sequence_parallel, "zero_centered_gamma": zero_centered_gamma, "dtype": dtype,
              "device": device}
        self.input_layernorm = RMSNorm(hidden, norm_eps, **kw)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden, norm_eps, **kw)
        self.mlp = ffn

    def _after_norm(self, norm: RMSNorm, x: Tensor, consumer: Callable[[Tensor], Any], offload: Any) -> Any:
        """``consumer(norm(x))``; with ``recompute_layernorm`` the norm's output is freed once the consumer
        has saved it and recomputed before the consumer's backward; else the norm runs in ``offload``."""
        if not self.recompute_layernorm:
            with offload:
                h = norm(x)
            return consumer(h)
        ckpt = CheckpointWithoutOutput()
        out = consumer(ckpt.checkpoint(norm, x))
        ckpt.discard_output_and_register_recompute(out[0] if isinstance(out, tuple) else out)
        return out

    def _ffn(self, h: Tensor, **ffn_kwargs: Any) -> Any:
        return checkpointed(self.mlp, h, enabled=self.recompute_ffn, **ffn_kwargs)

    # -- the block's public pieces: forward runs them; the batch-level overlap's pieces (models.sublayers) too ----
    def attention_residual(self, x: Tensor, position_ids: Tensor) -> Tensor:
        """``x + attention(norm(x))``: the residual stream after the attention."""
        # The residual stream stays in the activations' dtype (bf16 under --bf16): each add is exact in fp32
        # and rounded once, as Megatron-Core's default (fp32_residual_connection=False, bias-dropout-add in the
        # activations' dtype) and HF do; the norms read it in fp32 (dense.norm.rms_norm).
        return x + self._after_norm(self.input_layernorm, x, lambda h: self.self_attn(h, position_ids),
                                    self.offload_attn_norm)

    def ffn_input(self, h: Tensor) -> tuple[Tensor, CheckpointWithoutOutput | None]:
        """The FFN's input ``norm(h)``. With ``recompute_layernorm`` also the checkpoint whose output the caller
        discards once the FFN has saved it (``discard_output_and_register_recompute``); else None, the norm having
        run in ``offload_mlp_norm``."""
        if not self.recompute_layernorm:
            with self.offload_mlp_norm:
                return self.post_attention_layernorm(h), None
        norm = CheckpointWithoutOutput()
        return norm.checkpoint(self.post_attention_layernorm, h), norm

    def _body(self, x: Tensor, position_ids: Tensor, **ffn_kwargs: Any) -> tuple[Tensor, Any]:
        x = self.attention_residual(x, position_ids)
        normed, norm = self.ffn_input(x)
        out = self._ffn(normed, **ffn_kwargs)
        if norm is not None:
            norm.discard_output_and_register_recompute(out[0] if isinstance(out, tuple) else out)
        out, extra = out if isinstance(out, tuple) else (out, None)
        return x + out, extra

    def forward(self, x: Tensor, position_ids: Tensor, **ffn_kwargs: Any) -> tuple[Tensor, Any]:
        """``ffn_kwargs`` go to the FFN (e.g. the MoE layer's ``global_state``)."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"TransformerBlock(hidden={self.hidden}) got x of shape {tuple(x.shape)}")
        return checkpointed(self._body, x, position_ids, enabled=self.checkpoint_block, **ffn_kwargs)

    def extra_repr(self) -> str:
        parts = [f"hidden={self.hidden}", f"sp={self.sequence_parallel}", f"recompute={self.recompute}"]
        parts += [name for name, on in (("layernorm", self.recompute_layernorm), ("ffn", self.recompute_ffn)) if on]
        return ", ".join(parts)
