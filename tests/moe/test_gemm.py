"""Every grouped-GEMM backend available here equals the per-expert loop, values and gradients."""

import pytest
import torch

from moefold.moe.gemm import GemmBackend, check_gemm_backend, grouped_gemm
from moefold.training.observe.host_sync import HostSyncCounter
from tests.moe import grouped_gemm_standin

COUNTS = {
    "mixed": [3, 0, 5, 8],
    "all_to_last": [0, 0, 0, 16],
    "all_to_first": [16, 0, 0, 0],
    "empty": [0, 0, 0, 0],
}
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _available(backend: str) -> bool:
    try:
        check_gemm_backend(backend, torch.bfloat16)
    except ImportError:
        return False
    return backend in ("grouped_mm", "loop") or torch.cuda.is_available()


def _run(backend, x, w, counts, trans_w, grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_gemm(x, w, counts, backend, trans_w=trans_w)
    gx, gw = torch.autograd.grad(y, (x, w), grad)
    return y, gx, gw


@pytest.mark.parametrize("backend", [b for b in GemmBackend if b not in ("loop", "te") and _available(b)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("shape", [(32, 48), (5, 7)], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
def test_backend_matches_loop(backend, dtype, trans_w, shape, counts):
    if backend == "grouped_gemm" and dtype != torch.bfloat16:
        pytest.skip("grouped_gemm runs bf16 only (refused at start-up, see test_grouped_gemm_dtype_checked_at_start)")
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
        check_gemm_backend(backend, torch.bfloat16)
    except ImportError as err:
        assert "pip install" in str(err)
    else:
        pytest.skip(f"{backend} is installed")


# ----------------------------------------------------------------------------------------------
# grouped_gemm through a stand-in for grouped_gemm.ops (tests/moe/grouped_gemm_standin.py: its C++ checks and
# its uninitialised weight-gradient blocks for experts without rows; the protocol, not speed)
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def gmm_calls(monkeypatch):
    return grouped_gemm_standin.install(monkeypatch)


@pytest.mark.parametrize("trans_w", [False, True])
def test_grouped_gemm_zero_rows_skip_the_kernel_with_zero_gradients(gmm_calls, trans_w):
    w = torch.randn(4, *((6, 8) if trans_w else (8, 6))).to(torch.bfloat16).requires_grad_()
    x = torch.zeros(0, 8, dtype=torch.bfloat16, requires_grad=True)
    y = grouped_gemm(x, w, torch.zeros(4, dtype=torch.long), "grouped_gemm", trans_w=trans_w)
    assert y.shape == (0, 6) and gmm_calls.calls == []
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 8)
    assert w.grad is not None and torch.count_nonzero(w.grad) == 0  # zeros, not None: hooks fire
    # with rows (some groups empty) the kernel runs, with host batch sizes and no device sync
    x = torch.randn(5, 8).to(torch.bfloat16).requires_grad_()
    with HostSyncCounter() as syncs:
        gmm_calls.host = syncs.paused
        y = grouped_gemm(x, w, torch.tensor([0, 5, 0, 0]), "grouped_gemm", trans_w=trans_w, counts_host=(0, 5, 0, 0))
    assert gmm_calls.calls == [[0, 5, 0, 0]] and syncs.total == 0, syncs.report()
    want = x @ (w[1].T if trans_w else w[1])
    torch.testing.assert_close(y, want)


def test_grouped_gemm_dtype_checked_at_start(gmm_calls):
    from moefold.moe.build import build_experts
    from moefold.moe.config import ExpertsConfig

    with pytest.raises(ValueError, match=r"runs bf16 only, but the experts are torch.float32.*'grouped_mm'"):
        check_gemm_backend("grouped_gemm", torch.float32)
    with pytest.raises(ValueError, match="bf16 only"):
        build_experts(4, 16, ExpertsConfig(8, gemm_backend="grouped_gemm"))  # default dtype fp32: refused when built
    experts = build_experts(4, 16, ExpertsConfig(8, gemm_backend="grouped_gemm"), dtype=torch.bfloat16)
    x = torch.zeros(0, 16, dtype=torch.bfloat16)
    experts(x, torch.zeros(4, dtype=torch.long)).sum().backward()  # a rank with no tokens
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in experts.parameters())


@pytest.mark.parametrize("trans_w", [False, True])
def test_grouped_gemm_expert_without_rows_gets_an_exactly_zero_weight_gradient(gmm_calls, trans_w):
    """grouped_gemm's weight gradient is ``torch.empty`` and an expert with 0 rows writes none of its block
    (tgale96/grouped_gemm issue 36; the stand-in leaves NaN there): that expert's gradient must be exactly zero,
    the others the loop's."""
    torch.manual_seed(0)
    counts = [3, 0, 5, 0]
    w = torch.randn(4, *((6, 8) if trans_w else (8, 6))).to(torch.bfloat16)
    x = torch.randn(sum(counts), 8).to(torch.bfloat16)
    g = torch.randn(sum(counts), 6).to(torch.bfloat16)
    _, _, gw = _run("grouped_gemm", x, w, torch.tensor(counts), trans_w, g)
    assert [len(c) for c in gmm_calls.calls] == [4, 4, 4]   # forward, dgrad, wgrad: the kernel ran
    assert torch.equal(gw[1], torch.zeros_like(gw[1])) and torch.equal(gw[3], torch.zeros_like(gw[3])), gw
    _, _, want = _run("loop", x.float(), w.float(), torch.tensor(counts), trans_w, g.float())
    torch.testing.assert_close(gw.float(), want, **TOL[torch.bfloat16])
