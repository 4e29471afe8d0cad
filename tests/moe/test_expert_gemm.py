"""The CPU expert path of issue 32: row layouts (packed / aligned / uniform bmm) equal the per-expert reference in
values and gradients, SwiGLU without ``cat`` equals autograd's bit for bit, ``auto`` is a rule (no timing),
``measured`` times a shape once, the sync counter runs the GPU path, and repeated calls reuse their workspaces
instead of allocating fresh large buffers."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from moefold.dense.workspace import MIN_BYTES, WorkspacePool, workspace
from moefold.moe.build import build_experts
from moefold.moe.config import ExpertsConfig
from moefold.moe.cpu import backend as cpu_backend
from moefold.moe.cpu import rows_gemm
from moefold.moe.cpu.expert_rows import ALIGN, ExpertRows, max_auto_rows, pad_rows, unpad_rows
from moefold.moe.cpu.rows_gemm import choose_layout, chosen_layouts, rows_linear
from moefold.moe.grouped_linear import grouped_linear, weight_grad_into
from moefold.moe.swiglu import swiglu_rows
from moefold.parallel.sharding import init_parameters

COUNTS = (5, 0, 37, 2)   # an expert without rows; blocks that do not divide ALIGN


def _reference(x: torch.Tensor, w: torch.Tensor, counts) -> torch.Tensor:
    out, s = [], 0
    for i, c in enumerate(counts):
        out.append(x[s:s + c] @ w[i].T)
        s += c
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["packed", "aligned", "uniform", None])
def test_grouped_linear_layouts_equal_the_per_expert_reference(kind):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(COUNTS), 12, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(len(COUNTS), 7, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(sum(COUNTS), 7, generator=gen, dtype=torch.float64)
    ref = _reference(x, w, COUNTS)
    dx_ref, dw_ref = torch.autograd.grad(ref, (x, w), gy)
    counts = torch.tensor(COUNTS)
    if kind is None:   # the device-count grouped kernel (what CUDA runs)
        y = grouped_linear(x.float(), w.float(), counts).double()
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
        return
    rows = ExpertRows.build(COUNTS, kind)
    assert rows.padded == (kind != "packed") and all(b % ALIGN == 0 for b in rows.blocks if kind != "packed")
    y = unpad_rows(rows_linear(pad_rows(x, rows), w, counts, rows), rows)
    dx, dw = torch.autograd.grad(y, (x, w), gy)
    torch.testing.assert_close(y, ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(dx, dx_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(dw, dw_ref, atol=1e-12, rtol=1e-12)
    assert dw[1].abs().max() == 0   # the expert without rows


@pytest.mark.parametrize("kind", ["aligned", "uniform"])
def test_pad_rows_puts_each_expert_at_its_block_and_zeros_the_padding(kind):
    """The padded buffer holds each expert's rows at its block's start and exact zeros after them, even in a reused
    workspace that held NaNs (the padding rows go through the GEMMs: a stale value there reaches the weight
    gradient), and ``unpad_rows`` and both backward passes give the rows back unchanged."""
    counts = (300, 0, 515, 97, 1, 64)
    x = torch.randn(sum(counts), 512, generator=torch.Generator().manual_seed(3), dtype=torch.float32)
    assert x.numel() * x.element_size() >= MIN_BYTES   # large enough for the workspace pool to reuse buffers
    rows = ExpertRows.build(counts, kind)
    stale = pad_rows(torch.full_like(x, float("nan")), ExpertRows.build(counts[::-1], kind))
    del stale   # its buffer, full of NaNs, goes back to the pool for the next call
    xr = x.clone().requires_grad_()
    padded = pad_rows(xr, rows)
    expected = torch.zeros(rows.total, 512)
    s = 0
    for start, c in zip(rows.starts, counts):
        expected[start:start + c] = x[s:s + c]
        s += c
    assert torch.equal(padded, expected)
    back = unpad_rows(padded, rows)
    assert torch.equal(back, x)
    (grad,) = torch.autograd.grad(back, xr, x)
    assert torch.equal(grad, x)


@pytest.mark.parametrize("accumulate", [False, True])
def test_uniform_bf16_weight_grad_into_contiguous_and_strided_targets(accumulate):
    """The batched weight gradient (uniform layout) in bf16, into the [e, M, K] target and a strided one."""
    rows = ExpertRows.build(COUNTS, "uniform")
    gen = torch.Generator().manual_seed(1)
    x = pad_rows(torch.randn(sum(COUNTS), 12, generator=gen), rows).bfloat16()
    dy = pad_rows(torch.randn(sum(COUNTS), 7, generator=gen), rows).bfloat16()
    want = torch.stack([dy[s:s + b].float().T @ x[s:s + b].float() for s, b in zip(rows.starts, rows.blocks)])
    start = torch.ones(len(COUNTS), 7, 12) if accumulate else torch.zeros(len(COUNTS), 7, 12)
    for target in (start.bfloat16(), start.bfloat16().transpose(1, 2).contiguous().transpose(1, 2)):
        rows_gemm.grouped_weight_grad(x, dy, rows, target, accumulate)
        torch.testing.assert_close(target.float(), want + start, atol=0.1, rtol=0.02)


def test_swiglu_rows_equals_autograd_bit_for_bit():
    h = torch.randn(9, 10, generator=torch.Generator().manual_seed(2), requires_grad=True)
    g = torch.randn(9, 5, generator=torch.Generator().manual_seed(3))
    ref = F.silu(h[:, :5]) * h[:, 5:]
    (dh_ref,) = torch.autograd.grad(ref, h, g)
    out = swiglu_rows(h)
    (dh,) = torch.autograd.grad(out, h, g)
    assert torch.equal(out, ref) and torch.equal(dh, dh_ref)
    with pytest.raises(ValueError, match=r"\[N, 2f\]"):
        swiglu_rows(torch.zeros(3, 5))


@pytest.mark.parametrize("amx", [True, False])
def test_auto_layout_is_a_rule_of_the_dtype_and_cpu_kind_never_a_timing(monkeypatch, amx):
    """``auto`` is reproducible: the same layout in every run and on every rank (no timing: a resumed run and the
    uninterrupted one take the same GEMMs, so their bits agree); fp32 packed; bf16 aligned on an AMX CPU, packed on
    one without AMX; the rule is stated in one line."""
    def no_timing(*_):
        raise AssertionError("auto timed a layout")

    monkeypatch.setattr(rows_gemm, "_time_layout", no_timing)
    monkeypatch.setattr(rows_gemm, "amx_tiles", lambda: amx)
    x, w = torch.randn(256, 16), torch.randn(8, 24, 16)
    assert choose_layout((32,) * 8, x, w).kind == "packed"
    assert ("bf16/fp16 aligned" if amx else "bf16/fp16 packed") in rows_gemm.describe_auto_layout()
    if not amx:
        assert choose_layout((32,) * 8, x.bfloat16(), w.bfloat16()).kind == "packed"
        assert choose_layout((200,) + (8,) * 7, x.bfloat16(), w.bfloat16()).kind == "packed"
        return
    assert choose_layout((32,) * 8, x.bfloat16(), w.bfloat16()).kind == "aligned"
    assert choose_layout((200,) + (8,) * 7, x.bfloat16(), w.bfloat16()).kind == "aligned"
    assert choose_layout((32,) * 8, x, w, forced="uniform").kind == "uniform"
    assert choose_layout((256,), x[:, :16].bfloat16(), w[:1].bfloat16()).kind == "packed"   # one expert
    assert choose_layout((32,) * 8, x.to("meta"), w.to("meta")).kind == "packed"   # off the CPU


def test_measured_layout_once_per_shape(monkeypatch):
    monkeypatch.setattr(rows_gemm, "_CHOSEN", {})
    x, w = torch.randn(256, 16), torch.randn(8, 24, 16)
    first = choose_layout((32,) * 8, x, w, forced="measured")
    again = choose_layout((30, 34) * 4, x, w, forced="measured")   # same shape class: no new measurement
    # (uniform blocks of 64 rows would pass max_auto_rows for these uneven counts: aligned rows instead)
    assert len(chosen_layouts()) == 1 and again.kind == ("aligned" if first.kind == "uniform" else first.kind)
    assert choose_layout((256,), x[:, :16], w[:1], forced="measured").kind == "packed"   # one expert
    assert len(chosen_layouts()) == 1


def test_measured_uniform_never_pads_past_the_planned_bound(monkeypatch):
    """Skewed counts in a shape class measured ``uniform``: one hot expert would give e times the rows (activation
    memory the planner bounds by ``max_auto_rows``); the call takes ``aligned`` rows instead."""
    monkeypatch.setattr(rows_gemm, "_CHOSEN", {})
    monkeypatch.setattr(rows_gemm, "_time_layout", lambda kind, *_: {"uniform": 0.1}.get(kind, 1.0))
    x, w = torch.randn(256, 16), torch.randn(8, 24, 16)
    assert choose_layout((32,) * 8, x, w, forced="measured").kind == "uniform"
    skewed = choose_layout((200,) + (8,) * 7, x, w, forced="measured")   # same shape class; uniform: 8 x 224 rows
    assert skewed.kind == "aligned" and skewed.total <= max_auto_rows(256, 8) < ExpertRows.build(
        (200,) + (8,) * 7, "uniform").total


def test_the_sync_counter_runs_the_gpu_path_of_the_experts(monkeypatch):
    """On CPU the default path reads the counts on the host and lays the rows out (free there); under
    ``HostSyncCounter`` (``moe.cpu.shortcuts.gpu_code_paths``) it runs the GPU's path, which never reads them:
    what the counter counts is the GPU's code."""
    from moefold.training.observe.host_sync import HostSyncCounter

    layouts = []
    real = cpu_backend.choose_layout
    monkeypatch.setattr(cpu_backend, "choose_layout", lambda *a, **k: layouts.append(1) or real(*a, **k))
    layer = build_experts(4, 16, ExpertsConfig(32), dtype=torch.bfloat16)   # bf16: torch's grouped GEMM kernel on GPUs
    x, counts = torch.randn(12, 16, dtype=torch.bfloat16), torch.tensor([3, 0, 5, 4])
    want = layer(x, counts)
    assert layouts == [1]
    with HostSyncCounter() as syncs:
        got = layer(x, counts)
    assert layouts == [1] and syncs.total == 0, syncs.report()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("layout", ["packed", "aligned", "uniform"])
