"""Every field of each family's transformers config class: read, not part of the computation, or refused.

For each config class moefold reads (transformers 5.25: ``DeepseekV3Config`` (Kimi-K2 too), ``Qwen3MoeConfig``,
``Qwen3Config``, ``MixtralConfig``, ``MistralConfig``, ``GptOssConfig``, ``Glm4MoeConfig``, ``OlmoeConfig``,
``MiniMaxM2Config``, ``Qwen3NextConfig``, ``Qwen3_5MoeTextConfig``) each field is in one of:

- ``READ[key]``: ``models.hf.config_map`` maps it onto the ``ModelConfig`` (another value changes the config, or
  is refused there naming the field);
- ``INERT`` / ``INERT_BY_CLASS[key]``: the function the weights compute does not depend on it (ids, output
  switches, initialisation, the storage dtype, values the class recomputes from others), with the reason;
- ``REFUSED[key]``: ``{field: (default, what)}``: transformers computes something moefold does not build unless
  the field holds its default, so another value is refused at import in one line naming the field and the value.

``check_fields(hf)`` applies ``REFUSED`` (and partial RoPE, which only some classes apply) before anything is read;
``tests/models/test_hf_config_fields.py`` lists every field of every class and checks each is in one of the three.
"""

from __future__ import annotations

from typing import Any

# the config class of an architecture (the dense relatives and Kimi-K2 have their own rows; Kimi-K2 is DeepSeek-V3's)
CLASS_OF = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV32ForCausalLM": "deepseek_v32",
            "GlmMoeDsaForCausalLM": "glm_moe_dsa",
            "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen3ForCausalLM": "qwen3",
            "MixtralForCausalLM": "mixtral", "MistralForCausalLM": "mistral", "GptOssForCausalLM": "gpt_oss",
            "Glm4MoeForCausalLM": "glm4_moe", "OlmoeForCausalLM": "olmoe", "MiniMaxM2ForCausalLM": "minimax_m2",
            "Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
            "NemotronHForCausalLM": "nemotron_h"}
_MODEL_TYPE_CLASS = {"kimi_k2": "deepseek_v3"}
# rope_parameters keys a class reads that config_map does not (the key: why they do not change the function)
ROPE_INERT = {"qwen3_5_moe_text": {
    "mrope_section": "multimodal RoPE's split of the frequencies over (time, height, width) positions: a text "
                     "sequence has the three equal, which is the 1-D rotary embedding",
    "mrope_interleaved": "the order of that split (same reason)"}}

