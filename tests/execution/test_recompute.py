"""Activation recomputation: every Megatron module choice, and full recompute in uniform and block groups,
gives the loss and every parameter gradient of no recompute, at world 1 (DeepSeek-V3 tiny: MLA, a dense and an
MoE layer with shared experts, MTP; Qwen3-MoE tiny: GQA with qk-norm) and at tp2 with sequence parallelism
(collectives inside recomputed regions). Each choice also keeps fewer activation bytes at the end of the
forward (``training.observe.memory.TensorMemoryTracker``), so a recompute that silently does nothing fails."""

from __future__ import annotations

import pytest
import torch

from moefold.dense.recompute import RECOMPUTE_MODULES, recomputed_modules
from moefold.execution import build_decoder
from moefold.execution.recompute import full_recompute_groups
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import gather_full, shards_of
from moefold.training.observe.memory import TensorMemoryTracker
from tests.distributed import run_distributed

SETTINGS = {**{m: ModelOptions(recompute="selective", recompute_modules=(m,)) for m in RECOMPUTE_MODULES},
            "all modules": ModelOptions(recompute="selective", recompute_modules=RECOMPUTE_MODULES),
            "full uniform 1": ModelOptions(recompute="full"),
            "full uniform 2": ModelOptions(recompute="full", recompute_num_layers=2),
            "full block 1": ModelOptions(recompute="full", recompute_method="block")}
NOT_IN = {"qwen3_moe_tiny": {"mlp", "shared_experts", "mla_up_proj"}}   # modules the recipe does not have


def _run(recipe: str, options: ModelOptions, dims: ParallelDims | None = None, seq: int = 32):
    """(loss, {name: full gradient}, activation bytes alive after the forward) of one forward/backward."""
    dims = dims or ParallelDims.single()
    config = get_recipe(recipe).with_(num_layers=2, vocab_size=256, mtp_num_layers=1)
    if options.sequence_parallel != (dims.tp > 1):
        options = ModelOptions(**{**options.__dict__, "sequence_parallel": dims.tp > 1})
    model = build_decoder(config, dims, options)
    model.init_weights(3)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 256, (2, seq), generator=g), torch.randint(0, 256, (2, seq), generator=g)
    with TensorMemoryTracker() as tracker:
        out = model(ids, labels)
        activations = tracker.current
        out.loss.backward()
    grads = {n: gather_full(p.grad, shards_of(p)) for n, p in model.named_parameters()}
    return out.loss.detach(), grads, activations


def _compare(got, ref, what: str) -> None:
    assert torch.equal(got[0], ref[0]), (what, got[0], ref[0])   # the forward is the same computation
    assert got[1].keys() == ref[1].keys()
    for name, g in ref[1].items():
        # exact but for layernorm, whose recompute sums a norm input's gradient contributions in another
        # order (rounding): bounded relative to the parameter's largest gradient element
        err, scale = (got[1][name] - g).abs().max().item(), g.abs().max().item()
        assert err <= 1e-5 * scale, f"{what} {name}: max |diff| {err:.3g} vs gradient scale {scale:.3g}"


@pytest.mark.parametrize("recipe", ["deepseek_v3_tiny", "qwen3_moe_tiny"])
def test_each_recompute_choice_equals_no_recompute(recipe):
    ref = _run(recipe, ModelOptions())
    for what, options in SETTINGS.items():
        got = _run(recipe, options)
        _compare(got, ref, f"{recipe} {what}")
        if what not in NOT_IN.get(recipe, ()):
            assert got[2] < ref[2], f"{recipe} {what}: {got[2]} activation bytes kept, no recompute {ref[2]}"


def _tp2(_: None) -> dict:
    dims = ParallelDims.build(ParallelConfig(tp=2))
    ref = _run("deepseek_v3_tiny", ModelOptions(), dims)
    out = {}
    for what, options in SETTINGS.items():
        got = _run("deepseek_v3_tiny", options, dims)
        _compare(got, ref, f"tp2 sp {what}")
        out[what] = got[2] < ref[2]
    return out


def test_recompute_with_tensor_and_sequence_parallelism():
    results = run_distributed(_tp2, 2, None, timeout=300)
    assert all(all(r.values()) for r in results), results


def test_full_recompute_groups_and_option_checks():
    ids = [4, 5, 6, 7, 8]
    assert full_recompute_groups(ids, ModelOptions()) == [(ids, False)]
    assert full_recompute_groups(ids, ModelOptions(recompute="full", recompute_num_layers=2)) == [
        ([4, 5], True), ([6, 7], True), ([8], True)]
    assert full_recompute_groups(ids, ModelOptions(recompute="full", recompute_method="block",
                                                   recompute_num_layers=2)) == [([4], True), ([5], True),
                                                                                ([6, 7, 8], False)]
    assert recomputed_modules("selective", ["moe", "moe_act", "shared_experts", "layernorm"]) == {"moe", "layernorm"}
    assert recomputed_modules("full", ["core_attn"]) == frozenset()
    with pytest.raises(ValueError, match="'attn' not among core_attn"):
        ModelOptions(recompute="selective", recompute_modules=("attn",))
    with pytest.raises(ValueError, match="--recompute-num-layers=0 must be a positive integer"):
        ModelOptions(recompute="full", recompute_num_layers=0)
    with pytest.raises(ValueError, match="--recompute-method='blocks'"):
        ModelOptions(recompute="full", recompute_method="blocks")
