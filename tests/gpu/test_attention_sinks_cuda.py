"""Attention sinks (GPT-OSS) through the CUDA kernels: FlashAttention-2 (bf16) and the memory-efficient kernel
(fp32), without CP (one fused call, ``cp_fused.fused_local_attention``) and in the all_gather CP blocks (each CP
rank's ``_FusedBlocks`` simulated in one process, as tests/gpu/test_cp_attention.py does), equal fp32
softmax-with-sinks math: output and the q/k/v/sinks gradients.

Skipped without CUDA (tests/gpu/conftest.py); in a rehearsal the same code runs on the CPU's kernel.
"""

from __future__ import annotations

import pytest
import torch

from moefold.dense.attention_kernels import CudaEfficientKernel, CudaFlashKernel, attention_kernel, pad_head_dims
from moefold.dense.context_parallel import position_mask, sdpa, split_for_context_parallel
from moefold.dense.cp_exchange import rank_order_to_global
from moefold.dense.cp_fused import _FusedBlocks, all_gather_calls, fused_local_attention
from tests.gpu.rehearsal import REHEARSAL

SCALE = 0.125


def _reference(q, k, v, sinks, window):
    pos = torch.arange(q.shape[2], device=q.device)
    return sdpa(q, k, v, scale=SCALE, attn_mask=position_mask(pos, pos, window), sinks=sinks)


def _all_gather_with_sinks(q, k, v, sinks, cp, window):
    kernel = attention_kernel(q.device.type, q.dtype, q.shape[-1])
    qp, kp, vp = pad_head_dims(q, k, v, kernel)
    c = q.shape[2] // (2 * cp)
    outs = [_FusedBlocks.apply(split_for_context_parallel(qp, r, cp, 2), kp, vp, all_gather_calls(r, cp, c, window),
                               SCALE, kernel, sinks)[..., :v.shape[-1]] for r in range(cp)]
    return rank_order_to_global(torch.cat(outs, dim=2), cp, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 48], ids=["causal", "window48"])
def test_cuda_attention_with_sinks_equals_math(dtype, window, device):
    if not REHEARSAL:
        expected = CudaFlashKernel if dtype == torch.bfloat16 else CudaEfficientKernel
        assert isinstance(attention_kernel("cuda", dtype, 64), expected)
    gen = torch.Generator(device=device).manual_seed(0)
    B, S, h, g, d = 2, 256, 8, 2, 64
    q, k, v = (torch.randn(B, n, S, d, device=device, generator=gen) for n in (h, g, g))
    grad_out = torch.randn(B, h, S, d, device=device, generator=gen)
    sinks = torch.randn(h, device=device, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = _reference(*leaves, window)
    want = [ref.detach(), *torch.autograd.grad(ref, leaves, grad_out)]
    atol = 2e-3 if dtype == torch.float32 else 6e-2
    runs = (("local", lambda *t: fused_local_attention(*t[:3], scale=SCALE, sliding_window=window, sinks=t[3])),
            ("all_gather cp2", lambda *t: _all_gather_with_sinks(*t, 2, window)))
    for name, run in runs:
        got_leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
        out = run(*got_leaves)
        got = [out.detach().float()] + [t.float() for t in torch.autograd.grad(out, got_leaves, grad_out.to(dtype))]
        for what, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
            tol = atol * (S if what == "dsinks" else 1)   # the sinks' gradient sums B x S rows
            torch.testing.assert_close(a, b, atol=tol, rtol=1e-2, msg=lambda m, w=what: f"{name} {w}: {m}")