INERT: dict[str, str] = {
    "_name_or_path": "where the config was read from", "architectures": "read to pick the family",
    "model_type": "read to pick the family", "transformers_version": "the writer's version",
    "bos_token_id": "a tokenizer id", "eos_token_id": "a tokenizer id",
    "pad_token_id": "a tokenizer id; the forward is the same (HF's nn.Embedding(padding_idx) only keeps that row's "
                    "gradient at zero; moefold, like Megatron-Core, trains every row)",
    "id2label": "classification heads", "label2id": "classification heads", "problem_type": "classification heads",
    "is_encoder_decoder": "a causal LM either way", "chunk_size_feed_forward": "not read by these models",
    "output_attentions": "what HF returns", "output_hidden_states": "what HF returns", "return_dict": "what HF returns",
    "use_cache": "generation's KV cache", "initializer_range": "initialisation (the weights come from the checkpoint)",
    "dtype": "the weights' dtype on disk (the computation's is a run option)", "torch_dtype": "the older dtype key",
    "output_router_logits": "whether HF returns router logits and adds its balancing loss in training (moefold's "
                            "coefficient is read from the aux-loss field)",
}
INERT_BY_CLASS: dict[str, dict[str, str]] = {
    "deepseek_v3": {"qk_head_dim": "recomputed by the class (qk_nope_head_dim + qk_rope_head_dim)",
                    "head_dim": "recomputed by the class (qk_rope_head_dim)",
                    "pretraining_tp": "not read by transformers' DeepSeek-V3"},
    "deepseek_v32": {"qk_head_dim": "recomputed by the class (qk_nope_head_dim + qk_rope_head_dim)",
                     "head_dim": "recomputed by the class (qk_rope_head_dim)",
                     "mlp_bias": "not read by transformers' DeepSeek-V3.2 (its MLPs have no bias)",
                     "rope_interleave": "not a field of DeepseekV32Config: MLA's RoPE is always interleaved",
                     "num_nextn_predict_layers": "transformers' DeepSeek-V3.2 skips the MTP layer (layer 61)"},
    "glm_moe_dsa": {"qk_head_dim": "recomputed by the class (qk_nope_head_dim + qk_rope_head_dim)",
                     "head_dim": "recomputed by the class (qk_rope_head_dim)",
                     "mlp_bias": "not read by transformers' GLM-5 (its MLPs have no bias)",
                     "rope_interleave": "not a field of GlmMoeDsaConfig: MLA's RoPE is always interleaved",
                     "num_nextn_predict_layers": "transformers' GLM-5 skips the MTP layer (layer 78)"},
    "nemotron_h": {
        "tie_word_embeddings": "not read by transformers' NemotronH (_tied_weights_keys = {}: lm_head is its own)",
        "num_hidden_layers": "deprecated in NemotronHConfig: the layer count is len(layers_block_type)",
        "attention_bias": "not read by transformers' NemotronH (its attention has no biases)",
        "mamba_proj_bias": "not read by transformers' NemotronH (the Mamba projections' bias is use_bias)",
        "n_shared_experts": "not read by transformers' NemotronH (one shared expert of "
                            "moe_shared_expert_intermediate_size)",
        "expand": "not read by the mixer (its width is mamba_num_heads * mamba_head_dim)",
        "time_step_min": "initialisation of dt_bias", "time_step_max": "initialisation of dt_bias",
        "time_step_floor": "initialisation of dt_bias", "rescale_prenorm_residual": "initialisation of out_proj",
        "residual_in_fp32": "not read by transformers' NemotronH", "use_mamba_kernels": "deprecated, no effect",
        "mamba_ssm_cache_dtype": "generation's cache", "num_logits_to_keep": "generation",
        "moe_shared_expert_overlap": "scheduling of the shared expert, not its value",
        "num_nextn_predict_layers": "transformers' NemotronH builds no MTP layers (ignores mtp.* tensors)",
        "mtp_layers_block_type": "transformers' NemotronH builds no MTP layers",
        "hybrid_override_pattern": "the older spelling of layers_block_type (read when that is absent)",
        "mtp_hybrid_override_pattern": "transformers' NemotronH builds no MTP layers",
        "norm_eps": "not a NemotronHConfig field (the published configs carry it; layer_norm_epsilon is read)",
        "rope_theta": "not read: NemotronH's attention has no positional encoding",
        "partial_rotary_factor": "not read: NemotronH's attention has no positional encoding"},
    "gpt_oss": {"hidden_act": "not read by transformers' GPT-OSS (its activation is swiglu_alpha / swiglu_limit)"},
    "qwen3": {"sliding_window": "read only with use_sliding_window (refused)",
              "max_window_layers": "read only with use_sliding_window (refused)",
              "layer_types": "without use_sliding_window no layer has a window (transformers sets sliding_window "
                             "to None)"},
}
_COMMON_READ = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
                "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "hidden_act"}
