"""Fused attention kernels for one block of queries and keys, each returning the log-sum-exp.

Context-parallel attention (``dense.cp_fused``) computes attention block by block and merges the
blocks by their log-sum-exp. A kernel here does one block: ``forward`` returns the block's output
and log-sum-exp (natural log, fp32 ``[B, h, Sq]``); ``backward`` takes the *merged* output and
log-sum-exp of the whole row (flash-attention's recomputation), so the dq, dk, dv it returns are
exactly the block's share of the full gradient. Nothing crosses ranks.

Shapes: q ``[B, h, Sq, D]``, k ``[B, g, Sk, D]``, v ``[B, g, Sk, Dv]`` with ``h % g == 0`` (GQA),
head dims already padded as ``padded_head_dims`` says (the caller pads once, see ``pad_head_dims``).

A ``Window`` says which keys of a block a query sees, in flash-attention's convention: on a
square block, key j is visible to query i iff ``i - left <= j <= i + right`` (None: unbounded).
Full block ``Window()``, causal ``Window(None, 0)``. Every query row of a call sees at least one
key (the caller trims blocks so), because the kernels' log-sum-exp of an empty row is not -inf.

Kernels, chosen once per (device type, dtype, head dim) by ``attention_kernel``:

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``. GQA natively;
  q, k and v must share one head dim (v is zero-padded for MLA shapes); causal via ``is_causal``,
  any other window via an additive mask of the block (the only masks: blocks that cross a
  sliding-window boundary).
- CUDA fp16/bf16: ``aten._flash_attention_forward`` / ``_flash_attention_backward``, the
  FlashAttention-2 kernels bundled with PyTorch: GQA natively, windows natively
  (``window_size_left/right``, no mask at all); one head dim, a multiple of 8, at most 256.
- CUDA fp32 (or head dims over 256): ``aten._scaled_dot_product_efficient_attention`` and its
  ``_backward`` (memory-efficient kernel): v may be narrower than q/k; kv heads are expanded per
  call (the kernel takes no GQA); windows other than causal are an additive bias.
- any other device: ``MathKernel``, plain torch with fp32 statistics (one block of scores).

Transformer Engine / the flash-attn package are not used: PyTorch ships the same FlashAttention-2
kernels with window arguments, so nothing extra needs installing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

aten = torch.ops.aten


@dataclass(frozen=True)
class Window:
    """Visible keys of a (square) block: ``i - left <= j <= i + right``; None is unbounded."""

    left: int | None = None
    right: int | None = None

    @property
    def is_full(self) -> bool:
        return self.left is None and self.right is None

    @property
    def is_causal(self) -> bool:
        return self.left is None and self.right == 0

    def allowed(self, sq: int, sk: int, device: torch.device) -> Tensor:
        """Boolean ``[sq, sk]``, True where query i sees key j."""
        i = torch.arange(sq, device=device)[:, None]
        j = torch.arange(sk, device=device)[None, :]
        ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if self.left is not None:
            ok &= j >= i - self.left
        if self.right is not None:
            ok &= j <= i + self.right
        return ok

    def additive_mask(self, sq: int, sk: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``[sq, sk]`` of 0 (visible) and -inf (hidden) in ``dtype``."""
        mask = torch.zeros(sq, sk, dtype=dtype, device=device)
        return mask.masked_fill_(~self.allowed(sq, sk, device), float("-inf"))


FULL = Window()
CAUSAL = Window(None, 0)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def expand_heads(t: Tensor, rep: int) -> Tensor:
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def fold_heads(t: Tensor, rep: int) -> Tensor:
    """Sum a gradient over the query heads that share one kv head: [B, g*rep, ..] -> [B, g, ..]."""
    return t if rep == 1 else t.unflatten(1, (-1, rep)).sum(2)


