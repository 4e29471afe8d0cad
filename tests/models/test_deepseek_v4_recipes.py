"""DeepSeek-V4's recipes: the published DeepSeek-V4-Flash config.json reads as ``deepseek_v4`` and counts the
parameters transformers' class holds; the tiny recipe trains from the CLI.

``FLASH_BASE`` is ``deepseek-ai/DeepSeek-V4-Flash-Base``'s ``config.json`` transcribed (nothing downloaded; tokenizer
ids kept, as published): the legacy spellings ``compress_ratios`` (one more entry than layers: the MTP layer's),
``num_hash_layers``, ``qk_rope_head_dim`` and a top-level ``rope_scaling`` that transformers folds in.
"""

from __future__ import annotations

import json

import pytest
import torch

from moefold.models.hf.config_map import from_hf_config, to_hf_config
from moefold.models.params import count_parameters
from moefold.models.recipes import get_recipe

FLASH_BASE = {
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512,
    "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
    "initializer_range": 0.02, "max_position_embeddings": 1048576, "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024,
    "q_lora_rank": 1024, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
    "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000, "topk_method": "noaux_tc",
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_published_config_reads_as_the_recipe_and_counts_what_transformers_holds(tmp_path, capsys):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from moefold.training.cli import main as cli

    assert from_hf_config(FLASH_BASE, name="deepseek_v4").with_(extra={}) == get_recipe("deepseek_v4")
    with torch.device("meta"):
        hf = DeepseekV4ForCausalLM(DeepseekV4Config(**{k: v for k, v in FLASH_BASE.items()
                                                       if k not in ("architectures", "model_type")}))
    want = sum(p.numel() for p in hf.parameters())   # moefold counts parameters (not the hash tables, biases)
    assert count_parameters(get_recipe("deepseek_v4")).total == want == 284_332_230_231   # "284B total"
    (tmp_path / "flash").mkdir()
    (tmp_path / "flash" / "config.json").write_text(json.dumps(FLASH_BASE))
    assert cli(["inspect", "--hf", str(tmp_path / "flash"), "--no-layers"]) == 0
    out = capsys.readouterr().out
    assert f"total {want / 1e9:.3f}B" in out, (want, out)


@pytest.mark.parametrize("name", ["deepseek_v4", "deepseek_v4_proxy", "deepseek_v4_tiny"])
def test_recipes_round_trip_through_the_hf_config(name):
    recipe = get_recipe(name)
    assert from_hf_config(to_hf_config(recipe), name=name).with_(extra={}) == recipe


def test_every_config_field_is_read_fixed_or_inert():
    """Each field of ``DeepseekV4Config().to_dict()`` is in exactly one of ``READ`` / ``FIXED`` / ``INERT``; another
    value of a read field changes the ``ModelConfig``, of a fixed one is refused naming it, of an inert one changes
    nothing."""
    from transformers import DeepseekV4Config

    from moefold.models.hf import deepseek_v4 as v4

    base = {**DeepseekV4Config(num_hidden_layers=4).to_dict(), "architectures": [v4.ARCHITECTURE]}
    groups = [set(v4.READ), set(v4.FIXED), set(v4.INERT)]
    for key in base:
        assert sum(key in g for g in groups) == 1, key
    ref = v4.config_from_hf(base)
    other = {"layer_types": ["sliding_attention"] * 4, "mlp_layer_types": ["moe"] * 4, "scoring_func": "sigmoid",
             "compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 64},
             "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 5.0, "partial_rotary_factor": 0.25},
                                 "compress": {"rope_type": "default", "rope_theta": 7.0,
                                              "partial_rotary_factor": 0.25}},
             "partial_rotary_factor": 0.25, "qk_rope_head_dim": 128, "num_nextn_predict_layers": 0}
    for key in v4.READ:
        if key == "num_nextn_predict_layers":   # read and dropped: the HF class builds no MTP
            continue
        value = other[key] if key in other else base[key] * 2
        changed = {**base, key: value}
        if key == "num_hidden_layers":
            changed.update(layer_types=base["layer_types"] * 2, mlp_layer_types=base["mlp_layer_types"] + ["moe"] * 4)
        if key in ("partial_rotary_factor", "qk_rope_head_dim", "rope_theta", "compress_rope_theta"):
            changed.pop("rope_parameters")   # transformers reads these where rope_parameters is not nested yet
        if key == "qk_rope_head_dim":    # DeepSeek's spelling, read where partial_rotary_factor is absent
            changed.pop("partial_rotary_factor")
        assert v4.config_from_hf(changed) != ref, key
    for key, value in v4.FIXED.items():
        bad = (not value) if isinstance(value, bool) else {1: 2, 0.0: 0.5, "silu": "gelu"}[value]
        with pytest.raises(ValueError, match=key):
            v4.config_from_hf({**base, key: bad})
    inert_other = {"id2label": {0: "a"}, "label2id": {"a": 0}, "problem_type": "regression", "dtype": "float16",
                   "torch_dtype": "float16", "model_type": "deepseek_v4", "architectures": [v4.ARCHITECTURE]}
    for key in v4.INERT:
        if key in base:
            v = base[key]
            value = (inert_other[key] if key in inert_other else (not v) if isinstance(v, bool) else
                     "x" if isinstance(v, str) else v * 2 if v else 7)
            assert v4.config_from_hf({**base, key: value}) == ref, key


def test_flops_count_every_weight_once_and_the_entries_each_query_reads():
    """At one token each layer's count is its attention's and mHC maps' weights (each read once) plus one key of
    core attention and the mHC collapse / mix; the core attention grows with the window and the entries read."""
    from torch import nn

    from moefold.models.decoder import MoEDecoder
    from moefold.training.observe.flops_v4 import v4_attention_macs, v4_score_macs

    c = get_recipe("deepseek_v4_tiny")
    model = MoEDecoder(c, device="meta")
    N, H = c.v4.hc_mult, c.hidden_size
    for i in range(c.num_layers):
        block = model.layers[str(i)]
        weights = sum(m.weight.numel() for m in block.self_attn.modules() if isinstance(m, nn.Linear))
        weights += block.attn_hc.fn.numel() + block.ffn_hc.fn.numel()
        mixing = 2 * (2 * N * H + N * N * H)
        assert v4_attention_macs(c, 1, i) == weights + c.num_attention_heads * 2 * c.head_dim + mixing, i
    S, W = 256, c.v4.sliding_window
    sliding, hca = v4_score_macs(c, S, 1), v4_score_macs(c, S, 0)   # tiny: layer 1 sliding, layer 0 heavily c.
    per_key = c.num_attention_heads * 2 * c.head_dim
    assert sliding == per_key * (W * (W + 1) / 2 + (S - W) * W) / S
    assert hca == sliding + per_key * sum((p + 1) // c.v4.hca_rate for p in range(S)) / S


def test_the_overlap_pieces_refuse_mhc_blocks():
    from moefold.models.decoder import MoEDecoder
    from moefold.models.sublayers import check_overlap

    model = MoEDecoder(get_recipe("deepseek_v4_tiny"), device="meta")
    with pytest.raises(ValueError, match="block 0 has mHC streams"):
        check_overlap(model.layers["0"], 0)
