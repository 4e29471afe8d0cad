"""Meta-device parameter counts of the published recipes equal the published totals and active counts.

Convention (models.params): active counts the embedding AND the head in full. Published figures are
rounded to the digits they print, and two of them are truncated rather than rounded (DeepSeek-V3
"37B" for 37.55B, Qwen3-30B-A3B "3.3B" for 3.353B): no single counting convention is within 1% of
all five active figures (embedding and head counted once fits DeepSeek-V3 at -1.0% but Qwen3-30B at
-7.8%). So a count passes when it is within 1% of the figure OR the figure is the count truncated or
rounded to the printed digits; totals likewise.

OpenAI (gpt-oss: "5.1B active" = 5.13B, its model card's table counting the unembedding but not the
embedding), Zhipu (GLM-4.5 "32B", GLM-4.5-Air "12B") and MiniMax (M2 "10B") count the active parameters
without the input embedding table; for them the test compares ``active_without_embedding`` (with the
embedding counted too they would be 5.71B, 33.6B, 13.4B and 11.0B). Kimi-K2 ("1T" total, "32B" active)
and OLMoE ("6.9B", "1.3B") count both, as DeepSeek does. GLM's totals exclude its MTP layer.
Qwen3-Next-80B-A3B: 79.67B total, 3.88B active (3.25B without the embedding and head: "A3B" truncates
either).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from moefold.models.params import count_parameters, format_report
from moefold.models.recipes import RECIPES, get_recipe

PUBLISHED = {  # recipe: (total, active) in billions (a "T" suffix: trillions), as printed by the model authors
    "deepseek_v3": ("671", "37"),
    "qwen3_moe_30b_a3b": ("30.5", "3.3"),
    "qwen3_moe_235b_a22b": ("235", "22"),
    "mixtral_8x7b": ("46.7", "12.9"),
    "mixtral_8x22b": ("141", "39"),
    "gpt_oss_120b": ("116.8", "5.1"),
    "gpt_oss_20b": ("20.9", "3.6"),
    "glm4_5": ("355", "32"),
    "glm4_5_air": ("106", "12"),
    "glm4_6": ("355", "32"),
    "kimi_k2": ("1T", "32"),
    "olmoe_1b_7b": ("6.9", "1.3"),
    "minimax_m2": ("230", "10"),
    "qwen3_next_80b_a3b": ("80", "3"),
    "qwen3_5_35b_a3b": ("35", "3"),   # the text model: 34.66B (exactly HF Qwen3_5MoeForCausalLM's, test_hf_interop)
    "glm5": ("744", "40"),
}
# publishers whose active count leaves the input embedding out (see the module docstring)
ACTIVE_WITHOUT_EMBEDDING = {"gpt_oss_120b", "gpt_oss_20b", "glm4_5", "glm4_5_air", "glm4_6", "minimax_m2", "glm5"}


def _matches(count: int, printed: str) -> bool:
    unit = 1e12 if printed.endswith("T") else 1e9
    printed = printed.removesuffix("T")
    value = float(printed)
    digits = len(printed.split(".")[1]) if "." in printed else 0
    truncated = math.floor(count / unit * 10 ** digits) / 10 ** digits
    return abs(count / unit / value - 1) <= 0.01 or truncated == value or round(count / unit, digits) == value


@functools.cache
def _count(name: str):
    return count_parameters(get_recipe(name))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_counts(name):
    report = _count(name)
    total, active = PUBLISHED[name]
    assert _matches(report.total, total), (name, report.total)
    counted = report.active_without_embedding if name in ACTIVE_WITHOUT_EMBEDDING else report.active
    assert _matches(counted, active), (name, counted)


def test_convention_details():
    ds = _count("deepseek_v3")
    assert len(ds.layers) == 61 and [layer.kind for layer in ds.layers[:4]] == ["dense"] * 3 + ["moe"]
    # 671B main model + MTP; DeepSeek's "685B" also stores the MTP layer's own embedding and head copies
    assert 684e9 < ds.total + ds.mtp_total + ds.embedding + ds.head < 686e9
    assert ds.embedding == ds.head == 129280 * 7168
    # routed experts count topk / E in active; everything else fully
    moe = ds.layers[3]
    assert moe.total - moe.active == moe.counts["routed_experts"] * (256 - 8) // 256
    text = format_report(ds)
    assert "3-60" in text and "x58" in text and "MTP modules" in text


def test_qwen3_next_layers():
    qn = _count("qwen3_next_80b_a3b")
    # 12 x (3 Gated DeltaNet layers, 1 gated attention layer), each with the MoE block
    assert [layer.mixer for layer in qn.layers] == (["linear_attention"] * 3 + ["full_attention"]) * 12
    assert all(layer.kind == "moe" for layer in qn.layers)
    linear, full = qn.layers[0], qn.layers[3]
    # Gated DeltaNet: in_proj_qkvz [16*(2*128+2*2*128), 2048], in_proj_ba [64, 2048], conv [16, 512, 4], out_proj,
    # A_log, dt_bias [32], norm [128]; gated attention: q_proj twice the heads' width (the gate), k/v, o, q/k norms
    assert linear.counts["attention"] == 2048 * 12288 + 2048 * 64 + 16 * 512 * 4 + 4096 * 2048 + 32 + 32 + 128
    assert full.counts["attention"] == 2048 * 8192 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 256
    assert linear.counts["shared_experts"] == 3 * 2048 * 512 + 2048     # and its sigmoid gate
    assert "mixer" in format_report(qn) and "linear_attention" in format_report(qn)


def test_every_recipe_builds_on_meta():
    for name in RECIPES:
        report = _count(name)
        assert report.active < report.total or name.endswith("tiny")
    assert not torch.empty(0).is_meta  # nothing leaked the meta default device


def test_family_counts():
    """Exact counts of issue 33's published recipes (what the recipe table of docs/models.md prints)."""
    oss = _count("gpt_oss_120b")
    # OpenAI's model card: 116.83B total, 5.13B active; attention 0.96B, MLP (experts + router) 114.71B
    assert round(oss.total / 1e9, 2) == 116.83 and round(oss.active_without_embedding / 1e9, 2) == 5.13
    assert round(sum(layer.counts["attention"] for layer in oss.layers) / 1e9, 2) == 0.96
    mlp = sum(layer.counts["routed_experts"] + layer.counts["router"] for layer in oss.layers)
    assert round(mlp / 1e9, 2) == 114.71
    glm = _count("glm4_5")
    assert [layer.kind for layer in glm.layers[:4]] == ["dense"] * 3 + ["moe"] and len(glm.mtp) == 1
    kimi = _count("kimi_k2")
    assert kimi.layers[1].counts["routed_experts"] == 384 * 3 * 7168 * 2048


