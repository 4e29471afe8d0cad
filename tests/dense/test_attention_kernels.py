"""Per-block attention kernels: values, log-sum-exp and gradients against autograd math (CPU), blocks merged
by log-sum-exp with the merged statistics in backward, and the CUDA kernels' call protocol on meta tensors."""

from __future__ import annotations

import pytest
import torch

from moefold.dense.attention_kernels import (
    CAUSAL,
    FULL,
    CpuFlashKernel,
    CudaEfficientKernel,
    CudaFlashKernel,
    MathKernel,
    Window,
    attention_kernel,
    merge_block,
    pad_head_dims,
)

# (q heads, kv heads, Sq, Sk, qk head dim, v head dim, window): GQA, MLA-like head dims both ways,
# full / causal / banded / trimmed-band windows
CASES = [
    (4, 2, 6, 9, 8, 8, FULL),
    (4, 4, 7, 7, 6, 6, CAUSAL),
    (4, 2, 7, 7, 6, 4, Window(2, 0)),  # diagonal block under a window shorter than the block
    (2, 1, 5, 5, 4, 7, Window(1, None)),  # a block crossing the window boundary
    (4, 1, 5, 5, 6, 3, Window(0, None)),
]


def _reference(q, k, v, window, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~window.allowed(q.shape[2], k.shape[2], q.device), float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def _inputs(h, g, sq, sk, d, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, h, sq, d, generator=gen), torch.randn(2, g, sk, d, generator=gen),
            torch.randn(2, g, sk, dv, generator=gen), torch.randn(2, h, sq, dv, generator=gen))


@pytest.mark.parametrize("kernel", [CpuFlashKernel(), MathKernel()], ids=lambda k: k.name)
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_kernel_block_equals_autograd_math(kernel, case):
    h, g, sq, sk, d, dv, window = case
    q, k, v, grad_out = _inputs(h, g, sq, sk, d, dv)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = _reference(*leaves, window, 0.4)
    want_grads = torch.autograd.grad(want_out, leaves, grad_out)

    qp, kp, vp = pad_head_dims(q, k, v, kernel)
    out, lse = kernel.forward(qp, kp, vp, window, 0.4)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    torch.testing.assert_close(out[..., :dv], want_out.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, want_lse.detach(), atol=1e-5, rtol=0)
    grad_out_p = torch.nn.functional.pad(grad_out, (0, vp.shape[-1] - dv))
    grads = kernel.backward(grad_out_p, qp, kp, vp, out, lse, window, 0.4)
    for name, got, want, t in zip("qkv", grads, want_grads, (qp, kp, vp)):
        assert got.shape == t.shape, name
        torch.testing.assert_close(got[..., :want.shape[-1]], want, atol=1e-5, rtol=0, msg=f"d{name}")


