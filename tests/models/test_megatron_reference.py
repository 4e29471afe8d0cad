"""Megatron-Core 0.16.1's own GPTModel (tests.models.megatron_tiny) as a reference: on the bf16 accuracy tests'
weights its fp32 logits equal HF's and moefold's (so the mapping is right), and moefold's bf16 error is no larger
than Megatron-Core's (the issue that started the bf16 work: Megatron-Core's bf16 logits erred half as much).

Skipped where ``megatron.core`` is not installed (it is in the ``test`` extra).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.models.bf16_reference import Error, comparable_config, compare, moefold_run, reference_weights, token_samples
from tests.models.hf_tiny import HF_TINY_RECIPES
from tests.models.megatron_tiny import megatron_runs, megatron_supports

pytest.importorskip("megatron.core")

RECIPES = [r for r in HF_TINY_RECIPES if megatron_supports(comparable_config(r)) is None]
SEEDS = range(3)
BATCH, SEQ = 4, 64


@functools.cache
def _all_runs() -> dict[str, list[tuple]]:
    """{recipe: per seed (moefold fp32, moefold bf16, Megatron fp32, Megatron bf16)}; Megatron's in one forked rank."""
    draws = {r: [(*reference_weights(r, seed), seed) for seed in SEEDS] for r in RECIPES}
    jobs = [(c, st, dtype, token_samples(c, seed, BATCH, SEQ)) for r in RECIPES for c, st, seed in draws[r]
            for dtype in (torch.float32, torch.bfloat16)]
    mg = iter(megatron_runs(jobs))
    out = {}
    for r in RECIPES:
        out[r] = []
        for c, st, seed in draws[r]:
            samples = token_samples(c, seed, BATCH, SEQ)
            out[r].append((moefold_run(c, st, torch.float32, samples), moefold_run(c, st, torch.bfloat16, samples),
                           next(mg), next(mg)))
    return out


def test_megatron_maps_the_recipes_it_can():
    assert RECIPES == ["qwen3_moe_tiny", "mixtral_tiny"]
    assert "MLA" in megatron_supports(comparable_config("deepseek_v3_tiny"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_megatron_fp32_is_the_same_model(recipe):
    for ours, _, mg, _ in _all_runs()[recipe]:
        assert (ours.logits - mg.logits).abs().max() < 1e-4
        assert abs(ours.loss - mg.loss) < 1e-5


@pytest.mark.parametrize("recipe", RECIPES)
def test_bf16_logit_error_no_larger_than_megatron(recipe):
    runs = _all_runs()[recipe]
    ours = Error.mean(compare(lo, ref) for ref, lo, _, _ in runs)
    mg = Error.mean(compare(lo, ref) for _, _, ref, lo in runs)
    print(f"{recipe}: mean |logit error| moefold {ours.logits_mean:.3e}, Megatron-Core {mg.logits_mean:.3e} "
          f"({ours.logits_mean / mg.logits_mean:.2f}x); routed as in fp32 {ours.routing:.4f} vs {mg.routing:.4f}")
    assert ours.logits_mean <= 1.1 * mg.logits_mean, (ours, mg)
