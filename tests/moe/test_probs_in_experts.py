"""The routing probs applied inside the experts (Megatron-Core 0.16.1's order) give the MoE formula's values and
gradients, and the combine keeps nothing of the rows for them.

The layer's output and the gradients of its routing probs, tokens and expert weights against the formula
``y[t] = sum_k p[t, k] * FFN_{g_tk}(x_t)`` computed one token at a time by autograd in fp32 (the old order: the
probs weighting each expert's output), for every dispatcher: local, alltoall and allgather at world 1, alltoall and
allgather at ep2 x etp2 and ep4 (each rank's tokens through the gathered full weights), flex on DeepEP V2's and the
legacy DeepEP's CPU stand-ins at ep4 (bf16, as DeepEP moves bf16: against the formula in fp32 on the same bf16
inputs, at bf16's tolerance). Also with capacity (dropped and padded rows) and GPT-OSS's clamped SwiGLU with expert
biases (the w2 bias weighted with its row, Megatron's ``_apply_bias``).

Memory: of the routed rows ``[N, H]``, autograd saves one copy for the layer's backward (``saved_tensors_hooks``,
storages counted once): the experts' input. Weighting in the combine kept the experts' output rows as well.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from moefold.dispatch.config import DispatchConfig, DispatcherKind, FlexOptions
from moefold.dispatch.flex_backend import FlexBackend, destroy_deepep_buffers
from moefold.moe.activation import GatedActivation, Weighted, relu2, swiglu, weighted_product
from moefold.moe.build import build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.moe.swiglu import swiglu_rows
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import gather_full, init_parameters, shards_of
from tests.distributed import run_distributed
from tests.tolerance import bound

E, K, H, FFN, S, B = 8, 2, 16, 8, 4, 4
GPT_OSS = GatedActivation(alpha=1.702, clamp=7.0, linear_offset=1.0)


class _Capture:
    """A router region that runs the router and keeps its routing, its probs retaining their gradient."""

    def __init__(self) -> None:
        self.routing = None

    def __call__(self, fn, *args, **kwargs):
        out = fn(*args, **kwargs)
        out.routing.probs_TK.retain_grad()
        self.routing = out.routing
        return out


def _config(dispatcher: DispatcherKind, *, capacity: str | None = None, gpt_oss: bool = False,
            flex: FlexBackend | None = None) -> MoEConfig:
    extra = {}
    if capacity is not None:
        extra = {"expert_capacity_factor": 0.5, "pad_expert_input_to_capacity": capacity == "padded"}
    router = RouterConfig(num_experts=E, topk=K, init_std=0.3, load_balancing_type="none", **extra)
    experts = ExpertsConfig(FFN, init_std=0.4, **({"bias": True, "glu": GPT_OSS} if gpt_oss else {}))
    options = FlexOptions(flex, max_tokens_per_rank=S * B) if flex is not None else FlexOptions()
    return MoEConfig(num_experts=E, router=router, experts=experts, dispatch=DispatchConfig(dispatcher, options))


def _ffn(x_H, w13, w2, b13, b2, g: int, glu) -> torch.Tensor:
    h = w13[g].reshape(-1, H) @ x_H
    if b13 is not None:
        h = h + b13[g].reshape(-1)
    out = w2[g] @ glu(h.unsqueeze(0)).squeeze(0)
    return out + b2[g] if b2 is not None else out


def _formula(x_TH, probs_TK, ids_TK, keep_TK, w13, w2, b13, b2, glu) -> torch.Tensor:
    """The old order, token by token: sum_k p[t, k] * FFN_{ids[t, k]}(x_t) over the kept copies."""
    rows = []
    for t in range(x_TH.shape[0]):
        acc = x_TH.new_zeros(H)
        for k in range(ids_TK.shape[1]):
            if keep_TK is None or keep_TK[t, k]:
                acc = acc + probs_TK[t, k] * _ffn(x_TH[t], w13, w2, b13, b2, int(ids_TK[t, k]), glu)
        rows.append(acc)
    return torch.stack(rows)


def _reference(routing, x_SBH, g_SBH, full, glu, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The formula in ``dtype`` on the layer's routing and weights: y and the gradients of the probs and weights."""
    x = x_SBH.reshape(-1, H).to(dtype)
    p = routing.probs_TK.detach().to(dtype).clone().requires_grad_()
    w = {k: v.detach().to(dtype).clone().requires_grad_() if v is not None else None for k, v in full.items()}
    y = _formula(x, p, routing.expert_ids_TK, routing.keep_TK, w["w13"], w["w2"], w["b13"], w["b2"], glu)
    (y * g_SBH.reshape(-1, H).to(dtype)).sum().backward()
    return {"y": y.detach(), "grad probs": p.grad, "grad w13": w["w13"].grad, "grad w2": w["w2"].grad}


