"""Fused context-parallel attention on CUDA (FlashAttention-2 for bf16, the memory-efficient kernel for fp32)
equals plain fp32 math attention, values and gradients, for causal, sliding-window, GQA and MLA shapes.

Skipped without CUDA (tests/gpu/conftest.py). One GPU runs no multi-rank world (NCCL wants one GPU per
rank, gloo moves no CUDA tensors point to point), so the CP ranks are simulated in one process: each
rank runs the very block calls of the distributed path (``ring_step_calls`` / ``all_gather_calls``
through ``_attend`` / ``_attend_backward`` and ``_FusedBlocks``) on K/V blocks taken from the full
tensors instead of received ones. The transport itself is the one tested on CPU ranks. In a rehearsal
(tests/gpu/rehearsal.py) the same simulation runs on the CPU with the kernel the CPU gets
(``CpuFlashKernel``): the calls and the comparison, not the CUDA kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moefold.dense.attention_kernels import CudaEfficientKernel, CudaFlashKernel, attention_kernel, pad_head_dims
from moefold.dense.context_parallel import position_mask, split_for_context_parallel
from moefold.dense.cp_exchange import rank_order_to_global
from moefold.dense.cp_fused import (
    _accumulators,
    _attend,
    _attend_backward,
    _FusedBlocks,
    all_gather_calls,
    ring_step_calls,
)
from tests.gpu.rehearsal import REHEARSAL

SCALE = 0.125


def _math_attention(q, k, v, window):
    """fp32 softmax attention with the causal/window mask from positions (autograd for the reference grads)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    pos = torch.arange(q.shape[2], device=q.device)
    scores = (q @ k.transpose(-1, -2)) * SCALE
    scores = scores.masked_fill(~position_mask(pos, pos, window), float("-inf"))
    return torch.softmax(scores, -1) @ v


def _split(t, rank, cp):
    return split_for_context_parallel(t, rank, cp, seq_dim=2)


def _simulated_ring(q, k, v, grad_out, cp, window):
    """Every CP rank's p2p ring (forward and backward) in one process; returns out, dq, dk, dv in full order."""
    kernel = attention_kernel(q.device.type, q.dtype, max(q.shape[-1], v.shape[-1]))
    d_qk, d_v = q.shape[-1], v.shape[-1]
    qp, kp, vp = pad_head_dims(q, k, v, kernel)
    gp = F.pad(grad_out, (0, vp.shape[-1] - d_v))
    c = q.shape[2] // (2 * cp)
    outs, dqs = [], []
    dkv = {src: (torch.zeros_like(_split(kp, src, cp), dtype=torch.float32),
                 torch.zeros_like(_split(vp, src, cp), dtype=torch.float32)) for src in range(cp)}
    for rank in range(cp):
        q_r = _split(qp, rank, cp)
        out, lse = _accumulators(q_r, vp)
        for src in range(cp):
            _attend(q_r, _split(kp, src, cp), _split(vp, src, cp), ring_step_calls(rank, src, cp, c, window), kernel,
                    SCALE, out, lse)
        out = out.to(q.dtype)
        dq = torch.zeros_like(q_r, dtype=torch.float32)
        for src in range(cp):
            _attend_backward(_split(gp, rank, cp), q_r, _split(kp, src, cp), _split(vp, src, cp), out, lse,
                             ring_step_calls(rank, src, cp, c, window), kernel, SCALE, dq, *dkv[src])
        outs.append(out[..., :d_v])
        dqs.append(dq[..., :d_qk])

    def full(parts):
        return rank_order_to_global(torch.cat(parts, dim=2), cp, 2).float()

    return (full(outs), full(dqs), full([dkv[s][0][..., :d_qk] for s in range(cp)]),
            full([dkv[s][1][..., :d_v] for s in range(cp)]))


def _simulated_all_gather(q, k, v, grad_out, cp, window):
    """Every CP rank's all_gather attention (K/V in sequence order, ``_FusedBlocks``) in one process."""
    kernel = attention_kernel(q.device.type, q.dtype, max(q.shape[-1], v.shape[-1]))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    qp, kp, vp = pad_head_dims(*leaves, kernel)
    c = q.shape[2] // (2 * cp)
    outs = [_FusedBlocks.apply(_split(qp, r, cp), kp, vp, all_gather_calls(r, cp, c, window), SCALE, kernel)
            [..., :v.shape[-1]] for r in range(cp)]
    out = rank_order_to_global(torch.cat(outs, dim=2), cp, 2)
    (out * grad_out).sum().backward()
    return [out.detach().float()] + [t.grad.float() for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads,kv_heads,d_qk,d_v", [(8, 2, 64, 64), (4, 4, 40, 24)], ids=["gqa", "mla"])
@pytest.mark.parametrize("window", [None, 16, 48], ids=["causal", "window16", "window48"])
def test_cuda_fused_cp_attention_equals_math(dtype, cp, heads, kv_heads, d_qk, d_v, window, device):
    if not REHEARSAL:
        expected_kernel = CudaFlashKernel if dtype == torch.bfloat16 else CudaEfficientKernel
        assert isinstance(attention_kernel("cuda", dtype, max(d_qk, d_v)), expected_kernel)
    gen = torch.Generator(device=device).manual_seed(0)
    B, S = 2, 256  # chunks of 32 (cp 4) or 64 (cp 2): window 16 bands the diagonal, 48 crosses chunks
    q = torch.randn(B, heads, S, d_qk, device=device, generator=gen)
    k = torch.randn(B, kv_heads, S, d_qk, device=device, generator=gen)
    v = torch.randn(B, kv_heads, S, d_v, device=device, generator=gen)
    grad_out = torch.randn(B, heads, S, d_v, device=device, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _math_attention(*leaves, window)
    (ref * grad_out).sum().backward()
    want = [ref.detach()] + [t.grad for t in leaves]
    inputs = [t.to(dtype) for t in (q, k, v, grad_out)]
    atol = 2e-3 if dtype == torch.float32 else 6e-2
    for name, run in (("p2p", _simulated_ring), ("all_gather", _simulated_all_gather)):
        got = run(*inputs, cp, window)
        for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, atol=atol, rtol=1e-2, msg=lambda m: f"{name} {what}: {m}")
