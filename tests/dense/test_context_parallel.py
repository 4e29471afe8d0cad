"""Context parallelism: the load-balanced split; the fused path's block schedule (exactly the visible
positions, hidden blocks skipped); ring / all-gather attention, fused and math, equal to full attention and
to each other, with the fused kernel called once per scheduled block."""

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moefold.dense.attention import GQAAttention
from moefold.dense.attention_config import AttentionConfig, MLAConfig
from moefold.dense.context_parallel import (
    context_parallel_attention,
    context_parallel_positions,
    gather_from_context_parallel,
    position_mask,
    sdpa,
    split_for_context_parallel,
)
from moefold.dense.core_attention import local_attention
from moefold.dense.cp_fused import all_gather_calls, ring_step_calls
from moefold.dense.mla import MLAttention
from moefold.parallel.dims import ParallelConfig, ParallelDims
from tests.dense.attention_layouts import Layout, attention_maker, compare_implementations, math_cp_maker
from tests.distributed import run_distributed

aten = torch.ops.aten


def test_split_keeps_chunks_r_and_mirror():
    x = torch.arange(16)
    assert split_for_context_parallel(x, 0, 4).tolist() == [0, 1, 14, 15]
    assert split_for_context_parallel(x, 2, 4).tolist() == [4, 5, 10, 11]
    assert context_parallel_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    y = torch.randn(2, 12, 3)
    parts = [split_for_context_parallel(y, r, 3, seq_dim=1) for r in range(3)]
    assert sorted(torch.cat(parts, 1)[0, :, 0].tolist()) == sorted(y[0, :, 0].tolist())
    assert split_for_context_parallel(y, 0, 1, seq_dim=1) is y
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2\*cp=4"):
        split_for_context_parallel(torch.zeros(10), 0, 2)
    with pytest.raises(ValueError, match=r"cp_rank=2 must be in \[0, cp=2\)"):
        split_for_context_parallel(torch.zeros(8), 2, 2)


def test_group_of_one_attends_locally():
    q, k, v = torch.randn(2, 4, 8, 6), torch.randn(2, 2, 8, 6), torch.randn(2, 2, 8, 5)
    for window in (None, 3):
        got = context_parallel_attention(q, k, v, torch.arange(8), None, mode="p2p", scale=0.5, sliding_window=window)
        want = local_attention(q, k, v, torch.arange(8), scale=0.5, sliding_window=window)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_position_mask_is_hf_sliding_window():
    pos = torch.arange(6)
    m = position_mask(pos, pos, 3)
    for i in range(6):
        for j in range(6):
            assert m[i, j] == (j <= i and j > i - 3)


def _coverage(calls, sq: int, sk: int) -> torch.Tensor:
    """How many calls cover each (query, key) position with a visible entry; also checks the kernel contract
    that every query row of a call sees at least one key."""
    cover = torch.zeros(sq, sk, dtype=torch.int64)
    for call in calls:
        allowed = call.window.allowed(call.q1 - call.q0, call.k1 - call.k0, torch.device("cpu"))
        assert allowed.any(-1).all(), f"{call}: a query row sees no key"
        cover[call.q0:call.q1, call.k0:call.k1] += allowed.long()
    return cover


WINDOWS = (None, 1, 2, 3, 5, 8, 13, 100)


def test_fused_schedule_covers_exactly_the_visible_positions():
    """Every (query, key) position the causal mask and window allow is computed by exactly one kernel call,
    no hidden one by any (so fully hidden blocks cost nothing), against masks from true positions."""
    for cp in (2, 3, 4):
        for c in (1, 2, 3, 4):
            S = 2 * cp * c
            for window in WINDOWS:
                for rank in range(cp):
                    q_pos = context_parallel_positions(S, rank, cp)
                    calls = all_gather_calls(rank, cp, c, window)
                    want = position_mask(q_pos, torch.arange(S), window).long()
                    assert torch.equal(_coverage(calls, 2 * c, S), want), (cp, c, window, rank, calls)
                    for src in range(cp):
                        calls = ring_step_calls(rank, src, cp, c, window)
                        want = position_mask(q_pos, context_parallel_positions(S, src, cp), window).long()
                        assert torch.equal(_coverage(calls, 2 * c, 2 * c), want), (cp, c, window, rank, src, calls)