class AttentionKernel:
    """One block of attention with its log-sum-exp, forward and backward (see the module docstring)."""

    name = "abstract"
    head_dim_multiple = 1
    equal_head_dims = True  # q, k and v must share one head dim

    def padded_head_dims(self, d_qk: int, d_v: int) -> tuple[int, int]:
        """The (qk, v) head dims this kernel computes with, for inputs of ``d_qk`` and ``d_v``."""
        if self.equal_head_dims:
            d = _round_up(max(d_qk, d_v), self.head_dim_multiple)
            return d, d
        return _round_up(d_qk, self.head_dim_multiple), _round_up(d_v, self.head_dim_multiple)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, window: Window, scale: float) -> tuple[Tensor, Tensor]:
        """-> (out ``[B, h, Sq, Dv]`` in q's dtype, lse fp32 ``[B, h, Sq]``)."""
        raise NotImplementedError

    def backward(self, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 window: Window, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """``out``/``lse``: the merged output and log-sum-exp of these query rows. -> (dq, dk, dv) with
        k's and v's (kv-head) shapes."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CpuFlashKernel(AttentionKernel):
    name = "cpu_flash"

    @staticmethod
    def _mask(window: Window, q: Tensor, k: Tensor) -> Tensor | None:
        if window.is_full or window.is_causal:
            return None
        return window.additive_mask(q.shape[2], k.shape[2], q.dtype, q.device)

    def forward(self, q, k, v, window, scale):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, window.is_causal, attn_mask=self._mask(window, q, k), scale=scale)
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, window, scale):
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, window.is_causal, attn_mask=self._mask(window, q, k), scale=scale)
        return dq, dk, dv


class CudaFlashKernel(AttentionKernel):
    """FlashAttention-2 as bundled with PyTorch; its layout is ``[B, S, heads, D]`` (transposed views)."""

    name = "cuda_flash"
    head_dim_multiple = 8
    max_head_dim = 256

    def forward(self, q, k, v, window, scale):
        out, lse, _rng_state, _unused, _debug = aten._flash_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, q.shape[2], k.shape[2],
            0.0, window.is_causal, False, scale=scale, window_size_left=window.left,
            window_size_right=window.right)
        return out.transpose(1, 2), lse

    def backward(self, grad_out, q, k, v, out, lse, window, scale):
        # dropout 0: the rng state is never read (mha_bwd reads it only under dropout)
        dq, dk, dv = aten._flash_attention_backward(
            grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
            lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, window.is_causal, None, None, scale=scale,
            window_size_left=window.left, window_size_right=window.right)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class CudaEfficientKernel(AttentionKernel):
    """PyTorch's memory-efficient kernel: fp32 too, v head dim free; no GQA (kv heads expanded per call).
    Its log-sum-exp comes padded to a multiple of 32 rows and its backward wants it so."""

    name = "cuda_efficient"
    head_dim_multiple = 8
    equal_head_dims = False
    lse_rows_multiple = 32

    @staticmethod
    def _bias(window: Window, q: Tensor, k: Tensor) -> Tensor | None:
        if window.is_full or window.is_causal:
            return None
        sq, sk = q.shape[2], k.shape[2]
        # as SDPA's preprocess_mask: rows 8-aligned in memory, expanded (a view) to [B, h, Sq, Sk]
        bias = window.additive_mask(sq, _round_up(sk, 8), q.dtype, q.device)[:, :sk]
        return bias.expand(q.shape[0], q.shape[1], sq, sk)

    def forward(self, q, k, v, window, scale):
        rep = q.shape[1] // k.shape[1]
        out, lse, _seed, _offset = aten._scaled_dot_product_efficient_attention(
            q, expand_heads(k, rep), expand_heads(v, rep), self._bias(window, q, k), True, 0.0, window.is_causal,
            scale=scale)
        return out, lse[:, :, :q.shape[2]]

    def backward(self, grad_out, q, k, v, out, lse, window, scale):
        rep = q.shape[1] // k.shape[1]
        sq = q.shape[2]
        lse_padded = lse.new_zeros(*lse.shape[:2], _round_up(sq, self.lse_rows_multiple))
        lse_padded[:, :, :sq] = lse
        dq, dk, dv, _dbias = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, expand_heads(k, rep), expand_heads(v, rep), self._bias(window, q, k), out, lse_padded,
            None, None, 0.0, [True, True, True, False], window.is_causal, scale=scale)
        return dq, fold_heads(dk, rep), fold_heads(dv, rep)


class MathKernel(AttentionKernel):
    """Plain torch, fp32 statistics: one ``[B, h, Sq, Sk]`` block of scores (devices without a fused kernel)."""

    name = "math"
    equal_head_dims = False

    @staticmethod
    def _scores(q: Tensor, k: Tensor, window: Window, scale: float) -> Tensor:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        if window.is_full:
            return scores
        return scores.masked_fill(~window.allowed(q.shape[2], k.shape[2], q.device), float("-inf"))

    def forward(self, q, k, v, window, scale):
        rep = q.shape[1] // k.shape[1]
        scores = self._scores(q, expand_heads(k, rep), window, scale)
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), expand_heads(v, rep).float())
        return out.to(q.dtype), lse

    def backward(self, grad_out, q, k, v, out, lse, window, scale):
        rep = q.shape[1] // k.shape[1]
        k_e, v_e, grad_out = expand_heads(k, rep).float(), expand_heads(v, rep).float(), grad_out.float()
        probs = torch.exp(self._scores(q, k_e, window, scale) - lse.unsqueeze(-1))
        delta = (grad_out * out.float()).sum(-1, keepdim=True)
        dscores = probs * (torch.matmul(grad_out, v_e.transpose(-1, -2)) - delta) * scale
        dq = torch.matmul(dscores, k_e)
        dk = fold_heads(torch.matmul(dscores.transpose(-1, -2), q.float()), rep)
        dv = fold_heads(torch.matmul(probs.transpose(-1, -2), grad_out), rep)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@functools.cache
def attention_kernel(device_type: str, dtype: torch.dtype, head_dim: int) -> AttentionKernel:
    """The fused kernel for tensors of ``dtype`` on ``device_type`` with (the larger) head dim ``head_dim``."""
    if device_type == "cpu":
        return CpuFlashKernel()
    if device_type == "cuda":
        flash = CudaFlashKernel()
        if dtype in (torch.float16, torch.bfloat16) and _round_up(head_dim, 8) <= flash.max_head_dim:
            return flash
        return CudaEfficientKernel()
    return MathKernel()


def pad_head_dims(q: Tensor, k: Tensor, v: Tensor, kernel: AttentionKernel) -> tuple[Tensor, Tensor, Tensor]:
    """Zero-pad the head dims to what ``kernel`` computes with (autograd slices the gradients back).
    Zero columns of q and k leave the scores unchanged; zero columns of v give zero output columns."""
    d_qk, d_v = kernel.padded_head_dims(q.shape[-1], v.shape[-1])

    def pad(t: Tensor, d: int) -> Tensor:
        return t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1]))

    return pad(q, d_qk), pad(k, d_qk), pad(v, d_v)


def merge_block(out: Tensor, lse: Tensor, rows: slice, block_out: Tensor, block_lse: Tensor,
                batch: slice = slice(None)) -> None:
    """Merge a block's (output, lse) into the fp32 accumulators ``out[batch, :, rows]``, ``lse[batch, :, rows]``
    in place. Rows not yet touched hold lse -inf and output 0, so the first block is simply copied."""
    acc_out, acc_lse = out[batch, :, rows], lse[batch, :, rows]
    new_lse = torch.logaddexp(acc_lse, block_lse)
    acc_out.mul_(torch.exp(acc_lse - new_lse).unsqueeze(-1))
    acc_out.add_(block_out.float() * torch.exp(block_lse - new_lse).unsqueeze(-1))
    acc_lse.copy_(new_lse)


def merge_sinks(out: Tensor, lse: Tensor, sinks_h: Tensor) -> None:
    """Merge attention sinks into the fp32 accumulators in place: each head's learned logit ``sinks_h [h]``
    joins every row's softmax as one more key whose value is zero (GPT-OSS). That is a block of output 0 and
    log-sum-exp ``sink``: the rows are rescaled by ``exp(lse - lse')`` with ``lse' = logaddexp(lse, sink)``.
    Kernel backwards given the merged ``out`` and ``lse'`` then return exactly the q/k/v gradients of the
    softmax with sinks (their probabilities ``exp(s - lse')`` are the sink-softmax's)."""
    sink = sinks_h.float()[None, :, None].expand_as(lse)
    new_lse = torch.logaddexp(lse, sink)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def sinks_grad(grad_out: Tensor, out: Tensor, lse: Tensor, sinks_h: Tensor) -> Tensor:
    """Gradient ``[h]`` (fp32) of the sink logits from the merged ``out [B, h, Sq, Dv]`` and ``lse [B, h, Sq]``
    (sinks included): the softmax backward of a column whose value row is zero, ``p_sink * (0 - rowsum(dO * O))``
    with ``p_sink = exp(sink - lse)``, summed over batch and rows."""
    delta = (grad_out.float() * out.float()).sum(-1)
    p_sink = torch.exp(sinks_h.float()[None, :, None] - lse)
    return -(p_sink * delta).sum(dim=(0, 2))
