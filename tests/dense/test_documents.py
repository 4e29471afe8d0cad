"""Documents inside packed samples (dense.documents, dense.document_attention):

- the document starts and restarted positions equal Megatron-Core's ``_get_ltor_masks_and_position_ids``
  (transcribed below from megatron/core/datasets/gpt_dataset.py) over the classes of EOD placement: none, first,
  last, consecutive, every token;
- document attention equals every document run alone (SDPA on it, no documents), values and the gradients of q,
  k, v and the sinks, over: GQA, MLA's unequal head dims, sliding windows shorter than, across and longer than a
  tile, attention sinks, documents of one token and one document per sample;
- its memory grows linearly with the sequence: the largest tensor of a forward and backward doubles when the
  sequence doubles (a dense [S, S] mask, measured the same way, quadruples: the measure sees it);
- Gated DeltaNet with documents equals each document through the mixer alone (convolution and recurrence restart).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moefold.dense.context_parallel import position_mask, sdpa
from moefold.dense.document_attention import document_attention, document_calls
from moefold.dense.documents import Documents, document_starts, packed_documents, restarted_positions
from moefold.dense.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig

EPS32 = torch.finfo(torch.float32).eps


def megatron_masks_and_positions(tokens: np.ndarray, eod: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron-Core's ``_get_ltor_masks_and_position_ids`` with every switch on (attention mask True = hidden)."""
    seq_length = tokens.size
    attention_mask = np.tril(np.ones((seq_length, seq_length)))[None, :, :]
    loss_mask = np.ones(seq_length, dtype=np.float32)
    loss_mask[tokens == eod] = 0.0
    position_ids = np.arange(seq_length, dtype=np.int64).copy()
    eod_indices = position_ids[tokens == eod].copy()
    prev_index = 0
    for eod_index in eod_indices:
        next_index = int(eod_index) + 1
        attention_mask[0, next_index:, :next_index] = 0
        position_ids[next_index:] -= next_index - prev_index
        prev_index = next_index
    return attention_mask < 0.5, loss_mask, position_ids


TOKEN_CLASSES = {
    "no eod": [5, 6, 7, 8, 9, 10],
    "eod first": [0, 6, 7, 8, 9, 10],
    "eod last": [5, 6, 0, 8, 9, 0],
    "consecutive": [5, 0, 0, 8, 0, 10],
    "all eod": [0, 0, 0, 0, 0, 0],
}


@pytest.mark.parametrize("name", sorted(TOKEN_CLASSES))
def test_starts_and_positions_are_megatrons(name):
    tokens = torch.tensor([TOKEN_CLASSES[name]])
    hidden, loss_mask, positions = megatron_masks_and_positions(tokens[0].numpy(), eod=0)
    starts = document_starts(tokens, eod=0)
    assert restarted_positions(starts, 6)[0].tolist() == positions.tolist()
    doc = torch.zeros(6, dtype=torch.long)
    for s in starts[0][1:]:
        doc[s:] += 1
    visible = position_mask(torch.arange(6), torch.arange(6)) & (doc[:, None] == doc[None, :])
    assert visible.tolist() == (~torch.from_numpy(hidden[0])).tolist()
    assert (tokens[0] != 0).float().tolist() == loss_mask.tolist()   # what the trainer's --eod-mask-loss takes
    docs = packed_documents(tokens, 0, reset_position_ids=True, reset_attention_mask=True)
    assert docs.starts == starts and docs.positions[0].tolist() == positions.tolist()
    assert packed_documents(tokens, 0, reset_position_ids=False, reset_attention_mask=False) is None


def test_cp_split_and_bad_input():
    tokens = torch.tensor([[3, 0, 4, 5, 0, 6, 7, 8]])
    docs = packed_documents(tokens, 0, reset_position_ids=True, reset_attention_mask=False, cp_rank=1, cp=2)
    assert docs.starts == ((0, 2, 5),) and not docs.isolate
    assert docs.positions.tolist() == [[0, 1, 2, 0]]    # chunks 1 and 2 of 4: tokens 2, 3 and 4, 5
    with pytest.raises(ValueError, match=r"starts\[0\]=\(0, 4, 4\) must increase from 0"):
        Documents(((0, 4, 4),), 8)