def test_fused_schedule_call_counts():
    """Under a plain causal mask the p2p ring makes one kernel call per step (Megatron/TE's scheme): the own
    block as one causal call, then half of each other block; all_gather one full + one causal call per query
    chunk. Windows add calls only for blocks that cross the window boundary (at most two per query chunk)."""
    for cp in (2, 4):
        c = 3
        for rank in range(cp):
            steps = [ring_step_calls(rank, (rank - s) % cp, cp, c, None) for s in range(cp)]
            assert [len(calls) for calls in steps] == [1] * cp
            assert steps[0][0].window.is_causal and all(calls[0].window.is_full for calls in steps[1:])
            # the math ring computes all 4cp chunk pairs; the fused one the 2cp+1 visible ones, plus the hidden
            # pair inside the own block's causal call (which the kernel's causal mask skips tile by tile)
            area = sum((k.q1 - k.q0) * (k.k1 - k.k0) for calls in steps for k in calls)
            assert area == (2 * cp + 2) * c * c
            assert len(all_gather_calls(rank, cp, c, None)) == (3 if rank == 0 else 4)
            for window in WINDOWS[1:]:
                ring = [k for s in range(cp) for k in ring_step_calls(rank, (rank - s) % cp, cp, c, window)]
                masked = [k for k in ring if not (k.window.is_full or k.window.is_causal)]
                assert len(masked) <= 4, (cp, rank, window, masked)
                gathered = all_gather_calls(rank, cp, c, window)
                assert sum(not (k.window.is_full or k.window.is_causal) for k in gathered) <= 4


class _KernelCalls(TorchDispatchMode):
    """Counts the CPU flash kernel's forward and backward calls: (Sq, Sk, with a mask?) of each."""

    def __init__(self) -> None:
        super().__init__()
        self.forward, self.backward = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.forward.append((args[0].shape[2], args[1].shape[2], kwargs.get("attn_mask") is not None))
        elif func is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
            self.backward.append((args[1].shape[2], args[2].shape[2], kwargs.get("attn_mask") is not None))
        return func(*args, **kwargs)


def _scheduled(mode: str, rank: int, cp: int, c: int, window) -> list[tuple[int, int, bool]]:
    if mode == "p2p":
        calls = [k for s in range(cp) for k in ring_step_calls(rank, (rank - s) % cp, cp, c, window)]
    else:
        calls = list(all_gather_calls(rank, cp, c, window))
    return [(k.q1 - k.q0, k.k1 - k.k0, not (k.window.is_full or k.window.is_causal)) for k in calls]


# (q heads, kv heads, qk head dim, v head dim): GQA with v narrower than q/k (MLA-like), MHA with v wider
SHAPES = ((4, 2, 6, 5), (2, 2, 4, 6))


def _run(local, pos, group, mode, window, grad_out, fused):
    local = [t.clone().requires_grad_() for t in local]
    out = context_parallel_attention(*local, pos, group, mode=mode, scale=0.3, sliding_window=window, fused=fused)
    (out * grad_out).sum().backward()
    return [out.detach()] + [t.grad for t in local]


# layer level: GQA with a window that crosses chunks at cp 4 (chunk 2), MLA with v narrower than q/k
GQA_WINDOW = AttentionConfig(hidden_size=32, num_heads=4, num_query_groups=2, qk_norm=True, sliding_window=5,
                             rope_theta=1000.0)
MLA = MLAConfig(hidden_size=32, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                rope_theta=1000.0)
CP_LAYOUTS = (Layout(cp=2, cp_comm="p2p"), Layout(cp=2, cp_comm="all_gather"), Layout(cp=4, cp_comm="p2p"),
              Layout(cp=4, cp_comm="all_gather"), Layout(tp=2, cp=2, sp=True, cp_comm="p2p", recompute="selective"))


def _layers_fused_equal_math() -> list[str]:
    cache: dict = {}
    done = []
    for cls, config in ((GQAAttention, GQA_WINDOW), (GQAAttention, replace(GQA_WINDOW, sliding_window=None)),
                        (MLAttention, MLA)):
        make = attention_maker(cls, config)
        done += compare_implementations(make, math_cp_maker(make), CP_LAYOUTS, seq=16, batch=2, hidden=32, seed=3,
                                        dims_cache=cache)
    return done


def _sinks_across_cp(dims, cp: int, gen: torch.Generator) -> int:
    """Attention sinks (GPT-OSS) through the fused and math CP paths, both modes, with and without a window that
    crosses chunks: output, dq/dk/dv and the sinks' gradient (a partial sum per CP rank) equal world 1's plain
    softmax-with-sinks math."""
    B, S, h, g, d = 2, 24, 4, 2, 6
    checked = 0
    for window in (None, 5):
        q, k, v = (torch.randn(B, n, S, d, generator=gen) for n in (h, g, g))
        grad_out, sinks = torch.randn(B, h, S, d, generator=gen), torch.randn(h, generator=gen)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        pos = torch.arange(S)
        ref = sdpa(*ref_in[:3], scale=0.3, attn_mask=position_mask(pos, pos, window), sinks=ref_in[3])
        (ref * grad_out).sum().backward()
        local_pos = context_parallel_positions(S, dims.cp_rank, cp)
        local_go = split_for_context_parallel(grad_out, dims.cp_rank, cp, 2)
        for mode in ("p2p", "all_gather"):
            for fused in (True, False):
                local = [split_for_context_parallel(t, dims.cp_rank, cp, 2).requires_grad_() for t in (q, k, v)]
                s = sinks.clone().requires_grad_()
                out = context_parallel_attention(*local, local_pos, dims.cp_group, mode=mode, scale=0.3,
                                                 sliding_window=window, fused=fused, sinks=s)
                (out * local_go).sum().backward()
                what = f"sinks cp{cp} {mode} fused={fused} window={window}"
                for name, a, want in zip(("out", "dq", "dk", "dv"), [out.detach()] + [t.grad for t in local],
                                         [ref.detach()] + [t.grad for t in ref_in[:3]]):
                    torch.testing.assert_close(gather_from_context_parallel(a, dims.cp_group, 2), want, atol=1e-5,
                                               rtol=0, msg=lambda m, n=name: f"{what} {n}: {m}")
                torch.distributed.all_reduce(s.grad, group=dims.cp_group)
                torch.testing.assert_close(s.grad, ref_in[3].grad, atol=1e-5, rtol=0, msg=lambda m: f"{what}: {m}")
                checked += 1
    return checked


