"""Every grouped-GEMM backend available here equals the per-expert loop, values and gradients."""

import contextlib
import sys
import types

import pytest
import torch

from moefold.moe.gemm import GEMM_BACKENDS, check_gemm_backend, grouped_gemm
from moefold.training.observe.host_sync import HostSyncCounter

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


@pytest.mark.parametrize("backend", [b for b in GEMM_BACKENDS if b not in ("loop", "te") and _available(b)])
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
# grouped_gemm through a stand-in for grouped_gemm.ops (CUDA-only library): the protocol, not speed
# ----------------------------------------------------------------------------------------------
class _Calls(list):
    """The batch sizes of each gmm call; ``host`` wraps the stand-in's own reads of them (a host tensor)."""

    host = staticmethod(contextlib.nullcontext)


def _grouped_gemm_standin(calls: _Calls) -> types.ModuleType:
    """``grouped_gemm.ops`` with gmm(a, b, batch_sizes, trans_b=False)'s argument checks (csrc/grouped_gemm.cu:
    batch sizes int64 on the host, contiguous bf16 operands) and a kernel that, like CUTLASS's grouped
    GEMM, cannot run without any rows. Computes with the loop, so gradients are real."""
    def gmm(a, b, batch_sizes, trans_b=False):
        assert batch_sizes.device.type == "cpu" and batch_sizes.dtype == torch.int64
        assert a.dtype == b.dtype == torch.bfloat16 and a.is_contiguous() and b.is_contiguous()
        assert b.dim() == 3 and batch_sizes.shape == (b.shape[0],)
        with calls.host():
            sizes = batch_sizes.tolist()
        if sum(sizes) == 0:
            raise RuntimeError("Grouped GEMM execution not possible with HW")
        calls.append(sizes)
        return grouped_gemm(a, b, batch_sizes, "loop", trans_w=trans_b, counts_host=sizes)

    ops = types.ModuleType("grouped_gemm.ops")
    ops.gmm = gmm
    return ops


@pytest.fixture
def gmm_calls(monkeypatch):
    calls = _Calls()
    pkg = types.ModuleType("grouped_gemm")
    pkg.ops = _grouped_gemm_standin(calls)
    monkeypatch.setitem(sys.modules, "grouped_gemm", pkg)
    monkeypatch.setitem(sys.modules, "grouped_gemm.ops", pkg.ops)
    return calls


@pytest.mark.parametrize("trans_w", [False, True])
def test_grouped_gemm_zero_rows_skip_the_kernel_with_zero_gradients(gmm_calls, trans_w):
    w = torch.randn(4, *((6, 8) if trans_w else (8, 6))).to(torch.bfloat16).requires_grad_()
    x = torch.zeros(0, 8, dtype=torch.bfloat16, requires_grad=True)
    y = grouped_gemm(x, w, torch.zeros(4, dtype=torch.long), "grouped_gemm", trans_w=trans_w)
    assert y.shape == (0, 6) and gmm_calls == []
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 8)
    assert w.grad is not None and torch.count_nonzero(w.grad) == 0  # zeros, not None: hooks fire
    # with rows (some groups empty) the kernel runs, with host batch sizes and no device sync
    x = torch.randn(5, 8).to(torch.bfloat16).requires_grad_()
    with HostSyncCounter() as syncs:
        gmm_calls.host = syncs.paused
        y = grouped_gemm(x, w, torch.tensor([0, 5, 0, 0]), "grouped_gemm", trans_w=trans_w, counts_host=(0, 5, 0, 0))
    assert gmm_calls == [[0, 5, 0, 0]] and syncs.total == 0, syncs.report()
    want = x @ (w[1].T if trans_w else w[1])
    torch.testing.assert_close(y, want)


def test_grouped_gemm_dtype_checked_at_start(gmm_calls):
    from moefold.moe.experts import GroupedExperts

    with pytest.raises(ValueError, match=r"runs bf16 only, but the experts are torch.float32.*'grouped_mm'"):
        check_gemm_backend("grouped_gemm", torch.float32)
    with pytest.raises(ValueError, match="bf16 only"):
        GroupedExperts(4, 16, 8, gemm_backend="grouped_gemm")  # default dtype fp32: refused when built
    experts = GroupedExperts(4, 16, 8, gemm_backend="grouped_gemm", dtype=torch.bfloat16)
    x = torch.zeros(0, 16, dtype=torch.bfloat16)
    experts(x, torch.zeros(4, dtype=torch.long)).sum().backward()  # a rank with no tokens
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in experts.parameters())