READ: dict[str, set[str]] = {
    "deepseek_v3": _COMMON_READ | {
        "num_key_value_heads", "intermediate_size", "moe_intermediate_size", "n_shared_experts", "n_routed_experts",
        "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim",
        "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "rope_interleave",
        "attention_bias", "num_nextn_predict_layers"},
    "deepseek_v32": _COMMON_READ | {
        "num_key_value_heads", "intermediate_size", "moe_intermediate_size", "n_shared_experts", "n_routed_experts",
        "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim",
        "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "attention_bias",
        "mlp_layer_types", "layer_types", "index_topk", "index_head_dim", "index_n_heads"},
    "glm_moe_dsa": _COMMON_READ | {
        "num_key_value_heads", "intermediate_size", "moe_intermediate_size", "n_shared_experts", "n_routed_experts",
        "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim",
        "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "attention_bias",
        "mlp_layer_types", "layer_types", "index_topk", "index_head_dim", "index_n_heads", "indexer_types"},
    "qwen3_moe": _COMMON_READ | {
        "num_key_value_heads", "intermediate_size", "attention_bias", "use_sliding_window", "sliding_window",
        "decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok", "num_local_experts", "norm_topk_prob",
        "router_aux_loss_coef", "mlp_only_layers"},
    "qwen3": _COMMON_READ | {"num_key_value_heads", "head_dim", "intermediate_size", "attention_bias"},
    "mixtral": _COMMON_READ | {"num_key_value_heads", "head_dim", "intermediate_size", "sliding_window",
                               "num_experts_per_tok", "num_local_experts", "router_aux_loss_coef",
                               "router_jitter_noise"},
    "mistral": _COMMON_READ | {"num_key_value_heads", "head_dim", "intermediate_size", "sliding_window"},
    "gpt_oss": _COMMON_READ - {"hidden_act"} | {
        "num_key_value_heads", "head_dim", "intermediate_size", "sliding_window", "layer_types", "attention_bias",
        "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "swiglu_limit", "swiglu_alpha"},
    "glm4_moe": _COMMON_READ | {
        "num_key_value_heads", "intermediate_size", "attention_bias", "moe_intermediate_size", "num_experts_per_tok",
        "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "n_group", "topk_group",
        "first_k_dense_replace", "norm_topk_prob", "use_qk_norm", "num_nextn_predict_layers"},
    "olmoe": _COMMON_READ | {"num_key_value_heads", "intermediate_size", "attention_bias", "num_experts_per_tok",
                             "num_experts", "router_aux_loss_coef", "norm_topk_prob"},
    "minimax_m2": _COMMON_READ | {"num_key_value_heads", "head_dim", "intermediate_size", "num_experts_per_tok",
                                  "num_local_experts", "router_aux_loss_coef", "router_jitter_noise"},
    "qwen3_next": _COMMON_READ | {
        "num_key_value_heads", "head_dim", "intermediate_size", "attention_bias", "linear_conv_kernel_dim",
        "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
        "decoder_sparse_step", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok",
        "num_experts", "norm_topk_prob", "router_aux_loss_coef", "mlp_only_layers", "layer_types"},
    "nemotron_h": {
        "vocab_size", "hidden_size", "max_position_embeddings", "layers_block_type",
        "num_attention_heads", "num_key_value_heads", "head_dim", "layer_norm_epsilon", "intermediate_size",
        "mlp_hidden_act", "mlp_bias", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
        "conv_kernel", "use_conv_bias", "use_bias", "chunk_size", "time_step_limit", "mamba_hidden_act",
        "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
        "moe_latent_size", "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob", "hidden_dropout",
        "sliding_window"},
    "qwen3_5_moe_text": _COMMON_READ | {
        "num_key_value_heads", "head_dim", "attention_bias", "linear_conv_kernel_dim", "linear_key_head_dim",
        "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
        "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts", "router_aux_loss_coef",
        "layer_types"},
}
_DROPOUT = (0.0, "attention dropout (moefold has none)")
REFUSED: dict[str, dict[str, tuple[Any, str]]] = {
    key: {"attention_dropout": _DROPOUT} for key in READ}
REFUSED["qwen3"]["use_sliding_window"] = (False, "sliding windows in the dense Qwen3 (max_window_layers)")
REFUSED["olmoe"]["clip_qkv"] = (None, "clipping q, k and v")
# the classes that apply partial RoPE (rope_parameters.partial_rotary_factor); the others would not
PARTIAL_ROTARY = {"glm4_moe", "minimax_m2", "qwen3_next", "qwen3_5_moe_text"}


def config_class(hf: dict[str, Any]) -> str | None:
    """The ``READ`` key of an HF config dict (None: an architecture this module does not know)."""
    for arch in hf.get("architectures") or ():
        if arch in CLASS_OF:
            return CLASS_OF[arch]
    model_type = hf.get("model_type")
    return _MODEL_TYPE_CLASS.get(model_type, model_type if model_type in READ else None)


def _refuse(key: str, field: str, value: Any, what: str) -> ValueError:
    return ValueError(f"{key}: {field}={value!r} is not supported ({what}: transformers computes a model moefold "
                      "does not build)")


def check_fields(hf: dict[str, Any]) -> None:
    """One-line ValueError, naming the field and its value, for a field whose value moefold cannot compute the way
    transformers does (``REFUSED``, partial RoPE in a class that does not apply it)."""
    key = config_class(hf)
    if key is None:
        return
    for field, (default, what) in REFUSED[key].items():
        if hf.get(field) not in (default, None):
            raise _refuse(key, field, hf[field], what)
    if key not in PARTIAL_ROTARY and key != "nemotron_h":   # NemotronH: no positional encoding to rotate
        for source in (hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}, hf):
            factor = source.get("partial_rotary_factor")
            if factor not in (None, 1, 1.0):
                raise _refuse(key, "partial_rotary_factor", factor, f"transformers' {key} rotates whole heads")
    act = hf.get("hidden_act", "silu")
    if "hidden_act" in READ[key] and act != "silu":
        raise _refuse(key, "hidden_act", act, "moefold's MLPs and experts are SwiGLU: 'silu'")