def _rank():
    layers = _layers_fused_equal_math()
    gen = torch.Generator().manual_seed(0)
    B, S = 2, 24
    checked = 0
    for cp in (2, 4):
        dims = ParallelDims.build(ParallelConfig(cp=cp))
        c = S // (2 * cp)
        with pytest.raises(ValueError, match="cp_comm='ring'"):
            context_parallel_attention(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2),
                                       torch.arange(2), dims.cp_group, mode="ring", scale=1.0)
        # windows: none (causal), crossing chunk boundaries (7; 4 trims a block at cp 2), shorter than a chunk (2)
        for (h, g, d, dv), window in [(shape, w) for shape in SHAPES for w in (None, 7, 4, 2)]:
            q = torch.randn(B, h, S, d, generator=gen)
            k = torch.randn(B, g, S, d, generator=gen)
            v = torch.randn(B, g, S, dv, generator=gen)
            grad_out = torch.randn(B, h, S, dv, generator=gen)
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = local_attention(*ref_in, torch.arange(S), scale=0.3, sliding_window=window)
            (ref * grad_out).sum().backward()
            want = [ref.detach()] + [t.grad for t in ref_in]
            pos = context_parallel_positions(S, dims.cp_rank, cp)
            local = [split_for_context_parallel(t, dims.cp_rank, cp, 2) for t in (q, k, v)]
            local_grad_out = split_for_context_parallel(grad_out, dims.cp_rank, cp, 2)
            for mode in ("p2p", "all_gather"):
                what = f"cp{cp} {mode} heads={h}/{g} dims={d}/{dv} window={window}"
                with _KernelCalls() as calls:
                    fused = _run(local, pos, dims.cp_group, mode, window, local_grad_out, fused=True)
                # one kernel call per scheduled block, forward and backward; hidden blocks never reach it
                scheduled = _scheduled(mode, dims.cp_rank, cp, c, window)
                assert calls.forward == scheduled and calls.backward == scheduled, (what, calls.forward, scheduled)
                with _KernelCalls() as calls:
                    math = _run(local, pos, dims.cp_group, mode, window, local_grad_out, fused=False)
                assert not calls.forward and not calls.backward  # the reference runs no flash kernel
                for name, a, b, full in zip(("out", "dq", "dk", "dv"), fused, math, want):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=0,
                                               msg=lambda m: f"{what} fused vs math {name}: {m}")
                    torch.testing.assert_close(gather_from_context_parallel(a, dims.cp_group, 2), full, atol=1e-5,
                                               rtol=0, msg=lambda m: f"{what} fused vs world 1 {name}: {m}")
                checked += 1
        checked += _sinks_across_cp(dims, cp, gen)
        # bf16 inputs: fp32 softmax statistics inside, bf16 out, close to the fp32 result
        local = [t.bfloat16() for t in local]
        for mode in ("p2p", "all_gather"):
            for fused in (True, False):
                out = context_parallel_attention(*local, pos, dims.cp_group, mode=mode, scale=0.3,
                                                 sliding_window=window, fused=fused)
                assert out.dtype == torch.bfloat16
                torch.testing.assert_close(gather_from_context_parallel(out, dims.cp_group, 2).float(), ref.detach(),
                                           atol=3e-2, rtol=0)
    return checked, layers


def test_fused_and_math_equal_each_other_and_full_attention():
    """Function level (every value and gradient, fused vs math vs world 1, kernel calls counted) and layer
    level (GQA with and without a window, MLA: output, input and parameter gradients, fused vs math)."""
    checked, layers = run_distributed(_rank, 4)[0]
    assert checked == 2 * len(SHAPES) * 4 * 2 + 2 * 2 * 2 * 2   # + sinks: cp 2/4, windows, modes, fused/math
    assert len(layers) == 3 * len(CP_LAYOUTS)