def test_flops_follow_each_layers_window():
    """GPT-OSS: the model FLOPs count 128 keys per query on its 18 windowed layers and the causal average on the
    18 full ones (training.flops, what MFU and the planner use)."""
    from moefold.models.recipes import gpt_oss_120b
    from moefold.training.observe.flops import forward_flops_per_token

    c, S = gpt_oss_120b(), 4096
    all_windowed = c.with_(sliding_window_pattern=None)
    extra = 18 * 2 * c.num_attention_heads * 2 * c.attention_head_dim * ((S + 1) / 2 - 128)
    assert forward_flops_per_token(c, S) - forward_flops_per_token(all_windowed, S) == pytest.approx(extra)


def test_deepseek_v32_counts_its_indexers_exactly():
    """DeepSeek-V3.2 = DeepSeek-V3 (less its MTP layer, which transformers does not read) + one lightning indexer
    per layer: wq_b [64*128, 1536], wk [128, 7168], k_norm weight and bias [128], weights_proj [64, 7168]."""
    v3, v32 = _count("deepseek_v3"), _count("deepseek_v32")
    indexer = 64 * 128 * 1536 + 128 * 7168 + 2 * 128 + 64 * 7168
    assert indexer == 13_959_424
    assert v32.total == v3.total + 61 * indexer and v32.active == v3.active + 61 * indexer
    assert v32.mtp_total == 0 and round(v32.total / 1e9, 2) == 671.88


def test_deepseek_v32_flops_bound_the_attended_keys():
    """Past index_topk (2048) keys a query's attention cost stops growing; only the indexer's n x (d + 1) per key
    does (training.flops: MFU and the planner's count). At 128K tokens DeepSeek-V3.2's layer is far cheaper."""
    from moefold.models.recipes import deepseek_v3, deepseek_v32
    from moefold.training.observe.flops import attention_macs, dsa_macs

    c = deepseek_v32()
    attend = c.num_attention_heads * (2 * 512 + 64)
    indexer = 1536 * 64 * 128 + 7168 * 128 + 7168 * 64 + 64 * 129 * (2048 + 1) / 2
    assert dsa_macs(c, 2048) == pytest.approx(attend * 2049 / 2 + indexer + 64 * 129 * 2049 / 2)
    S = 131072
    grown = dsa_macs(c, 2 * S) - dsa_macs(c, S)
    assert grown == pytest.approx(64 * 129 * S / 2, rel=0.02)   # the indexer; attention ~ constant at 2048 keys
    assert attention_macs(c, S) < 0.5 * attention_macs(deepseek_v3(), S)
