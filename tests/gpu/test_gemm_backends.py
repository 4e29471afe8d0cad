"""GPU grouped-GEMM backends (grouped_mm in bf16, grouped_gemm.ops.gmm, Transformer Engine) vs the loop.

Skipped without CUDA (tests/gpu/conftest.py); a backend whose package is missing is skipped here.
"""

import pytest
import torch

from moefold.moe.experts import GroupedExperts
from moefold.moe.gemm import check_gemm_backend, grouped_gemm


def _require(backend: str) -> None:
    try:
        check_gemm_backend(backend)
    except ImportError as err:
        pytest.skip(str(err))


@pytest.mark.parametrize("backend", ["grouped_mm", "grouped_gemm", "te"])
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("counts", [[64, 0, 128, 40], [0, 0, 0, 256], [0, 0, 0, 0]], ids=["mixed", "one", "empty"])
def test_backend_matches_loop_cuda(backend, trans_w, counts):
    _require(backend)
    gen = torch.Generator(device="cuda").manual_seed(0)
    K, M, dtype = 128, 256, torch.bfloat16
    N = sum(counts)
    x = torch.randn(N, K, device="cuda", generator=gen).to(dtype)
    w = torch.randn(len(counts), *((M, K) if trans_w else (K, M)), device="cuda", generator=gen).to(dtype)
    g = torch.randn(N, M, device="cuda", generator=gen).to(dtype)
    c = torch.tensor(counts, device="cuda")
    results = []
    for b in ("loop", backend):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_gemm(xi, wi, c, b, trans_w=trans_w)
        results.append((y, *torch.autograd.grad(y, (xi, wi), g, allow_unused=True)))
    for name, ref, out in zip(("out", "grad_x", "grad_w"), *results):
        out = torch.zeros_like(ref) if out is None else out
        torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("backend", ["grouped_mm", "grouped_gemm", "te"])
def test_experts_backend_cuda(backend):
    _require(backend)
    torch.manual_seed(0)
    counts = torch.tensor([32, 0, 96, 16], device="cuda")
    x = torch.randn(int(counts.sum()), 64, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(x.shape[0], device="cuda")
    ref = GroupedExperts(4, 64, 128, gemm_backend="loop", dtype=torch.bfloat16, device="cuda")
    mod = GroupedExperts(4, 64, 128, gemm_backend=backend, dtype=torch.bfloat16, device="cuda")
    mod.load_state_dict(ref.state_dict())
    g = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16)
    results = []
    for m in (ref, mod):
        xi = x.clone().requires_grad_()
        y = m(xi, probs, counts)
        results.append((y, *torch.autograd.grad(y, (xi, m.w13, m.w2), g)))
    for name, want, got in zip(("out", "grad_x", "grad_w13", "grad_w2"), *results):
        # bf16 with a different summation order: tolerance relative to the tensor's scale
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * scale, rtol=2e-2, msg=name)
