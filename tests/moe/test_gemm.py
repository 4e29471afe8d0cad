"""Every grouped-GEMM backend available here equals the per-expert loop, values and gradients."""

import pytest
import torch

from moefold.moe.gemm import GEMM_BACKENDS, check_gemm_backend, grouped_gemm

COUNTS = {
    "mixed": [3, 0, 5, 8],
    "all_to_last": [0, 0, 0, 16],
    "all_to_first": [16, 0, 0, 0],
    "empty": [0, 0, 0, 0],
}
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _available(backend: str) -> bool:
    try:
        check_gemm_backend(backend)
    except ImportError:
        return False
    return backend in ("grouped_mm", "loop") or torch.cuda.is_available()


def _run(backend, x, w, counts, trans_w, grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_gemm(x, w, counts, backend, trans_w=trans_w)
    gx, gw = torch.autograd.grad(y, (x, w), grad)
    return y, gx, gw


@pytest.mark.parametrize("backend", [b for b in GEMM_BACKENDS if b != "loop" and _available(b)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("shape", [(32, 48), (5, 7)], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
def test_backend_matches_loop(backend, dtype, trans_w, shape, counts):
    K, M = shape
    gen = torch.Generator().manual_seed(0)
    N = sum(counts)
    x = torch.randn(N, K, generator=gen).to(dtype)
    w = torch.randn(len(counts), *((M, K) if trans_w else (K, M)), generator=gen).to(dtype)
    grad = torch.randn(N, M, generator=gen).to(dtype)
    c = torch.tensor(counts)
    ref = _run("loop", x, w, c, trans_w, grad)
    out = _run(backend, x, w, c, trans_w, grad)
    for name, a, b in zip(("out", "grad_x", "grad_w"), out, ref):
        assert a.shape == b.shape and a.dtype == dtype, name
        torch.testing.assert_close(a.float(), b.float(), **TOL[dtype], msg=name)
    # the loop itself against a dense fp64 computation (the reference must be right too)
    w64 = w.double().transpose(1, 2) if trans_w else w.double()
    expect = torch.cat([xi @ w64[i] for i, xi in enumerate(x.double().split(counts))])
    torch.testing.assert_close(ref[0].double(), expect, **TOL[dtype])


def test_bad_input_errors():
    x, w = torch.randn(4, 8), torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="unknown"):
        grouped_gemm(x, w, torch.tensor([2, 2]), "nope")
    with pytest.raises(ValueError, match="one count per expert"):
        grouped_gemm(x, w, torch.tensor([4]))
    with pytest.raises(ValueError, match="K=8"):
        grouped_gemm(x, w, torch.tensor([2, 2]), trans_w=True)


@pytest.mark.parametrize("backend", ["grouped_gemm", "te"])
def test_missing_backend_names_package(backend):
    try:
        check_gemm_backend(backend)
    except ImportError as err:
        assert "pip install" in str(err)
    else:
        pytest.skip(f"{backend} is installed")
