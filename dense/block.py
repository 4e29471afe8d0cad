"""The transformer block: pre-norm attention + residual, pre-norm FFN + residual.

The attention and the FFN are modules handed in, so the same block carries GQA, MLA or Gated DeltaNet
(every token mixer sits in the ``self_attn`` slot) and a dense MLP or the MoE layer. Parameter names
follow HF (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``). Under sequence
parallelism the block's input and output are this rank's sequence shard ``[S/tp, B, H]``; the norms are
replicated with partial gradients (marked ``mark_sequence_parallel``), and the attention/FFN modules gather
and reduce-scatter the sequence themselves.

A block may hold one half only (Nemotron-H: each layer is one pre-norm mixer, a Mamba-2 or attention layer or an
MoE or MLP layer): ``attention=None`` drops the first norm and residual, ``ffn=None`` the second.

With ``hyper`` (``dense.hyper_connections``, DeepSeek-V4's mHC) the residual is N streams ``[S, B, N, H]``: each
sub-layer reads their collapse and its output is mixed back by ``attn_hc`` / ``ffn_hc`` instead of added.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from moefold.dense.choices import Recompute
from moefold.dense.documents import Documents
from moefold.dense.hyper_connections import HyperConfig, HyperConnection
from moefold.dense.norm import RMSNorm
from moefold.dense.recompute import check_recompute
from moefold.dense.regions import (
    CHECKPOINT,
    KEEP_OUTPUT,
    OUTPUT_KIND,
    PLAIN,
    OpenedOutput,
    OutputRegion,
    Region,
    recomputes,
    replace_regions,
)


@dataclass(frozen=True)
class BlockRegions:
    """Where a block runs its parts (``dense.regions``): ``body`` the whole block (full recompute), ``attn_norm`` /
    ``mlp_norm`` the two norms (output regions: their consumers are the attention and the FFN), ``attn`` the
    attention module (a CUDA graph scope), ``ffn`` the FFN."""

    body: Region = PLAIN
    attn: Region = PLAIN
    attn_norm: OutputRegion = field(default=KEEP_OUTPUT, metadata=OUTPUT_KIND)
    mlp_norm: OutputRegion = field(default=KEEP_OUTPUT, metadata=OUTPUT_KIND)
    ffn: Region = PLAIN


class TransformerBlock(nn.Module):
    """forward(x [S, B, H] (or [S/tp, B, H] with SP), position_ids [S] int64, documents) -> (x, extra).

    ``attention(x, position_ids, documents) -> x`` (``documents``: the packed documents, ``dense.documents``, or
    None). ``ffn(x)`` returns a Tensor or ``(Tensor, extra)`` (the
    MoE layer's losses/statistics); ``extra`` is returned as is, None for a plain FFN.

    ``recompute``: "full" checkpoints the whole block (its ``body`` region is ``CHECKPOINT``; a decoder that
    groups layers itself reconfigures it); "selective" is configured per region by ``moefold.execution``
    (``regions``: ``attn_norm``/``mlp_norm`` with their outputs discarded, ``ffn`` checkpointed: Megatron's
    ``mlp`` or ``moe``; or the norms offloaded). The FFN must be free of forward side effects when recomputed (it
    runs twice).
    """

    def __init__(self, hidden: int, attention: nn.Module | None, ffn: nn.Module | None, norm_eps: float = 1e-6, *,
                 sequence_parallel: bool = False, recompute: str = "none", zero_centered_gamma: bool = False,
                 hyper: HyperConfig | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.recompute = check_recompute(recompute, "TransformerBlock recompute")
        self.regions = BlockRegions(body=CHECKPOINT if self.recompute is Recompute.FULL else PLAIN)
        self.hidden, self.sequence_parallel = hidden, sequence_parallel
        kw = {"sequence_parallel": sequence_parallel, "zero_centered_gamma": zero_centered_gamma, "dtype": dtype,
              "device": device}
        if attention is None and ffn is None:
            raise ValueError("TransformerBlock: needs an attention (token mixer), an FFN or both")
        if hyper is not None and (attention is None or ffn is None):
            raise ValueError("TransformerBlock: hyper-connections need both halves (attention and FFN)")
        self.input_layernorm = RMSNorm(hidden, norm_eps, **kw) if attention is not None else None
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden, norm_eps, **kw) if ffn is not None else None
        self.mlp = ffn
        self.hyper = hyper
        if hyper is not None:   # HF's names; the coefficients are fp32 whatever the model dtype
            hc = {"sinkhorn_iters": hyper.sinkhorn_iters, "hc_eps": hyper.eps, "norm_eps": norm_eps,
                  "init_std": hyper.init_std, "sequence_parallel": sequence_parallel, "device": device}
            self.attn_hc = HyperConnection(hidden, hyper.n_hc, **hc)
            self.ffn_hc = HyperConnection(hidden, hyper.n_hc, **hc)

    def configure(self, **regions: Region | OutputRegion) -> None:
        """Install regions by name (``BlockRegions``); ValueError for an unknown name or a wrong kind."""
        self.regions = replace_regions(self.regions, "TransformerBlock", **regions)

    def _after_norm(self, norm: RMSNorm, x: Tensor, consumer: Callable[[Tensor], Any], region: OutputRegion) -> Any:
        """``consumer(norm(x))`` with the norm run in ``region`` (which may free its output once the consumer has
        saved it and recompute it before the consumer's backward)."""
        opened = region.open()
        out = consumer(opened.run(norm, x))
        opened.consumed(out[0] if isinstance(out, tuple) else out)
        return out

    def _ffn(self, h: Tensor, **ffn_kwargs: Any) -> Any:
        return self.regions.ffn(self.mlp, h, **ffn_kwargs)

    # -- the block's public pieces: forward runs them; the batch-level overlap's pieces (models.sublayers) too ----
    def attention_residual(self, x: Tensor, position_ids: Tensor, documents: Documents | None = None) -> Tensor:
        """``x + attention(norm(x))``: the residual stream after the attention."""
        # The residual stream stays in the activations' dtype (bf16 under --bf16): each add is exact in fp32
        # and rounded once, as Megatron-Core's default (fp32_residual_connection=False, bias-dropout-add in the
        # activations' dtype) and HF do; the norms read it in fp32 (dense.norm.rms_norm).
        # documents go to the mixer only when there are some: a mixer without packed-document support keeps its
        # (x, position_ids) signature
        if self.self_attn is None:   # an FFN-only block (Nemotron-H's MoE / MLP layers)
            return x
        args = (position_ids,) if documents is None else (position_ids, documents)
        if self.hyper is None:
            return x + self._after_norm(self.input_layernorm, x, lambda h: self.regions.attn(self.self_attn, h, *args),
                                        self.regions.attn_norm)
        post, comb, collapsed = self.attn_hc(x)
        out = self._after_norm(self.input_layernorm, collapsed, lambda h: self.regions.attn(self.self_attn, h, *args),
                               self.regions.attn_norm)
        return HyperConnection.mix(post, comb, out, x)

    def ffn_input(self, h: Tensor) -> tuple[Tensor, OpenedOutput]:
        """The FFN's input ``norm(h)``, run in the ``mlp_norm`` region, and that region's opened call: the caller
        hands it the FFN's output (``opened.consumed(out)``), which lets a discarding region free ``norm(h)``."""
        opened = self.regions.mlp_norm.open()
        return opened.run(self.post_attention_layernorm, h), opened

    def _body(self, x: Tensor, position_ids: Tensor, documents: Documents | None = None,
              **ffn_kwargs: Any) -> tuple[Tensor, Any]:
        x = self.attention_residual(x, position_ids, documents)
        if self.mlp is None:   # a mixer-only block (Nemotron-H's Mamba-2 / attention layers)
            return x, None
        mixing = self.ffn_hc(x) if self.hyper is not None else None
        normed, opened = self.ffn_input(x if mixing is None else mixing[2])
        out = self._ffn(normed, **ffn_kwargs)
        opened.consumed(out[0] if isinstance(out, tuple) else out)
        out, extra = out if isinstance(out, tuple) else (out, None)
        if mixing is None:
            return x + out, extra
        return HyperConnection.mix(mixing[0], mixing[1], out, x), extra

    def forward(self, x: Tensor, position_ids: Tensor, documents: Documents | None = None,
                **ffn_kwargs: Any) -> tuple[Tensor, Any]:
        """``ffn_kwargs`` go to the FFN (e.g. the MoE layer's ``global_state``)."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"TransformerBlock(hidden={self.hidden}) got x of shape {tuple(x.shape)}")
        return self.regions.body(self._body, x, position_ids, documents, **ffn_kwargs)

    def extra_repr(self) -> str:
        parts = [f"hidden={self.hidden}", f"sp={self.sequence_parallel}", f"recompute={self.recompute}"]
        if self.hyper is not None:
            parts.append(f"n_hc={self.hyper.n_hc}")
        parts += [name for name, on in (("layernorm", recomputes(self.regions.mlp_norm)),
                                        ("ffn", recomputes(self.regions.ffn))) if on]
        return ", ".join(parts)
