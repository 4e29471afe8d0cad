"""Context parallelism: the load-balanced split, and ring / all-gather attention equal to full attention."""

import pytest
import torch

from moefold.dense.context_parallel import (
    context_parallel_attention,
    context_parallel_positions,
    gather_from_context_parallel,
    position_mask,
    split_for_context_parallel,
)
from moefold.dense.core_attention import local_attention
from moefold.parallel.dims import ParallelConfig, ParallelDims
from tests.distributed import run_distributed


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


def _rank():
    gen = torch.Generator().manual_seed(0)
    B, S = 2, 24
    checked = 0
    for cp in (2, 4):
        dims = ParallelDims.build(ParallelConfig(cp=cp))
        with pytest.raises(ValueError, match="cp_comm='ring'"):
            context_parallel_attention(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2),
                                       torch.arange(2), dims.cp_group, mode="ring", scale=1.0)
        # GQA (4 q heads over 2 kv heads) with v wider than q/k (as MLA); windows down to 2 leave whole
        # (query chunk, key chunk) pairs without a visible key
        for window in (None, 7, 2):
            q = torch.randn(B, 4, S, 6, generator=gen)
            k = torch.randn(B, 2, S, 6, generator=gen)
            v = torch.randn(B, 2, S, 5, generator=gen)
            grad_out = torch.randn(B, 4, S, 5, generator=gen)
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = local_attention(*ref_in, torch.arange(S), scale=0.3, sliding_window=window)
            (ref * grad_out).sum().backward()
            pos = context_parallel_positions(S, dims.cp_rank, cp)
            for mode in ("p2p", "all_gather"):
                local = [split_for_context_parallel(t, dims.cp_rank, cp, 2).requires_grad_() for t in (q, k, v)]
                out = context_parallel_attention(*local, pos, dims.cp_group, mode=mode, scale=0.3,
                                                 sliding_window=window)
                (out * split_for_context_parallel(grad_out, dims.cp_rank, cp, 2)).sum().backward()
                got = [out.detach()] + [t.grad for t in local]
                want = [ref.detach()] + [t.grad for t in ref_in]
                for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                    full = gather_from_context_parallel(a, dims.cp_group, 2)
                    torch.testing.assert_close(full, b, atol=1e-5, rtol=0, msg=lambda m: f"cp{cp} {mode} "
                                               f"window={window} {name}: {m}")
                checked += 1
        # bf16 inputs: fp32 softmax statistics inside, bf16 out, close to the fp32 result
        local = [split_for_context_parallel(t, dims.cp_rank, cp, 2).bfloat16() for t in (q, k, v)]
        for mode in ("p2p", "all_gather"):
            out = context_parallel_attention(*local, pos, dims.cp_group, mode=mode, scale=0.3, sliding_window=window)
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(gather_from_context_parallel(out, dims.cp_group, 2).float(), ref.detach(),
                                       atol=3e-2, rtol=0)
    return checked


def test_ring_and_all_gather_equal_full_attention():
    assert run_distributed(_rank, 4)[0] == 2 * 3 * 2