def _check(layer: MoELayer, x_SBH: torch.Tensor, g_SBH: torch.Tensor, full: dict[str, torch.Tensor],
           world1: bool) -> list[str]:
    """Run the layer (x, its gradient g), then the formula on the same routing and full weights, in fp32 and float64:
    the failures of y, the probs' and (world 1) the weights' gradients. fp32 layers within ``tests.tolerance.bound``
    of the fp32 formula, bf16 ones (flex) within 3% of the largest element (bf16's, as
    tests/moe/test_moe_layer_flex.py)."""
    capture = _Capture()
    layer.configure(router=capture)
    x = x_SBH.clone().requires_grad_()
    y, _ = layer(x)
    routing = capture.routing
    grads = dict(zip(("grad w13", "grad w2"), torch.autograd.grad(y, (layer.experts.w13, layer.experts.w2), g_SBH,
                                                        retain_graph=True)))
    y.backward(g_SBH)
    glu = layer.experts._eager_activation.act
    ref32 = _reference(routing, x_SBH, g_SBH, full, glu, torch.float32)
    ref64 = _reference(routing, x_SBH, g_SBH, full, glu, torch.float64)
    got = {"y": y.detach().reshape(-1, H), "grad probs": routing.probs_TK.grad, **grads}
    names = ["y", "grad probs"] + (["grad w13", "grad w2"] if world1 else [])   # the weights' are partial at ep
    failures = []
    for name in names:
        g, want = got[name], ref32[name]
        if g is None:
            failures.append(f"{name}: no gradient")
            continue
        limit = (bound(want, ref64[name]) if x_SBH.dtype == torch.float32
                 else 3e-2 * max(1.0, want.abs().max().item()))
        err = (g.float() - want).abs().max().item()
        if err > limit:
            failures.append(f"{name}: max error {err:.3g} > {limit:.3g}")
    return failures


def _full_weights(layer: MoELayer, world1: bool) -> dict[str, torch.Tensor]:
    ex = layer.experts
    full = {"w13": ex.w13, "w2": ex.w2, "b13": ex.w13_bias, "b2": ex.w2_bias}
    if not world1:
        full = {k: gather_full(v, shards_of(v)) if v is not None else None for k, v in full.items()}
    return full


