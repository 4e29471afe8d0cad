"""NVIDIA Nemotron 3 Nano 30B-A3B's published ``config.json`` (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16),
transcribed: architecture fields as published (tokenizer ids left out). Nothing is downloaded. Its ``norm_eps``,
``rope_theta`` and ``partial_rotary_factor`` are not ``NemotronHConfig`` fields: transformers' model reads none."""

from __future__ import annotations

NEMOTRON_3_NANO_30B_A3B = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "attention_bias": False,
    "attention_dropout": 0.0, "chunk_size": 128, "conv_kernel": 4, "expand": 2, "head_dim": 128,
    "hidden_dropout": 0.0, "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "initializer_range": 0.02,
    "intermediate_size": 1856, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64, "mamba_hidden_act": "silu",
    "mamba_num_heads": 64, "mamba_proj_bias": False, "mamba_ssm_cache_dtype": "float32",
    "max_position_embeddings": 262144, "mlp_bias": False, "mlp_hidden_act": "relu2", "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "n_groups": 8, "n_routed_experts": 128,
    "n_shared_experts": 1, "norm_eps": 1e-05, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts_per_tok": 6, "num_hidden_layers": 52, "num_key_value_heads": 2, "num_logits_to_keep": 1,
    "partial_rotary_factor": 1.0, "rescale_prenorm_residual": True, "residual_in_fp32": False, "rope_theta": 10000,
    "routed_scaling_factor": 2.5, "sliding_window": None, "ssm_state_size": 128, "tie_word_embeddings": False,
    "time_step_floor": 0.0001, "time_step_max": 0.1, "time_step_min": 0.001, "topk_group": 1,
    "torch_dtype": "bfloat16", "use_bias": False, "use_cache": True, "use_conv_bias": True, "use_mamba_kernels": True,
    "vocab_size": 131072,
}
