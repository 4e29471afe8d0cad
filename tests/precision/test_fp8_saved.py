"""What the FP8 GEMMs keep for backward: the weight gradient's input operand already quantised, bit for bit the
backward of the high-precision input.

Transformer Engine's ``Linear`` / ``GroupedLinear`` keep their input quantised (the column-wise copy the weight
gradient takes) unless ``save_original_input`` asks for the input itself. moefold's four FP8 autograd functions
(linear: ``Float8LinearGemm``, ``BlockScaledLinearGemm``; grouped experts: ``Float8GroupedGemm``,
``BlockScaledGroupedGemm``) do the same. ``save_original_input=True`` is the earlier behaviour (the bf16 input
kept and cast in backward); every recipe's output and gradients are equal to it to the last bit (the same cast of
the same tensor, made earlier), and the bytes autograd keeps (counted by ``saved_tensors_hooks``, the weight left
out: a parameter is kept anyway) drop from 2 an element (bf16) to 1 and the scales.
"""

from __future__ import annotations

import pytest
import torch

from moefold.execution.fp8_linear import Float8LinearGemm
from moefold.moe.block_gemm import BlockScaledGroupedGemm
from moefold.moe.fp8_gemm import Float8GroupedGemm
from moefold.precision.block_linear import BlockScaledLinearGemm
from moefold.precision.fp8 import FP8Config
from moefold.precision.fp8_cast import Float8Recipe

pytest.importorskip("torchao")

CONFIGS = {"tensorwise": FP8Config("hybrid", "tensorwise"), "rowwise": FP8Config("e4m3", "rowwise"),
           "blockwise": FP8Config("e4m3", "blockwise"), "mxfp8": FP8Config("e4m3", "mxfp8"),
           "nvfp4": FP8Config(fp4="e2m1")}
BLOCK = ("blockwise", "mxfp8", "nvfp4")
M, K, N, E = 256, 128, 128, 4


def _linear_gemm(recipe: str):
    config = CONFIGS[recipe]
    return BlockScaledLinearGemm(config) if recipe in BLOCK else Float8LinearGemm(Float8Recipe.from_config(config))


def _grouped_gemm(recipe: str):
    config = CONFIGS[recipe]
    return BlockScaledGroupedGemm(config) if recipe in BLOCK else Float8GroupedGemm(config, grouped=False)


