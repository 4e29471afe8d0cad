"""Permutation and chunk sorting: exact orderings, inverses, padding, empty inputs, gradients."""

import pytest
import torch

from moefold.dispatch import (
    DispatchConfig,
    DispatcherKind,
    FlexBackend,
    FlexOptions,
    LocalDispatcher,
    build_dispatcher,
    build_row_map,
    mask_groups,
    permute,
    permute_probs,
    sort_chunks,
    unpermute,
)
from tests.dispatch.common import H, expert_weights, make_case, make_routing, reference, run_experts


def test_permute_is_stable_expert_major():
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    key = mask_groups(ids, 3)
    rm = build_row_map(key, 3, 2, 3, num_rows=6)
    assert rm.slot_of_row_N.tolist() == [1, 2, 3, 5, 0, 4]
    assert rm.counts_G.tolist() == [2, 2, 2]
    x = torch.arange(3.0).unsqueeze(1)
    assert permute(x, rm).squeeze(1).tolist() == [0, 1, 1, 2, 0, 2]


def test_dropped_and_out_of_range_copies_are_not_dispatched():
    ids = torch.tensor([[2, 0], [0, 1], [5, -1]])
    keep = torch.tensor([[True, False], [True, True], [True, True]])
    key = mask_groups(ids, 3, keep)
    rm = build_row_map(key, 3, 2, 3)  # num_rows from one sync
    assert rm.slot_of_row_N.tolist() == [2, 3, 0]
    assert rm.counts_G.tolist() == [1, 1, 1]


def test_padded_rows_and_truncation():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1]])
    rm = build_row_map(mask_groups(ids, 3), 3, 2, 3, capacity=2)
    # expert 0 keeps its first 2 copies (the third is beyond capacity), expert 2 one copy + one pad
    assert rm.slot_of_row_N.tolist() == [0, 2, 1, 5, 3, 6]
    assert rm.token_of_row_N.tolist() == [0, 1, 0, 2, 1, 3]
    x = torch.tensor([[1.0], [2.0], [3.0]], requires_grad=True)
    probs = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], requires_grad=True)
    rows = permute(x, rm)
    assert rows.squeeze(1).tolist() == [1, 2, 1, 3, 2, 0]
    # each row's prob (0 for the padding row): token 2's copy of expert 0 was truncated (weight unused)
    p_N = permute_probs(probs, rm)
    assert torch.equal(p_N, torch.tensor([0.1, 0.3, 0.2, 0.6, 0.4, 0.0]))
    y = unpermute(rows * p_N[:, None], rm)   # the experts weight the rows, the combine sums them
    assert torch.allclose(y.squeeze(1), torch.tensor([0.3, 0.6 + 0.8, 3 * 0.6]))
    y.sum().backward()
    assert torch.allclose(x.grad.squeeze(1), torch.tensor([0.3, 0.7, 0.6]))
    assert torch.allclose(probs.grad, torch.tensor([[1.0, 1.0], [2.0, 2.0], [0.0, 3.0]]))


def test_permute_unpermute_adjoint_gradients():
    torch.manual_seed(0)
    ids = torch.randint(0, 4, (6, 3))
    rm = build_row_map(mask_groups(ids, 4), 6, 3, 4, num_rows=18)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: permute(t, rm), (x,))
    rows = torch.randn(18, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r: unpermute(r, rm), (rows,))
    assert torch.equal(unpermute(permute(x, rm), rm), 3 * x)