@pytest.mark.parametrize("kernel", [CpuFlashKernel(), MathKernel()], ids=lambda k: k.name)
def test_blocks_merged_by_lse_equal_one_call(kernel):
    """Keys split into two calls, merged by log-sum-exp; each call's backward with the merged output and lse
    returns its share, and the shares add up to the gradient of the whole."""
    q, k, v, grad_out = _inputs(4, 2, 6, 10, 8, 8, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = _reference(*leaves, FULL, 0.3)
    want_grads = torch.autograd.grad(want_out, leaves, grad_out)
    out = torch.zeros(2, 4, 6, 8)
    lse = torch.full((2, 4, 6), float("-inf"))
    rows, parts = slice(0, 6), (slice(0, 3), slice(3, 10))
    for cols in parts:
        merge_block(out, lse, rows, *kernel.forward(q, k[:, :, cols], v[:, :, cols], FULL, 0.3))
    torch.testing.assert_close(out, want_out.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, want_lse.detach(), atol=1e-5, rtol=0)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for cols in parts:
        gq, gk, gv = kernel.backward(grad_out, q, k[:, :, cols], v[:, :, cols], out, lse, FULL, 0.3)
        dq += gq
        dk[:, :, cols] += gk
        dv[:, :, cols] += gv
    for name, got, want in zip("qkv", (dq, dk, dv), want_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"d{name}")


def test_kernel_choice():
    assert isinstance(attention_kernel("cpu", torch.float32, 64), CpuFlashKernel)
    assert isinstance(attention_kernel("cuda", torch.bfloat16, 192), CudaFlashKernel)
    assert isinstance(attention_kernel("cuda", torch.float32, 64), CudaEfficientKernel)
    assert isinstance(attention_kernel("cuda", torch.bfloat16, 288), CudaEfficientKernel)  # over flash's 256
    assert isinstance(attention_kernel("mps", torch.float32, 64), MathKernel)
    assert attention_kernel("cpu", torch.float32, 64) is attention_kernel("cpu", torch.float32, 64)  # chosen once
    # head dims each kernel computes with: one shared dim (v zero-padded for MLA), 8-aligned on CUDA
    assert CpuFlashKernel().padded_head_dims(192, 128) == (192, 192)
    assert CudaFlashKernel().padded_head_dims(12, 6) == (16, 16)
    assert CudaEfficientKernel().padded_head_dims(12, 6) == (16, 8)


@pytest.mark.parametrize("kernel", [CudaFlashKernel(), CudaEfficientKernel()], ids=lambda k: k.name)
@pytest.mark.parametrize("window", [FULL, CAUSAL, Window(3, 0), Window(2, None)], ids=str)
def test_cuda_kernel_call_protocol_on_meta(kernel, window):
    """Protocol only, not numerics (no GPU here): the CUDA kernels call the real aten ops with arguments
    their schemas accept, on meta tensors, and return what the CP code expects: output ``[B, h, Sq, Dv]`` in
    q's dtype, fp32 lse ``[B, h, Sq]``, gradients shaped like q, k (kv heads) and v. tests/gpu checks values."""
    dtype = torch.bfloat16 if isinstance(kernel, CudaFlashKernel) else torch.float32
    d, dv = kernel.padded_head_dims(12, 6)
    q = torch.empty(2, 4, 40, d, device="meta", dtype=dtype)
    k = torch.empty(2, 2, 40, d, device="meta", dtype=dtype)
    v = torch.empty(2, 2, 40, dv, device="meta", dtype=dtype)
    out, lse = kernel.forward(q, k, v, window, 0.3)
    assert out.shape == (2, 4, 40, dv) and out.dtype == dtype
    assert lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    dq, dk, dv_ = kernel.backward(torch.empty_like(out), q, k, v, out, lse, window, 0.3)
    assert (dq.shape, dk.shape, dv_.shape) == (q.shape, k.shape, v.shape)


def _sink_reference(q, k, v, sinks, window, scale):
    """Softmax with one extra logit per head whose value row is zero, from transformers' GPT-OSS eager attention
    (the reference moefold's sink math is checked against)."""
    from types import SimpleNamespace

    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    S = q.shape[2]
    mask = torch.zeros(S, S).masked_fill(~window.allowed(S, S, q.device), float("-inf"))
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    out, _ = gpt_oss.eager_attention_forward(module, q, k, v, mask, scaling=scale)
    return out.transpose(1, 2)   # HF returns [B, S, h, d]


@pytest.mark.parametrize("kernel", [CpuFlashKernel(), MathKernel()], ids=lambda k: k.name)
@pytest.mark.parametrize("window", [CAUSAL, Window(2, 0)], ids=str)
def test_sinks_merged_after_the_blocks_equal_transformers(kernel, window):
    """Attention sinks as one more merged 'block' (output 0, lse = sink): values and the q/k/v/sinks gradients
    equal transformers' eager GPT-OSS attention through autograd; the math reference (``sdpa(..., sinks=)``) too."""
    from moefold.dense.context_parallel import position_mask, sdpa
    from moefold.dense.cp_fused import BlockCall, _FusedBlocks

    q, k, v, grad_out = _inputs(4, 2, 7, 7, 8, 8, seed=2)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    want = _sink_reference(*leaves, window, 0.4)
    want_grads = torch.autograd.grad(want, leaves, grad_out)
    calls = (BlockCall(0, 7, 0, 7, window),)
    for impl in ("fused", "math"):
        got_leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        if impl == "fused":
            got = _FusedBlocks.apply(*got_leaves[:3], calls, 0.4, kernel, got_leaves[3])
        else:
            pos = torch.arange(7)
            w = None if window.is_causal else window.left + 1
            got = sdpa(*got_leaves[:3], scale=0.4, attn_mask=position_mask(pos, pos, w), sinks=got_leaves[3])
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=0)
        grads = torch.autograd.grad(got, got_leaves, grad_out)
        for name, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{impl} {n}: {m}")
