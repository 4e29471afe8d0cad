"""GPU grouped-GEMM backends against the per-expert loop, values and gradients in bf16 (CUDA).

grouped_mm and grouped_gemm.ops.gmm through ``grouped_gemm``; Transformer Engine through the
persistent ``TEGroupedLinear`` and ``GroupedExperts`` (also in FP8, against bf16 within FP8's
error). Skipped without CUDA (tests/gpu/conftest.py); a backend whose package is missing is
skipped here. In a rehearsal (tests/gpu/rehearsal.py) grouped_mm runs on the CPU, TE and grouped_gemm
through their CPU stand-ins (tests/moe/te_standin.py, tests/moe/grouped_gemm_standin.py: the calls, not the
kernels). TE runs with zero rows too (every rank of an amax group runs the same TE calls; TE zeroes an empty
GEMM's output, ``csrc/extensions/gemm.cpp``), as ``GroupedExperts`` does.
"""

import pytest
import torch

from moefold.moe.build import build_experts
from moefold.moe.config import ExpertsConfig
from moefold.moe.gemm import check_gemm_backend, grouped_gemm
from moefold.precision.fp8 import FP8Config
from moefold.precision.fp8_region import fp8_autocast
from tests.gpu.rehearsal import gpu_library

COUNTS = {"mixed": [64, 0, 128, 40], "one": [0, 0, 0, 256], "empty": [0, 0, 0, 0]}


def _require(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if backend in ("grouped_gemm", "te"):
        gpu_library(backend, monkeypatch)
    try:
        check_gemm_backend(backend, torch.bfloat16)
    except ImportError as err:
        pytest.skip(str(err))


def _gemm(backend: str, x: torch.Tensor, w: torch.Tensor, counts: list[int], trans_w: bool) -> torch.Tensor:
    if backend != "te":
        return grouped_gemm(x, w, torch.tensor(counts, device=x.device), backend, trans_w=trans_w)
    from moefold.moe.te_gemm import TEGroupedLinear

    w_eMK = w if trans_w else w.transpose(1, 2)
    return TEGroupedLinear(w.shape[0], x.shape[1], w_eMK.shape[1], w.dtype)(x, w_eMK, counts)


@pytest.mark.parametrize("backend", ["grouped_mm", "grouped_gemm", "te"])
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
def test_backend_matches_loop_cuda(backend, trans_w, counts, device, monkeypatch):
    _require(backend, monkeypatch)
    gen = torch.Generator(device=device).manual_seed(0)
    K, M, dtype = 128, 256, torch.bfloat16
    N = sum(counts)
    x = torch.randn(N, K, device=device, generator=gen).to(dtype)
    w = torch.randn(len(counts), *((M, K) if trans_w else (K, M)), device=device, generator=gen).to(dtype)
    g = torch.randn(N, M, device=device, generator=gen).to(dtype)
    results = []
    for b in ("loop", backend):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_gemm(xi, wi, torch.tensor(counts, device=device), "loop", trans_w=trans_w) if b == "loop" \
            else _gemm(b, xi, wi, counts, trans_w)
        gx, gw = torch.autograd.grad(y, (xi, wi), g)
        assert gw is not None, "zero rows must still give w a (zero) gradient"
        results.append((y, gx, gw))
    for name, ref, out in zip(("out", "grad_x", "grad_w"), *results):
        torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("backend", ["grouped_mm", "grouped_gemm", "te"])
def test_experts_backend_cuda(backend, device, monkeypatch):
    _require(backend, monkeypatch)
    torch.manual_seed(0)
    counts = torch.tensor([32, 0, 96, 16], device=device)
    x = torch.randn(int(counts.sum()), 64, device=device, dtype=torch.bfloat16)
    ref = build_experts(4, 64, ExpertsConfig(128, gemm_backend="loop"), dtype=torch.bfloat16, device=device)
    mod = build_experts(4, 64, ExpertsConfig(128, gemm_backend=backend), dtype=torch.bfloat16, device=device)
    mod.load_state_dict(ref.state_dict())
    g = torch.randn(x.shape, device=device, dtype=torch.bfloat16)
    for _ in range(2):  # the TE modules are reused, not rebuilt
        results = []
        for m in (ref, mod):
            xi = x.clone().requires_grad_()
            y = m(xi, counts, tuple(counts.tolist()))
            results.append((y, *torch.autograd.grad(y, (xi, m.w13, m.w2), g)))
        for name, want, got in zip(("out", "grad_x", "grad_w13", "grad_w2"), *results):
            # bf16 with a different summation order: tolerance relative to the tensor's scale
            scale = want.float().abs().max().item()
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * scale, rtol=2e-2, msg=name)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_te_experts_fp8_cuda(recipe, device, monkeypatch):
    """FP8 (hybrid) expert GEMMs against bf16: relative error within FP8's (e4m3 has 3 mantissa bits:
    about 6% per element; a GEMM's output averages it down). Rows per expert not multiples of 16."""
    _require("te", monkeypatch)
    try:
        FP8Config("hybrid", recipe, backend="te").check_available()
    except RuntimeError as err:
        pytest.skip(str(err))
    torch.manual_seed(0)
    counts = [40, 0, 100, 17]
    x = torch.randn(sum(counts), 256, device=device, dtype=torch.bfloat16)
    ref = build_experts(4, 256, ExpertsConfig(512, gemm_backend="te"), dtype=torch.bfloat16, device=device)
    fp8 = build_experts(4, 256, ExpertsConfig(512, gemm_backend="te", fp8=FP8Config("hybrid", recipe, backend="te")),
                        dtype=torch.bfloat16, device=device)
    fp8.load_state_dict(ref.state_dict())
    g = torch.randn(x.shape, device=device, dtype=torch.bfloat16)
    probs = torch.rand(sum(counts), device=device)   # each row's routing prob: padded with the rows under FP8
    for step in range(3):  # delayed scaling needs a step of amax history
        results = []
        for m in (ref, fp8):
            xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
            with fp8_autocast(m.config.fp8_gemms):   # the region a model enters once per forward (precision.fp8_region)
                y = m(xi, torch.tensor(counts, device=device), counts, pi)
            results.append((y, *torch.autograd.grad(y, (xi, pi, m.w13, m.w2), g)))
        if step == 0:
            continue
        for name, want, got in zip(("out", "grad_x", "grad_probs", "grad_w13", "grad_w2"), *results):
            rel = (got.float() - want.float()).norm() / want.float().norm()
            assert rel < 0.1, f"{recipe} step {step} {name}: relative error {rel:.3f}"
