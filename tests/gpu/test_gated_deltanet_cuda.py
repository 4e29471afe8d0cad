"""Gated DeltaNet on CUDA: the torch chunked form on bf16 inputs against the fp32 recurrence, fla's Triton kernel
(when flash-linear-attention is installed) against the torch form in values and gradients, and the tiny Qwen3-Next
model training a step with the "auto" backend.

Skipped without CUDA (tests/gpu/conftest.py). In a rehearsal the torch parts run on the CPU; fla is CUDA-only.
"""

import pytest
import torch

from moefold.dense.gated_delta_rule import (
    chunk_gated_delta_rule,
    fla_available,
    fla_gated_delta_rule,
    gated_delta_rule_impl,
    recurrent_gated_delta_rule,
)
from tests.gpu.rehearsal import cuda_only


def _inputs(device: str, dtype: torch.dtype, B=2, S=80, hk=2, hv=4, dk=32, dv=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, S, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(B, S, hv, dv, generator=g)
    decay = -torch.rand(B, S, hv, generator=g) * 0.3
    beta = torch.rand(B, S, hv, generator=g)
    h0 = torch.randn(B, hv, dk, dv, generator=g) * 0.1
    cast = [t.to(device, dtype) for t in (q, k, v)] + [decay.to(device), beta.to(device, dtype), h0.to(device)]
    return [t.requires_grad_() for t in cast]


def _run(fn, inputs):
    out, state = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    g = torch.Generator().manual_seed(1)
    loss = (out.float() * torch.randn(out.shape, generator=g).to(out.device)).sum() + state.float().sum()
    return out.detach().float(), state.detach().float(), [t.float() for t in torch.autograd.grad(loss, inputs)]


def test_torch_chunked_bf16_against_fp32_recurrence(device):
    ref = _run(recurrent_gated_delta_rule, _inputs(device, torch.float32))
    got = _run(lambda *a, **kw: chunk_gated_delta_rule(*a, chunk_size=64, **kw), _inputs(device, torch.bfloat16))
    # the inputs are rounded to bf16 and the output cast back to it; everything inside is fp32
    torch.testing.assert_close(got[0], ref[0], atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got[1], ref[1], atol=3e-2, rtol=3e-2)


def test_fla_kernel_against_torch(device):
    cuda_only("flash-linear-attention's Triton kernels")
    if not fla_available():
        pytest.skip("flash-linear-attention is not installed")
    assert gated_delta_rule_impl("auto", "cuda") is fla_gated_delta_rule
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float32, 2e-3)):
        inputs = _inputs(device, dtype)
        ref = _run(lambda *a, **kw: chunk_gated_delta_rule(*a, chunk_size=64, **kw),
                   [t.detach().clone().requires_grad_() for t in inputs])
        got = _run(fla_gated_delta_rule, inputs)
        for name, a, b in zip(("out", "state"), got[:2], ref[:2]):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m, n=name: f"{dtype} {n}: {m}")
        for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), got[2], ref[2]):
            scale = b.abs().max().item()
            assert (a - b).abs().max().item() <= tol * max(scale, 1.0), (dtype, name)


def test_tiny_qwen3_next_trains_a_step(device):
    from moefold.models.decoder import MoEDecoder
    from moefold.models.options import ModelOptions
    from moefold.models.recipes import qwen3_next_tiny

    options = ModelOptions(dtype="bf16" if device == "cuda" else "fp32")
    with torch.device(device):
        model = MoEDecoder(qwen3_next_tiny(), options=options)
    model.init_weights(0)
    ids = torch.randint(0, 512, (2, 128), device=device, generator=torch.Generator(device).manual_seed(0))
    out = model(ids, ids.roll(-1, dims=1))
    out.loss.backward()
    assert torch.isfinite(out.loss) and 5.0 < out.lm_loss.item() < 8.0   # ~ln(512) at init
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
