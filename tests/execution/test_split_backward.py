"""Split backward (``dense.split_backward``): input gradients in ``I``, weight gradients in ``W``.

For every module kind that defers (dense MLP, GQA and MLA attention, torchao FP8 linears, the decoder
block with its MoE FFN; the routed experts' grouped GEMMs in tests/moe/test_split_gemm.py): after the
``I`` backward the input gradient equals the plain backward's bit for bit while the deferred weights have
received nothing, and after ``W`` every parameter gradient equals the plain one bit for bit (the same
kernels on the same operands), post-accumulate hooks included. Selective recompute inside the module
runs in ``I`` only (``W`` replays nothing).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moefold.dense.attention import GQAAttention
from moefold.dense.attention_config import AttentionConfig, MLAConfig
from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear
from moefold.dense.mla import MLAttention
from moefold.dense.mlp import DenseMLP, MLPConfig
from moefold.dense.regions import CHECKPOINT
from moefold.dense.split_backward import WeightGradStore
from moefold.execution.fp8_linear import convert_linears_to_fp8
from moefold.execution.recompute import DISCARD_OUTPUT
from moefold.execution.split_backward import install_weight_grad_store
from moefold.parallel.sharding import init_parameters
from moefold.precision.fp8 import FP8Config

S, B, H = 8, 2, 32
GQA = AttentionConfig(hidden_size=H, num_heads=4, num_query_groups=2, head_dim=8, qk_norm=True, bias=True)
MLA = MLAConfig(hidden_size=H, num_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=6, bias=True)


class _Linears(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(H, 48, None, bias=bias)
        self.down = RowParallelLinear(48, H, None, bias=bias)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _modules():
    pos = torch.arange(S)
    fp8 = _Linears(bias=True)
    convert_linears_to_fp8(fp8, FP8Config("hybrid", "tensorwise"))
    fp8_rowwise = _Linears(bias=False)
    convert_linears_to_fp8(fp8_rowwise, FP8Config("e4m3", "rowwise"))
    recomputed = MLAttention(MLA, None)
    recomputed.configure(core_attn=CHECKPOINT, up_proj=DISCARD_OUTPUT)
    return {
        "dense_mlp": (DenseMLP(MLPConfig(hidden_size=H, ffn_hidden_size=48), None), lambda m, x: m(x)),
        "linears_bias": (_Linears(bias=True), lambda m, x: m(x)),
        "gqa": (GQAAttention(GQA, None), lambda m, x: m(x, pos)),
        "mla": (MLAttention(MLA, None), lambda m, x: m(x, pos)),
        "mla_recompute": (recomputed, lambda m, x: m(x, pos)),
        "fp8_tensorwise": (fp8, lambda m, x: m(x)),
        "fp8_rowwise": (fp8_rowwise, lambda m, x: m(x)),
    }


MODULES = list(_modules())


def _grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("name", MODULES)
def test_split_backward_equals_plain_backward(name):
    module, call = _modules()[name]
    init_parameters(module, seed=3)
    split = copy.deepcopy(module)
    store = WeightGradStore()
    deferring = install_weight_grad_store(split, store)
    assert deferring, "no module took the store"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(S, B, H, generator=gen)
    dy = torch.randn(S, B, H, generator=gen)

    x_plain = x.clone().requires_grad_()
    call(module, x_plain).backward(dy)

    hooks: list[str] = []
    for n, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: hooks.append(n))
    x_split = x.clone().requires_grad_()
    with store.splitting():
        out = call(split, x_split)
    with store.defer() as later:
        out.backward(dy)
    assert torch.equal(x_split.grad, x_plain.grad), "I: the input gradient differs from the plain backward's"
    assert len(later) > 0
    waiting = [n for n, p in split.named_parameters() if p.grad is None]
    assert any(n.endswith("weight") for n in waiting), "I computed every weight gradient: nothing was deferred"
    reported = list(hooks)
    later.run()
    assert len(later) == 0
    assert sorted(hooks) == sorted(n for n, _ in split.named_parameters()), "every parameter reports once"
    assert set(hooks) - set(reported) == set(waiting), "the deferred ones report in W"
    plain, got = _grads(module), _grads(split)
    for n in plain:
        assert torch.equal(got[n], plain[n]), f"W: {name}.{n} differs from the plain backward"


def test_outside_defer_the_split_gemms_compute_everything_at_once():
    """A split forward backpropagated outside ``defer()`` accumulates at once; a forward outside ``splitting()`` is
    the plain graph (nothing defers, even inside ``defer()``)."""
    module = _Linears(bias=True)
    init_parameters(module, seed=1)
    split = copy.deepcopy(module)
    store = WeightGradStore()
    install_weight_grad_store(split, store)
    x = torch.randn(S, B, H)
    module(x).sum().backward()
    with store.splitting():
        out = split(x)
    out.sum().backward()
    for (n, a), (_, b) in zip(module.named_parameters(), split.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
    split.zero_grad(set_to_none=True)
    with store.defer() as later:
        split(x).sum().backward()
    assert len(later) == 0
    for (n, a), (_, b) in zip(module.named_parameters(), split.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_nested_deferral_and_merge_keep_the_order():
    """An inner deferral (delay-wgrad inside an I) hands its GEMMs to the outer one; W accumulates into an
    existing gradient in place (the main-grad buffer), as AccumulateGrad does."""
    module = _Linears(bias=False)
    init_parameters(module, seed=2)
    store = WeightGradStore()
    install_weight_grad_store(module, store)
    buffers = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
    for n, p in module.named_parameters():
        p.grad = buffers[n]
    with store.splitting():
        out = module(torch.randn(S, B, H))
    with store.defer() as outer:
        with store.defer() as inner:
            out.sum().backward()
        assert len(inner) == 2 and len(outer) == 0
        inner.merge_into(outer)
    assert len(outer) == 2 and all(b.abs().sum() == 0 for b in buffers.values())
    outer.run()
    for n, p in module.named_parameters():
        assert p.grad is buffers[n] and p.grad.abs().sum() > 0, n


def test_transformer_engine_linear_is_refused_with_one_line():
    from moefold.execution.split_backward import split_local_gemm

    class TE:
        def __call__(self, x, w, b=None):
            return x

        def describe(self):
            return "Transformer Engine e4m3 delayed"

    with pytest.raises(ValueError, match="cannot defer the weight gradient of a Transformer Engine"):
        split_local_gemm(TE(), WeightGradStore())


@pytest.mark.parametrize("split", [False, True])
def test_the_split_linear_computes_what_autograd_computes_for_every_layout(split):
    """``F.linear``'s forward and autograd's backward fold the input to 2-D (``addmm``/``mm`` on a reshaped copy)
    when the weight requires grad; a detached weight lets ``matmul`` take its batched path for a non-contiguous
    input, and ``dy.matmul(w)`` does for a non-contiguous gradient (a head split's): other roundings, which some
    CPUs show (AMD EPYC: 1.9e-9 in the GQA input gradient). Every layout the layers meet, bit for bit."""
    from moefold.execution.split_backward import SplitLinearGemm

    gen = torch.Generator().manual_seed(5)
    K, N = 40, 24
    layouts = {"contiguous": lambda: torch.randn(8, 2, K, generator=gen),
               "sliced": lambda: torch.randn(2, 8, 96, generator=gen).transpose(0, 1)[..., :K],
               "transposed": lambda: torch.randn(8, K, 2, generator=gen).transpose(1, 2),
               "2-D": lambda: torch.randn(16, K, generator=gen),
               "2-D column-major": lambda: torch.randn(K, 16, generator=gen).t()}
    store = WeightGradStore()
    gemm = SplitLinearGemm(store)
    for (name, make), bias, dy_strided in itertools.product(layouts.items(), (True, False), (False, True)):
        x = make()
        w = torch.randn(N, K, generator=gen)
        b = torch.randn(N, generator=gen) if bias else None
        plain = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
        ours = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
        y_plain = F.linear(*plain)
        with store.splitting(split):
            y = gemm(*ours)
        shape = tuple(y_plain.shape)
        dy = torch.randn(*shape[:-1], 2 * N, generator=gen)[..., ::2] if dy_strided else torch.randn(shape)
        y_plain.backward(dy)
        y.backward(dy)
        case = f"{name}, bias={bias}, strided dy={dy_strided}"
        assert torch.equal(y, y_plain), f"forward: {case}"
        for what, a, e in zip(("x", "w", "b"), ours, plain):
            assert e is None or torch.equal(a.grad, e.grad), f"d{what}: {case}"