def alone(q, k, v, starts, seq_length, window, sinks):
    """Every document through SDPA on its own (the math reference), in packed order."""
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    for b, row in enumerate(starts):
        for s0, s1 in zip(row, (*row[1:], seq_length)):
            pos = torch.arange(s1 - s0)
            out[b, :, s0:s1] = sdpa(q[b:b + 1, :, s0:s1], k[b:b + 1, :, s0:s1], v[b:b + 1, :, s0:s1], scale=0.3,
                                    attn_mask=position_mask(pos, pos, window), sinks=sinks)[0]
    return out


CASES = {   # (heads, kv heads, qk dim, v dim, window, sinks, starts per sample, S)
    "gqa": (4, 2, 16, 16, None, False, ((0, 37, 38, 200), (0, 150)), 300),
    "mla dims": (4, 4, 24, 16, None, False, ((0, 1, 2, 90),), 160),
    "window < tile": (4, 2, 16, 16, 5, False, ((0, 37, 38, 200), (0, 150)), 300),
    "window across tiles": (2, 1, 16, 8, 129, False, ((0, 300),), 400),
    "window > documents": (2, 2, 8, 8, 1000, True, ((0, 17), (0,)), 64),
    "sinks and window": (4, 2, 16, 16, 40, True, ((0, 100, 101),), 260),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_document_attention_equals_each_document_alone(case):
    h, g, d, dv, window, with_sinks, starts, S = CASES[case]
    gen = torch.Generator().manual_seed(0)
    B = len(starts)
    leaves = [torch.randn(B, h, S, d, generator=gen), torch.randn(B, g, S, d, generator=gen),
              torch.randn(B, g, S, dv, generator=gen)] + ([torch.randn(h, generator=gen)] if with_sinks else [])
    got_leaves = [t.clone().requires_grad_() for t in leaves]
    ref_leaves = [t.clone().requires_grad_() for t in leaves]
    sinks = got_leaves[3] if with_sinks else None
    got = document_attention(*got_leaves[:3], Documents(starts, S), scale=0.3, sliding_window=window, sinks=sinks)
    ref = alone(*ref_leaves[:3], starts, S, window, ref_leaves[3] if with_sinks else None)
    grad = torch.randn(got.shape, generator=gen)
    got.backward(grad)
    ref.backward(grad)
    # fp32 sums of at most S terms of |value| <= max: a few ulps of the largest element per term summed
    for name, a, b in [("out", got, ref)] + [(f"grad {i}", x.grad, y.grad)
                                             for i, (x, y) in enumerate(zip(got_leaves, ref_leaves))]:
        limit = 4 * EPS32 * S ** 0.5 * b.abs().max().item()
        assert (a - b).abs().max().item() <= limit, (case, name, (a - b).abs().max().item(), limit)


def test_calls_cover_each_visible_pair_once():
    """The planned blocks, expanded to (query, key) pairs, are exactly the visible pairs, each once."""
    starts, S = ((0, 3, 40, 41, 100),), 128
    for rank, cp in ((0, 1), (1, 2), (0, 4), (3, 4)):
        for window in (None, 4, 50, 200):
            seen = torch.zeros(S, S, dtype=torch.long)
            rows = torch.cat([torch.arange(r * S // (2 * cp), (r + 1) * S // (2 * cp))
                              for r in ((rank, 2 * cp - 1 - rank) if cp > 1 else (0,))]) if cp > 1 else torch.arange(S)
            srcs = range(cp) if cp > 1 else [None]
            for src in srcs:
                cols = rows if src is None else torch.cat([torch.arange(r * S // (2 * cp), (r + 1) * S // (2 * cp))
                                                           for r in (src, 2 * cp - 1 - src)])
                for call in document_calls(starts, S, rank, cp, src, window):
                    allowed = call.window.allowed(call.q1 - call.q0, call.k1 - call.k0, torch.device("cpu"))
                    qi, kj = allowed.nonzero(as_tuple=True)
                    seen.index_put_((rows[call.q0 + qi], cols[call.k0 + kj]), torch.ones_like(qi), accumulate=True)
                    assert allowed.any(dim=1).all(), (call, "a row of the call sees no key")
            doc = torch.zeros(S, dtype=torch.long)
            for s in starts[0][1:]:
                doc[s:] += 1
            expect = position_mask(torch.arange(S), torch.arange(S), window) & (doc[:, None] == doc[None, :])
            assert torch.equal(seen[rows], expect[rows].long()), (rank, cp, window)


class LargestTensor(TorchDispatchMode):
    """The most bytes any one tensor an op returns holds."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def largest_tensor(S: int, window: int | None, dense: bool) -> int:
    q, k, v = (torch.randn(1, 2, S, 16, requires_grad=True) for _ in range(3))
    docs = Documents(((0, S // 4),), S)   # one document of 3/4 of the sample: quadratic work inside it
    with LargestTensor() as mode:
        if dense:   # the baseline the plan avoids: a boolean [S, S] mask of same-document causal pairs
            doc = (torch.arange(S) >= S // 4).long()
            mask = position_mask(torch.arange(S), torch.arange(S), window) & (doc[:, None] == doc[None, :])
            out = sdpa(q, k, v, scale=0.25, attn_mask=mask)
        else:
            out = document_attention(q, k, v, docs, scale=0.25, sliding_window=window)
        out.sum().backward()
    return mode.bytes


@pytest.mark.parametrize("window", [None, 64])
def test_memory_is_linear_in_the_sequence(window):
    small, large = largest_tensor(1024, window, False), largest_tensor(2048, window, False)
    assert large <= 2 * small, (small, large)
    dense_small, dense_large = largest_tensor(1024, window, True), largest_tensor(2048, window, True)
    assert dense_large >= 3.9 * dense_small   # the measure does see a quadratic allocation


def test_gated_deltanet_restarts_at_each_document():
    config = GatedDeltaNetConfig(hidden_size=32, num_key_heads=2, num_value_heads=4, key_head_dim=8,
                                 value_head_dim=8, conv_kernel_size=4, chunk_size=8)
    mixer = GatedDeltaNet(config)
    starts, S = ((0, 1, 9), (0, 13)), 20
    x = torch.randn(S, 2, 32, requires_grad=True)
    got = mixer(x, torch.arange(S), Documents(starts, S))
    ref = torch.zeros_like(got)
    for b, row in enumerate(starts):
        for s0, s1 in zip(row, (*row[1:], S)):
            ref[s0:s1, b:b + 1] = mixer(x[s0:s1, b:b + 1], torch.arange(s1 - s0))
    assert (got - ref).abs().max().item() <= 16 * EPS32 * ref.abs().max().item()
    whole = mixer(x, torch.arange(S))
    assert (whole - ref).abs().max().item() > 1e-3   # without documents the state crosses them
    grad = torch.randn_like(got)
    (g_got,) = torch.autograd.grad(got, x, grad)
    (g_ref,) = torch.autograd.grad(ref, x, grad)
    assert (g_got - g_ref).abs().max().item() <= 16 * EPS32 * S ** 0.5 * g_ref.abs().max().item()


def test_qk_clip_records_the_largest_logit_inside_documents():
    """``max_logit`` (--qk-clip) sees the logits attention computes: none across documents."""
    from moefold.dense.attention import GQAAttention
    from moefold.dense.attention_config import AttentionConfig

    torch.manual_seed(0)
    attn = GQAAttention(AttentionConfig(hidden_size=32, num_heads=4, num_query_groups=2, max_logit=True))
    starts, S = ((0, 5, 9), (0, 12)), 16
    x = torch.randn(S, 2, 32) * 4
    attn(x, torch.arange(S), Documents(starts, S))
    packed = attn.max_logits
    alone = []
    for b, row in enumerate(starts):
        for s0, s1 in zip(row, (*row[1:], S)):
            attn.max_logits = None
            attn(x[s0:s1, b:b + 1], torch.arange(s1 - s0))
            alone.append(attn.max_logits)
    assert torch.allclose(packed, torch.stack(alone).amax(0), rtol=1e-6, atol=0)
    attn.max_logits = None
    attn(x, torch.arange(S))
    assert (attn.max_logits > packed).any()   # across documents there is a larger one: the test sees it