def _run(call, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """(output and both gradients, bytes autograd kept that are not the weight)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    kept = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() != w.data_ptr():
            kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = call(x, w)
    y.backward(gy)
    return [y.detach(), x.grad, w.grad], sum(kept)


def _check(make, args: tuple[torch.Tensor, ...], call) -> tuple[int, int]:
    results = {}
    for original in (True, False):
        gemm = make()
        gemm.save_original_input = original
        results[original] = _run(lambda x, w, g=gemm: call(g, x, w), *args)
    (want, bytes_original), (got, bytes_quantised) = results[True], results[False]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    return bytes_original, bytes_quantised


@pytest.mark.parametrize("recipe", list(CONFIGS))
def test_linear_keeps_its_input_quantised_and_backward_is_unchanged(recipe):
    torch.manual_seed(0)
    x, w, gy = torch.randn(M, K) * 3, torch.randn(N, K) * 0.1, torch.randn(M, N)
    args = tuple(t.to(torch.bfloat16) for t in (x, w, gy))
    original, quantised = _check(lambda: _linear_gemm(recipe), args, lambda g, x, w: g(x, w))
    assert original == M * K * 2
    # one byte an element (nvfp4's e2m1 codes unpacked), scales at most 1/16 more
    assert M * K <= quantised <= M * K * (1 + 1 / 16 * 4 + 1 / 16) + 64


@pytest.mark.parametrize("recipe", list(CONFIGS))
def test_grouped_experts_keep_their_input_quantised_and_backward_is_unchanged(recipe):
    torch.manual_seed(1)
    counts = torch.tensor([96, 0, 32, 128])
    x, w, gy = torch.randn(M, K) * 3, torch.randn(E, N, K) * 0.1, torch.randn(M, N)
    args = tuple(t.to(torch.bfloat16) for t in (x, w, gy))
    original, quantised = _check(lambda: _grouped_gemm(recipe), args,
                                 lambda g, x, w: g(x, w, counts, counts_host=counts.tolist()))
    counts_bytes = counts.numel() * counts.element_size()
    assert original == M * K * 2 + counts_bytes
    assert M * K + counts_bytes <= quantised <= M * K * (1 + 1 / 16 * 4 + 1 / 16) + 4 * (E + 1) * K + 64


def test_no_weight_gradient_keeps_no_input():
    torch.manual_seed(2)
    gemm = _linear_gemm("rowwise")
    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(N, K)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        gemm(x, w).sum().backward()
    assert all(t.data_ptr() == w.data_ptr() for t in kept)


def test_moe_act_recompute_keeps_no_fp8_copy_of_the_activation():
    """Under ``moe_act`` recompute the down GEMM keeps the activation itself, freed and refilled by the recompute
    (Megatron's ``set_save_original_input(linear_fc2)``), not an FP8 copy that would stay; values unchanged."""
    from types import SimpleNamespace

    from torch import nn

    from moefold.execution.recompute import apply_recompute
    from moefold.moe.build import build_experts
    from moefold.moe.config import ExpertsConfig
    from moefold.parallel.sharding import init_parameters

    counts = (40, 0, 24)
    results = {}
    for chosen in ((), ("moe_act",)):
        experts = build_experts(3, 32, ExpertsConfig(64, gemm_backend="grouped_mm", fp8=FP8Config("e4m3", "rowwise")))
        init_parameters(experts, seed=3)
        apply_recompute(experts, nn.ModuleDict(), SimpleNamespace(
            recompute="selective" if chosen else "none", recompute_modules=chosen, recompute_method="uniform",
            recompute_num_layers=1))
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(4)).requires_grad_()
        fp8 = []

        def pack(t: torch.Tensor, fp8=fp8) -> torch.Tensor:
            if t.dtype == torch.float8_e4m3fn:
                fp8.append(t.shape)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = experts(x, torch.tensor(counts), counts)
        y.square().sum().backward()
        results[chosen] = (fp8, [y.detach(), x.grad, experts.w13.grad, experts.w2.grad])
    (fp8_plain, plain), (fp8_act, act) = results[()], results[("moe_act",)]
    assert (64, 64) in fp8_plain and (64, 64) not in fp8_act   # the [N, f] activation's FP8 copy
    assert (64, 32) in fp8_act                                  # the input rows' copy stays
    for a, b in zip(plain, act):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layernorm", [False, True])
def test_linears_keep_the_original_input_where_it_is_kept_anyway(layernorm):
    """Attention output projections keep their input (the core attention's output, kept by the fused kernels);
    under ``layernorm`` recompute so do the norms' consumers (their input is freed and refilled); the rest keep
    the quantised copy (Megatron-Core's ``set_save_original_input`` choices)."""
    from moefold.execution.apply import build_decoder
    from moefold.models.options import ModelOptions
    from moefold.models.recipes import deepseek_v3_tiny

    modules = ("layernorm",) if layernorm else ()
    options = ModelOptions(fp8=FP8Config("hybrid"), recompute="selective" if layernorm else "none",
                           recompute_modules=modules or ("core_attn",))
    model = build_decoder(deepseek_v3_tiny().with_(num_layers=2), options=options)
    originals = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                 if getattr(getattr(m, "local_gemm", None), "save_original_input", False)}
    quantised = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                 if getattr(getattr(m, "local_gemm", None), "save_original_input", True) is False}
    # MLA's down projections and the dense MLP's gate/up take the norm output; the shared experts' gate/up too,
    # which the router keeps anyway
    names = {name: m for name, m in model.named_modules() if hasattr(m, "local_gemm")}
    shared = {n for n, m in names.items() if ".shared_experts." in n and m.local_gemm.save_original_input}
    assert shared == {n for n in names if ".shared_experts.gate_proj" in n or ".shared_experts.up_proj" in n}, shared
    norm_consumers = {"q_a_proj", "kv_a_proj_with_mqa", "gate_proj", "up_proj"}
    assert originals == ({"o_proj", "gate_proj", "up_proj"} | (norm_consumers if layernorm else set())), originals
    assert quantised == ({"down_proj", "q_b_proj", "kv_b_proj", "eh_proj"} | (set() if layernorm else norm_consumers)
                         ), quantised
