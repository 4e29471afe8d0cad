"""Core attention: softmax(q k^T * scale + causal/window mask) v, for GQA and MLA alike.

Without context parallelism this is one ``torch.nn.functional.scaled_dot_product_attention``
call (``is_causal`` when there is no sliding window, so fused kernels can be picked; an
explicit position mask otherwise). With CP it delegates to ``dense.context_parallel`` in the
configured exchange mode: fused kernels per block (default) or, with ``fused=False``, the math
reference the tests compare them with. Selective recomputation checkpoints exactly this module
(``torch.utils.checkpoint``, non-reentrant): the S x S scores are recomputed in backward
instead of being stored.

Attention sinks (GPT-OSS: a learned logit per head in every softmax row, ``sinks [h]`` passed to
``forward``) need the log-sum-exp of each row, which SDPA does not return: without CP the sink
layers run one fused kernel call with its log-sum-exp (``cp_fused.fused_local_attention``, the
kernels of ``dense.attention_kernels`` on every device), with CP the fused (or math) CP attention
merges them after the last block. Every attention path of moefold takes them.

Packed documents (``documents``, ``dense.documents``, with ``isolate``): attention stays inside each document,
planned as block calls of the same fused kernels (``dense.document_attention``), with or without CP; no mask of
the sequence is built.
"""

from __future__ import annotations

from torch import Tensor, nn

from moefold.dense.choices import CPComm
from moefold.dense.context_parallel import CP_COMM_MODES, cp_attention_impl, position_mask, sdpa
from moefold.dense.cp_fused import fused_local_attention
from moefold.dense.document_attention import document_attention
from moefold.dense.documents import Documents
from moefold.dense.recompute import checkpointed
from moefold.parallel.groups import Group, group_size


def local_attention(q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, *, scale: float,
                    sliding_window: int | None = None, sinks: Tensor | None = None) -> Tensor:
    """Causal attention over this rank's (whole) sequence. q ``[B, h, S, d]``, k ``[B, g, S, d]``,
    v ``[B, g, S, dv]`` with ``h % g == 0``; returns ``[B, h, S, dv]``. ``sinks [h]``: attention sinks
    (the sequence is the contiguous positions 0..S-1 then, as everywhere without CP). Nothing crosses ranks.

    An fp32 island of the bf16 path: the scores and their softmax are fp32 in every kernel SDPA takes for
    bf16 here: FlashAttention-2 and the memory-efficient kernel on CUDA and the CPU flash kernel accumulate
    q k^T and keep the softmax statistics in fp32 (the probabilities are rounded to bf16 only as the
    operand of the product with v); the math kernel (MLA's unequal head dims on the CPU) upcasts q, k and v
    to fp32 (torch's ``allow_fp16_bf16_reduction_math_sdp`` is off by default). With sinks, and under context
    parallelism, moefold's block kernels return an fp32 log-sum-exp and merge blocks in fp32
    (``dense.attention_kernels``). Megatron-Core keeps the softmax in fp32 likewise
    (``attention_softmax_in_fp32=True``; TE's fused attention).
    """
    if sinks is not None:
        return fused_local_attention(q, k, v, scale=scale, sliding_window=sliding_window, sinks=sinks)
    mask = None if sliding_window is None else position_mask(position_ids, position_ids, sliding_window)
    return sdpa(q, k, v, scale=scale, attn_mask=mask)


class CoreAttention(nn.Module):
    """The attention product for one layer's local heads; no parameters.

    forward(q ``[S, B, h, d]``, k ``[S, B, g, d]``, v ``[S, B, g, dv]``, position_ids ``[S]``, sinks ``[h]``
    or None, documents or None) -> ``[S, B, h*dv]``. ``S`` is this rank's sequence (the CP part under context
    parallelism, ``position_ids`` its true global positions). ``h`` must be a multiple of ``g`` (GQA).
    Crosses ranks only under CP (see ``dense.context_parallel``).
    """

    def __init__(self, scale: float, *, sliding_window: int | None = None, cp_group: Group = None,
                 cp_comm: CPComm = CPComm.P2P, recompute: bool = False, fused: bool = True) -> None:
        super().__init__()
        if cp_comm not in CP_COMM_MODES:
            raise ValueError(f"cp_comm={cp_comm!r} is not one of {CP_COMM_MODES}")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window={sliding_window!r} must be a positive integer or None")
        self.scale, self.sliding_window = float(scale), sliding_window
        self.cp_group, self.cp_comm, self.recompute, self.fused = cp_group, CPComm(cp_comm), recompute, fused
        # the exchange and its implementation are chosen once here, not by comparing strings in every forward
        self._cp_attention = cp_attention_impl(cp_comm, fused=fused) if group_size(cp_group) > 1 else None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, sinks: Tensor | None = None,
                documents: Documents | None = None) -> Tensor:
        S, B, h = q.shape[:3]
        if k.shape[0] != S or v.shape[0] != S or position_ids.shape != (S,):
            raise ValueError(f"CoreAttention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} and "
                             f"position_ids {tuple(position_ids.shape)} must share the sequence length {S}")
        if h % k.shape[2] != 0:
            raise ValueError(f"CoreAttention: {h} query heads are not a multiple of {k.shape[2]} kv heads")
        if sinks is not None and sinks.shape != (h,):
            raise ValueError(f"CoreAttention: sinks {tuple(sinks.shape)} must be one logit per query head ({h},)")
        # [S, B, heads, d] -> [B, heads, S, d] (SDPA layout)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = checkpointed(self._attend, q, k, v, position_ids, sinks, documents, enabled=self.recompute)
        return out.permute(2, 0, 1, 3).reshape(S, B, -1)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, sinks: Tensor | None,
                documents: Documents | None = None) -> Tensor:
        if documents is not None and documents.isolate:
            return document_attention(q, k, v, documents, self.cp_group, cp_comm=self.cp_comm, scale=self.scale,
                                      sliding_window=self.sliding_window, sinks=sinks)
        if self._cp_attention is None:
            if not self.fused and sinks is not None:   # the math reference of the sink path
                mask = position_mask(position_ids, position_ids, self.sliding_window)
                return sdpa(q, k, v, scale=self.scale, attn_mask=mask, sinks=sinks)
            return local_attention(q, k, v, position_ids, scale=self.scale, sliding_window=self.sliding_window,
                                   sinks=sinks)
        return self._cp_attention(q, k, v, position_ids, self.cp_group, scale=self.scale,
                                  sliding_window=self.sliding_window, sinks=sinks)

    def extra_repr(self) -> str:
        return (f"scale={self.scale:.4g}, sliding_window={self.sliding_window}, cp={group_size(self.cp_group)}, "
                f"cp_comm={self.cp_comm}, fused={self.fused}, recompute={self.recompute}")