def test_experts_reuse_their_workspaces_and_match_the_loop_backend(layout):
    """Second and later calls allocate no new workspace buffer; values and gradients equal the loop backend."""
    E, H, FFN = 4, 64, 256
    counts = (700, 300, 0, 1048)   # [N, 2F] fp32 = 4 MB: above the pool's MIN_BYTES
    assert sum(counts) * 2 * FFN * 4 > MIN_BYTES
    fast = build_experts(E, H, ExpertsConfig(FFN, row_layout=layout))
    slow = build_experts(E, H, ExpertsConfig(FFN, gemm_backend="loop"))
    init_parameters(fast, seed=5)
    slow.load_state_dict(fast.state_dict())
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(counts), H, generator=gen)
    gy = torch.randn(sum(counts), H, generator=gen)
    pool = workspace("cpu")
    made = []
    for _ in range(3):
        xf = x.clone().requires_grad_()
        fast(xf, torch.tensor(counts)).backward(gy)
        made.append(pool.allocated)
        grads = (xf.grad, fast.w13.grad, fast.w2.grad)
        fast.zero_grad(set_to_none=True)
    assert made[0] > 0 and made[1] == made[2], made   # the pool serves the path; steady state: all reused
    xs = x.clone().requires_grad_()
    slow(xs, torch.tensor(counts)).backward(gy)
    for got, want in zip(grads, (xs.grad, slow.w13.grad, slow.w2.grad)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_workspace_never_hands_out_a_held_buffer():
    pool = WorkspacePool(torch.device("cpu"))
    n = MIN_BYTES // 4 * 2
    a = pool.empty((n,), torch.float32)
    b = pool.empty((n,), torch.float32)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()   # a is still held
    ptr = a.untyped_storage().data_ptr()
    del a
    c = pool.empty((n - 100,), torch.float32)   # a smaller request fits the freed buffer
    assert c.untyped_storage().data_ptr() == ptr and pool.allocated == 2
    small = pool.empty((10,), torch.float32)    # below MIN_BYTES: plain torch.empty, not pooled
    assert pool.allocated == 2 and small.numel() == 10
    del b, c
    pool.release()
    assert pool.free_bytes() == 0


@pytest.mark.parametrize("accumulate", [False, True])
def test_the_device_count_weight_gradient_is_computed_in_the_targets_layout(accumulate):
    """What CUDA runs (no host counts): ``grouped_mm`` computes ``dy_i^T x_i`` in the main grad's [e, M, K] layout
    and the bf16 result is widened into the fp32 target by a copy that reads its source row by row. Computed as
    ``x^T dy`` and transposed (as before), that copy read its source across rows: on the H200 1.9 ms a call at
    Qwen3-30B-A3B's shape, two thirds of the experts' backward. Values: the per-expert products."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Widening(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sources: list[torch.Tensor] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.copy_, torch.ops.aten.add_) and args[0].dim() == 3:
                self.sources.append(args[1])
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(2)
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), 16, generator=gen).bfloat16()
    dy = torch.randn(sum(COUNTS), 8, generator=gen).bfloat16()
    start = torch.randn(len(COUNTS), 8, 16, generator=gen) if accumulate else torch.zeros(len(COUNTS), 8, 16)
    target = start.clone()
    with Widening() as widening:
        weight_grad_into(x, dy, counts, target, accumulate)
    assert widening.sources and all(s.stride(-1) == 1 and s.stride(-2) >= s.shape[-1] for s in widening.sources), \
        [tuple(s.stride()) for s in widening.sources]
    bounds = [0, *torch.cumsum(counts, 0).tolist()]
    want = torch.stack([dy[a:b].float().T @ x[a:b].float() for a, b in itertools.pairwise(bounds)]) + start
    torch.testing.assert_close(target, want, atol=0.05, rtol=0.02)   # bf16 products, rounded once