@pytest.mark.parametrize("variant", ["complete", "dropped", "padded"])
def test_weighted_rows_unpermute_gradients(variant):
    """y[t] = sum_k p[t, k] * row(t, k) with the probs laid out as the rows (``permute_probs``, what the experts
    weight by) and the rows summed: gradients of the rows AND the probs."""
    torch.manual_seed(0)
    T, K, E = 6, 3, 4
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    keep = None if variant == "complete" else torch.rand(T, K) > 0.3
    rm = build_row_map(mask_groups(ids, E, keep), T, K, E, capacity=T if variant == "padded" else None)
    rows = torch.randn(rm.num_rows, 5, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    def weighted(r, p):
        return unpermute(r * permute_probs(p, rm)[:, None], rm)

    assert torch.autograd.gradcheck(weighted, (rows, probs))
    # against the definition, one copy at a time
    want = torch.zeros(T, 5, dtype=torch.float64)
    for n, slot in enumerate(rm.slot_of_row_N.tolist()):
        if slot < T * K:
            want[slot // K] += probs.view(-1)[slot] * rows[n]
    torch.testing.assert_close(weighted(rows, probs), want)
    with pytest.raises(ValueError, match=r"probs have shape \(6, 2\)"):
        permute_probs(probs[:, :2], rm)


def test_zero_tokens():
    ids = torch.zeros(0, 2, dtype=torch.long)
    for capacity in (None, 2):
        rm = build_row_map(mask_groups(ids, 4), 0, 2, 4, capacity=capacity)
        x = torch.zeros(0, H, requires_grad=True)
        rows = permute(x, rm)
        assert rows.shape == (0 if capacity is None else 8, H)
        assert unpermute(rows, rm).shape == (0, H)


def test_sort_chunks_and_inverse():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [A=2 source ranks, B=3 experts]
    x = torch.tensor([10, 11, 12, 20, 21, 22, 23]).unsqueeze(1)
    # chunks: (0,0)=[10,11] (0,1)=[] (0,2)=[12] (1,0)=[20] (1,1)=[21,22,23] (1,2)=[]
    y = sort_chunks(x, counts)
    assert y.squeeze(1).tolist() == [10, 11, 20, 21, 22, 23, 12]
    assert torch.equal(sort_chunks(y, counts.t()), x)
    assert sort_chunks(x[:0], torch.zeros(2, 3, dtype=torch.long)).shape == (0, 1)
    with pytest.raises(ValueError, match=r"\[A, B\]"):
        sort_chunks(x, counts.reshape(-1))


@pytest.mark.parametrize("case", ["random", "one_expert", "topk_all"])
@pytest.mark.parametrize("mode", ["dropless", "drop", "padded"])
def test_local_dispatcher_matches_reference(case, mode):
    E = 8
    x, ids, probs = make_case(case, [9], E)
    w1, w2 = expert_weights(E)
    routing = make_routing(probs.requires_grad_(), ids, E, mode, capacity=3)
    xr = x.clone().requires_grad_()
    d = LocalDispatcher(E)
    out = d.dispatch(xr, routing)
    per = out.tokens_per_expert_e.tolist()
    assert sum(per) == out.tokens_NH.shape[0]
    if mode == "padded":
        assert per == [3] * E
    y = d.combine(run_experts(out.tokens_NH, per, 0, w1, w2, probs_N=out.probs_N), out.handle)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    (y * g).sum().backward()
    gx, gp = xr.grad, probs.grad.clone()
    probs.grad = None
    x2 = x.clone().requires_grad_()
    y_ref = reference(x2, probs, ids, routing.keep_TK, w1, w2)
    (y_ref * g).sum().backward()
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(gx, x2.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(gp, probs.grad, atol=1e-5, rtol=0)


def test_factory_errors():
    with pytest.raises(ValueError, match=r"unknown dispatcher kind 'a2a'.*alltoall"):
        build_dispatcher(DispatchConfig("a2a"), 8)
    with pytest.raises(ValueError, match="num_experts=0"):
        build_dispatcher(DispatchConfig(DispatcherKind.ALLTOALL), 0)
    assert isinstance(build_dispatcher(DispatchConfig(DispatcherKind.LOCAL), 4), LocalDispatcher)


def test_dispatch_rejects_mismatched_routing():
    E = 4
    x, ids, probs = make_case("random", [5], E)
    routing = make_routing(probs, ids, E, "dropless", 2)
    with pytest.raises(ValueError, match="num_experts=8"):
        LocalDispatcher(8).dispatch(x, routing)
    with pytest.raises(ValueError, match="x has 4 tokens"):
        LocalDispatcher(E).dispatch(x[:4], routing)


def test_flex_without_deep_ep_says_what_to_install():
    import importlib.util

    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("deep_ep is installed here")
    with pytest.raises(ImportError, match=r"DeepEP V2 .*not on .*PyPI.*nvidia-nccl.*setup.py install"):
        build_dispatcher(DispatchConfig(DispatcherKind.FLEX), 8)   # auto: V2, what a DeepEP checkout builds today
    with pytest.raises(ImportError, match=r"DeepEP v1.2.1 \(not on PyPI\).*setup.py install.*CUDA"):
        build_dispatcher(DispatchConfig(DispatcherKind.FLEX, FlexOptions(FlexBackend.DEEPEP_LEGACY)), 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["complete", "dropped", "padded"])
def test_unpermute_sums_copies_in_every_map_kind(dtype, variant):
    torch.manual_seed(0)
    T, K, E = 7, 3, 4
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    keep = None if variant == "complete" else torch.rand(T, K) > 0.3
    rm = build_row_map(mask_groups(ids, E, keep), T, K, E, capacity=T if variant == "padded" else None)
    x = torch.randn(T, 5).to(dtype)
    kept = torch.ones(T, K) if keep is None else keep.float()
    want = x.float() * kept.sum(1, keepdim=True)
    # fp32: a sum of at most K equal values; bf16: rounding of that sum
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(unpermute(permute(x, rm), rm).float(), want, **tol)


def test_dispatch_is_deterministic():
    E = 8
    x, ids, probs = make_case("topk_all", [33], E)
    routing = make_routing(probs, ids, E, "drop", capacity=5)
    a, b = LocalDispatcher(E).dispatch(x, routing), LocalDispatcher(E).dispatch(x, routing)
    assert torch.equal(a.tokens_NH, b.tokens_NH)
    assert torch.equal(LocalDispatcher(E).combine(a.tokens_NH, a.handle), LocalDispatcher(E).combine(b.tokens_NH,
                                                                                                     b.handle))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["complete", "padded"])
def test_large_rows_equal_the_formulas(dtype, variant):
    """Rows of several blocks (the combine sums bf16 rows in blocks of about 2**20 elements), repeated calls
    (reused workspaces): the values are the formulas' bit for bit: rows = x[token], the combine's backward
    grad_rows = grad[token] (rounded to the rows' dtype), the probs' rows p[slot] and their gradient back to the
    slots."""
    from moefold.dense.workspace import MIN_BYTES

    gen = torch.Generator().manual_seed(3)
    T, K, E, Hd = 1024, 4, 8, 256
    assert T * K * Hd * 4 > 2 * MIN_BYTES
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
    rm = build_row_map(mask_groups(ids, E), T, K, E, **({"capacity": T * K // E + 8} if variant == "padded"
                                                          else {"num_rows": T * K}))
    x = torch.randn(T, Hd, generator=gen).to(dtype)
    probs = torch.rand(T, K, generator=gen)
    gy = torch.randn(T, Hd, generator=gen)
    g_p = torch.randn(rm.num_rows, generator=gen)
    expert_out = torch.randn(rm.num_rows, Hd, generator=gen).to(dtype)
    for _ in range(3):
        xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
        rows = permute(xr, rm)
        p_N = permute_probs(pr, rm)
        out = (rows * 0 + expert_out).detach().requires_grad_()   # the experts' output, a leaf
        torch.autograd.backward([unpermute(out, rm), p_N], [gy, g_p])
        got = (rows.detach().clone(), out.grad.clone(), p_N.detach().clone(), pr.grad.clone())
        del rows, out
    token = rm.token_of_row_N
    src = torch.cat([x, x.new_zeros(1, Hd)]) if rm.padded else x
    g = torch.cat([gy, gy.new_zeros(1, Hd)])[token] if rm.padded else gy[token]
    p_row = torch.cat([probs.reshape(-1), probs.new_zeros(1)])[rm.slot_of_row_N]
    assert torch.equal(got[0], src[token])
    assert torch.equal(got[1], g.to(dtype))
    assert torch.equal(got[2], p_row)
    want_p = g_p.new_zeros(T * K + 1).scatter_(0, rm.slot_of_row_N, g_p)[:T * K].view(T, K)
    assert torch.equal(got[3], want_p)


def test_the_combine_in_blocks_equals_one_block():
    """bf16 rows are summed a block of tokens at a time through reused workspaces (``combine_block_elems``): the
    result, and the permute's backward (the same sum), are bitwise those of one block."""
    from moefold.dispatch import permutation

    gen = torch.Generator().manual_seed(0)
    T, K, E, Hd = 301, 3, 8, 24   # blocks of 7 tokens (the last one short)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
    rm = build_row_map(mask_groups(ids, E), T, K, E, capacity=100)   # some copies dropped, padding rows
    rows = torch.randn(rm.num_rows, Hd, generator=gen, dtype=torch.bfloat16)
    results = []
    for elems in (2**24, 7 * K * Hd):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(permutation, "combine_block_elems", lambda device, elems=elems: elems)
            results.append(unpermute(rows, rm))
    assert results[0].dtype == torch.float32
    assert torch.equal(*results)
