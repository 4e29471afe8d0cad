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