def _inputs(rank: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(S, B, H, generator=gen).to(dtype), torch.randn(S, B, H, generator=gen).to(dtype)


@pytest.mark.parametrize("dispatcher", [DispatcherKind.LOCAL, DispatcherKind.ALLTOALL, DispatcherKind.ALLGATHER])
@pytest.mark.parametrize("variant", ["dropless", "capacity", "padded", "gpt_oss"])
def test_world1_layer_equals_the_weighted_formula(dispatcher, variant):
    cfg = _config(dispatcher, capacity=variant if variant in ("capacity", "padded") else None,
                  gpt_oss=variant == "gpt_oss")
    layer = build_moe_layer(cfg, H, ParallelDims.single(), sequence_parallel=False)
    init_parameters(layer, seed=5)
    if layer.experts.w13_bias is not None:   # zero-initialised: give the biases values
        with torch.no_grad():
            layer.experts.w13_bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
            layer.experts.w2_bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    x, g = _inputs()
    failures = _check(layer, x, g, _full_weights(layer, True), world1=True)
    assert not failures, failures


def _world() -> list[str]:
    from tests.dispatch import deepep_elastic_standin, deepep_standin

    failures = []
    layouts = [(DispatcherKind.ALLTOALL, 2, 2, None), (DispatcherKind.ALLTOALL, 4, 1, None),
               (DispatcherKind.ALLGATHER, 2, 2, None), (DispatcherKind.ALLGATHER, 4, 1, None),
               (DispatcherKind.FLEX, 4, 1, FlexBackend.DEEPEP), (DispatcherKind.FLEX, 4, 1, FlexBackend.DEEPEP_LEGACY)]
    for kind, ep, etp, flex in layouts:
        dims = ParallelDims.build(ParallelConfig(ep=ep, etp=etp))
        dtype = torch.float32 if flex is None else torch.bfloat16
        if flex is not None:
            sys.modules["deep_ep"] = (deepep_elastic_standin if flex is FlexBackend.DEEPEP else deepep_standin).module()
        try:
            layer = build_moe_layer(_config(kind, flex=flex), H, dims, sequence_parallel=False, dtype=dtype)
            init_parameters(layer, seed=5)
            x, g = _inputs(dims.rank, dtype)
            failures += [f"{kind} ep{ep} etp{etp} {flex or ''} rank {dims.rank}: {f}"
                         for f in _check(layer, x, g, _full_weights(layer, False), world1=False)]
            if flex is not None:
                destroy_deepep_buffers()
        finally:
            sys.modules.pop("deep_ep", None)
    return failures


def test_every_dispatcher_at_ep_and_etp_equals_the_weighted_formula():
    failures = [f for per_rank in run_distributed(_world, 4, timeout=300) for f in per_rank]
    assert not failures, "\n".join(failures)


def _saved_rows(layer: MoELayer, x: torch.Tensor, width: int) -> dict[int, tuple[int, ...]]:
    """The distinct storages autograd saves for the backward of ``layer(x)`` that hold ``[*, width]`` float rows
    (parameters excluded): {storage: shape}."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, tuple[int, ...]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if t.is_floating_point() and t.dim() == 2 and t.shape[1] == width and ptr not in params:
            seen[ptr] = tuple(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = layer(x.clone().requires_grad_())
    del y
    return seen


@pytest.mark.parametrize("dispatcher", [DispatcherKind.LOCAL, DispatcherKind.ALLTOALL, DispatcherKind.ALLGATHER])
def test_the_combine_keeps_no_rows(dispatcher):
    """Of the routed rows ``[N, H]``, the layer's graph keeps exactly one copy: the experts' input (w13's weight
    gradient needs it). Weighting in the combine kept a second, the experts' output rows, for the probs' gradient
    (``N * H`` elements per layer and micro-batch). The FFN size is chosen so that no other saved tensor is
    ``H`` wide besides the layer's own ``[T, H]`` input (the router's)."""
    ffn = 12   # gate/up [N, 24], w2 input [N, 12]: neither is H = 16 wide
    cfg = _config(dispatcher)
    cfg = MoEConfig(num_experts=E, router=cfg.router, experts=ExpertsConfig(ffn, init_std=0.4),
                    dispatch=cfg.dispatch)
    layer = build_moe_layer(cfg, H, ParallelDims.single(), sequence_parallel=False)
    init_parameters(layer, seed=5)
    T, N = S * B, S * B * K
    shapes = sorted(_saved_rows(layer, _inputs()[0], H).values())
    assert shapes.count((N, H)) == 1 and all(s[0] in (N, T) for s in shapes), shapes


ACTIVATIONS = {"swiglu_rows": (swiglu_rows, swiglu), "swiglu": (Weighted(swiglu), swiglu),
               "gpt_oss": (Weighted(GPT_OSS), GPT_OSS), "gelu": (Weighted(F.gelu), F.gelu),
               "relu2": (Weighted(relu2), relu2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_weighted_activation_is_the_product_formula_bit_for_bit(name, dtype):
    """``(act(h) * p).to(h.dtype)`` (Megatron-Core's ``activation_func_with_probs``, fp32 probs): the experts' weighted
    activations give autograd's values of that formula bit for bit, forward and both gradients, while saving only
    ``h`` and ``p`` (the activation recomputed in backward)."""
    fn, act = ACTIVATIONS[name]
    gen = torch.Generator().manual_seed(4)
    gated = act in (swiglu, GPT_OSS)
    h = (3 * torch.randn(37, 2 * FFN if gated else FFN, generator=gen)).to(dtype)
    p = torch.rand(37, generator=gen)
    g = torch.randn(37, FFN, generator=gen).to(dtype)
    hr, pr = h.clone().requires_grad_(), p.clone().requires_grad_()
    ref = weighted_product(act, hr, pr.unsqueeze(1))
    ref_grads = torch.autograd.grad(ref, (hr, pr), g)
    hw, pw = h.clone().requires_grad_(), p.clone().requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(hw, pw)
    grads = torch.autograd.grad(out, (hw, pw), g)
    assert out.dtype == dtype and torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert {t.untyped_storage().data_ptr() for t in saved} <= {hw.untyped_storage().data_ptr(),
                                                               pw.untyped_storage().data_ptr()}, \
        [tuple(t.shape) for t in saved]
    assert torch.equal(fn(h), act(h))   # without probs: the plain activation


@pytest.mark.parametrize("f", [512, 100])
@pytest.mark.parametrize("blocks", [True, False], ids=["cpu_blocks", "cuda_path"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_weighted_activation_blocks_are_the_product_formula_bit_for_bit(name, dtype, threads, blocks, f, monkeypatch):
    """The probs' fp32 products run in row blocks (``moe.prob_rows.CHUNK_ELEMENTS``) through explicit widenings
    instead of aten's type promotion: with many blocks, a ragged last one, rows that are not whole vector widths
    (f 100), and blocks large enough for aten to split each block over two and three threads, forward and both
    gradients stay autograd's of the product formula; so does the unblocked path a GPU runs."""
    import moefold.moe.prob_rows as prob_rows

    monkeypatch.setattr(prob_rows, "CHUNK_ELEMENTS", 1 << 15)   # 64-row blocks of 512: 301 rows -> 5, the last 45
    if not blocks:
        monkeypatch.setattr(prob_rows, "_in_blocks", lambda x: False)
    fn, act = ACTIVATIONS[name]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(5)
        h = (3 * torch.randn(301, 2 * f if act in (swiglu, GPT_OSS) else f, generator=gen)).to(dtype)
        p = torch.rand(301, generator=gen)
        g = torch.randn(301, f, generator=gen).to(dtype)
        assert_weighted_is_the_formula(fn, act, h, p, g)
    finally:
        torch.set_num_threads(previous)


def assert_weighted_is_the_formula(fn, act, h: torch.Tensor, p: torch.Tensor, g: torch.Tensor) -> None:
    """``fn(h, p)`` (a weighted activation of ``act``) equals autograd's ``weighted_product(act, h, p)`` bit for bit:
    the output, both gradients for the output gradient ``g``, and ``h``'s gradient where ``p``'s is not asked for."""
    hr, pr = h.clone().requires_grad_(), p.clone().requires_grad_()
    ref = weighted_product(act, hr, pr.unsqueeze(1))
    ref_grads = torch.autograd.grad(ref, (hr, pr), g)
    hw, pw = h.clone().requires_grad_(), p.clone().requires_grad_()
    out = fn(hw, pw)
    grads = torch.autograd.grad(out, (hw, pw), g)
    hx = h.clone().requires_grad_()   # the probs' gradient not asked for: skipped
    (grad_h,) = torch.autograd.grad(fn(hx, p), hx, g)
    assert out.dtype == h.dtype and torch.equal(out, ref), "output"
    assert torch.equal(grads[0], ref_grads[0]) and torch.equal(grad_h, ref_grads[0]), "d_h"
    assert torch.equal(grads[1], ref_grads[1]), "d_p"
