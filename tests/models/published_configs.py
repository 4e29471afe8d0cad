"""The published ``config.json`` files of issue 33's models, transcribed (architecture, rope and routing fields
as the model authors' Hugging Face repositories publish them; tokenizer ids and auto_map left out).

Nothing is downloaded: these dicts are what ``moefold inspect --hf`` / ``train --load-hf`` read from those
directories. GPT-OSS, Kimi-K2 and MiniMax-M2 publish quantized weights (``quantization_config``).
"""

from __future__ import annotations

_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_key_value_heads": 8, "output_router_logits": False,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}


def _gpt_oss(layers: int, experts: int) -> dict:
    types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return {**_GPT_OSS, "num_hidden_layers": layers, "num_local_experts": experts, "layer_types": types}


_GLM4_5 = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "moe_intermediate_size": 1536, "norm_topk_prob": True,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_hidden_layers": 92,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_qk_norm": True, "vocab_size": 151552,
}

# deepseek-ai/DeepSeek-V3.2-Exp: DeepSeek-V3's config.json with the indexer's three fields and its own class
_DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
    "vocab_size": 129280,
}

PUBLISHED_CONFIGS: dict[str, dict] = {
    "deepseek_v32": _DEEPSEEK_V32,
    "gpt_oss_120b": _gpt_oss(36, 128),                                   # openai/gpt-oss-120b
    "gpt_oss_20b": _gpt_oss(24, 32),                                     # openai/gpt-oss-20b
    "glm4_5": _GLM4_5,                                                   # zai-org/GLM-4.5
    "glm4_5_air": {**_GLM4_5, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                   "n_routed_experts": 128, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
                   "num_hidden_layers": 46, "use_qk_norm": False},       # zai-org/GLM-4.5-Air
    "glm4_6": {**_GLM4_5, "max_position_embeddings": 202752},            # zai-org/GLM-4.6
    "kimi_k2": {                                                         # moonshotai/Kimi-K2-Instruct
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "attention_bias": False,
        "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "first_k_dense_replace": 1, "hidden_act": "silu",
        "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
        "max_position_embeddings": 131072, "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1,
        "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
        "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
        "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "use_cache": True, "v_head_dim": 128, "vocab_size": 163840,
    },
    "olmoe_1b_7b": {                                                     # allenai/OLMoE-1B-7B-0924
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "attention_bias": False,
        "attention_dropout": 0.0, "clip_qkv": None, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 1024, "max_position_embeddings": 4096,
        "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "num_hidden_layers": 16, "num_key_value_heads": 16, "output_router_logits": False, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
        "torch_dtype": "float32", "use_cache": True, "vocab_size": 50304,
    },
    "minimax_m2": {                                                      # MiniMaxAI/MiniMax-M2
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "attn_type_list": [1] * 62,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536,
        "max_position_embeddings": 196608, "mtp_transformer_layers": 1, "num_attention_heads": 48,
        "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
        "num_mtp_modules": 3, "output_router_logits": False, "qk_norm_type": "per_layer",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64, "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "sliding_window": None,
        "tie_word_embeddings": False, "use_cache": True, "use_mtp": True, "use_qk_norm": True,
        "use_routing_bias": True, "vocab_size": 200064,
    },
}
