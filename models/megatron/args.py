"""Megatron-LM's saved ``args`` <-> moefold's ``ModelConfig``: every argument that shapes the model read or refused.

Megatron-LM (core_v0.16.1) builds its ``TransformerConfig`` from ``args`` field by field
(``core_transformer_config_from_args``; since 0.16 the transformer arguments are generated from the dataclass
fields, so ``args.layernorm_epsilon`` is ``--norm-epsilon``; older releases stored ``norm_epsilon`` and
``apply_layernorm_1p``: ``ALIASES``), plus the network-size arguments of ``_add_network_size_args`` (position
embedding, rotary, activation, tying). Each argument is in exactly one of:

- ``READ``: ``config_from_megatron`` maps it onto the ``ModelConfig`` (a value it cannot express is refused there,
  naming the argument and the value);
- ``REFUSED``: ``{arg: (default, what it is)}``: a checkpoint whose args hold any other value is refused in one
  line naming the argument and its value;
- ``NOT_MODEL``: ``{why: args}``: the layout, precision, kernels, memory, initialisation, logging and training
  regularisation: the function the weights compute does not depend on them (the tensors are global whatever
  layout saved them; moefold chooses its own layout and kernels with its own flags).

``tests/models/test_megatron_args.py`` lists every field of ``TransformerConfig`` / ``MLATransformerConfig`` and
Megatron-LM's network-size arguments and checks each is in one of the three.
"""

from __future__ import annotations

from typing import Any

from moefold.models.config import ModelConfig

# older Megatron-LM spellings of the same argument
ALIASES = {"layernorm_epsilon": ("norm_epsilon",), "layernorm_zero_centered_gamma": ("apply_layernorm_1p",)}

READ = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "group_query_attention", "num_query_groups", "kv_channels",
    "ffn_hidden_size", "layernorm_epsilon", "normalization", "qk_layernorm", "swiglu", "add_bias_linear",
    "add_qkv_bias", "position_embedding_type", "rotary_base", "rotary_percent", "max_position_embeddings",
    "untie_embeddings_and_output_weights", "window_size", "window_attn_skip_freq", "padded_vocab_size",
    "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_layer_freq", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
    "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_router_dtype", "moe_expert_capacity_factor",
    "moe_token_drop_policy", "moe_pad_expert_input_to_capacity", "moe_router_force_load_balancing",
    "moe_apply_probs_on_input", "mtp_num_layers", "mtp_loss_scaling_factor", "softmax_type", "quick_geglu",
    "glu_linear_offset", "activation_func_clamp_value", "moe_router_quantile_balancing_ema", "moe_latent_size",
})

REFUSED: dict[str, tuple[Any, str]] = {
    "multi_latent_attention": (False, "multi-latent attention (Megatron-Core's local layer spec cannot build MLA "
                                      "without Transformer Engine, so the conversion is untested)"),
    "layernorm_zero_centered_gamma": (False, "zero-centred norm weights (--apply-layernorm-1p; the local spec's "
                                             "torch norms refuse it)"),
    "apply_residual_connection_post_layernorm": (False, "BERT's residual order"),
    "rotary_interleaved": (False, "interleaved RoPE pairs"),
    "softmax_scale": (None, "a custom attention softmax scale"),
    "qk_l2_norm": (False, "L2 qk-norm"),
    "qk_clip": (False, "QK-clip of the attention weights"),
    "attention_output_gate": (False, "a gated attention output"),
    "squared_relu": (False, "the squared-ReLU activation"),
    "openai_gelu": (False, "OpenAI's GeLU"),
    "no_rope_freq": (None, "layers without RoPE"),
    "use_rope_scaling": (False, "Llama-3 RoPE scaling"),
    "rotary_seq_len_interpolation_factor": (None, "RoPE position interpolation"),
    "add_position_embedding": (True, "no position embedding"),
    "experimental_attention_variant": (None, "an experimental attention variant"),
    "linear_attention_freq": (None, "linear-attention layers"),
    "is_hybrid_model": (False, "a hybrid (Mamba) model"),
    "hybrid_override_pattern": (None, "a hybrid (Mamba) layer pattern"),
    "heterogeneous_block_specs": (False, "heterogeneous layers"),
    "heterogeneous_layers_config_path": (None, "heterogeneous layers"),
    "heterogeneous_layers_config_encoded_json": (None, "heterogeneous layers"),
    "spec": (None, "a custom layer spec"),
    "mrope_section": (None, "multimodal RoPE"),
    "use_legacy_models": (False, "a legacy (non-core) model"),
}

_MLA_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
             "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "cache_mla_latents")
NOT_MODEL: dict[str, tuple[str, ...]] = {
    "the parallel layout (the checkpoint's tensors are global; moefold picks its own layout)": (
        "tensor_model_parallel_size", "pipeline_model_parallel_comm_backend", "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size", "sequence_parallel", "context_parallel_size",
        "hierarchical_context_parallel_sizes", "max_seqlen_per_dp_cp_rank", "hybrid_context_parallel",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_extended_tp", "cp_comm_type",
        "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "pipeline_model_parallel_layout",
        "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split", "mtp_standalone",
        "microbatch_group_size_per_vp_stage", "make_vocab_size_divisible_by", "encoder_num_layers",
        "decoder_num_layers"),
    "precision (the same function in another number format)": (
        "fp16", "bf16", "params_dtype", "pipeline_dtype", "enable_autocast", "autocast_dtype",
        "fp32_residual_connection", "attention_softmax_in_fp32", "apply_query_key_layer_scaling",
        "disable_bf16_reduced_precision_matmul",
        "fp8", "fp8_recipe", "fp8_param", "fp8_quantizer_factory", "fp8_margin", "fp8_interval",
        "fp8_amax_history_len", "fp8_amax_compute_algo",
        "fp8_wgrad", "fp8_dot_product_attention", "fp8_multi_head_attention",
        "tp_only_amax_red", "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
        "fp4", "fp4_recipe", "fp4_param", "fp4_quantizer_factory", "quant_recipe", "use_kitchen",
        "use_kitchen_attention", "kitchen_attention_backend", "activation_func_fp8_input_store",
        "moe_router_padding_for_quantization", "moe_router_padding_for_fp8", "batch_invariant_mode",
        "deterministic_mode"),
    "kernels and backends (the same function computed another way)": (
        "attention_backend", "transformer_impl", "gradient_accumulation_fusion",
        "async_tensor_model_parallel_allreduce",
        "cross_entropy_loss_fusion", "cross_entropy_fusion_impl", "bias_activation_fusion", "masked_softmax_fusion",
        "persist_layer_norm", "memory_efficient_layer_norm", "bias_dropout_fusion", "apply_rope_fusion",
        "use_fused_weighted_squared_relu", "fused_single_qkv_rope", "moe_grouped_gemm", "moe_use_legacy_grouped_gemm",
        "moe_token_dispatcher_type", "moe_enable_deepep", "moe_flex_dispatcher_backend", "moe_permute_fusion",
        "moe_router_fusion", "moe_deepep_num_sms", "moe_hybridep_num_sms", "use_te_activation_func",
        "use_te_rng_tracker", "inference_rng_tracker", "use_inference_optimized_layers",
        "inference_fuse_tp_communication", "symmetric_ar_type", "flash_decode", "mlp_chunks_for_prefill",
        "use_mamba_mem_eff_path", "clone_scatter_output_in_embedding", "disable_parameter_transpose_cache",
        "moe_shared_expert_overlap", "moe_token_dropping", "moe_router_topk_limited_devices",
        "moe_enable_routing_replay", "test_mode", "hetereogenous_dist_checkpoint", "onnx_safe"),
    "communication overlap, recompute, offloading and CUDA graphs (memory and speed)": (
        "tp_comm_overlap", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
        "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_atomic_ag", "tp_comm_split_rs", "tp_comm_atomic_rs",
        "tp_comm_overlap_disable_qkv", "tp_comm_overlap_disable_fc1", "tp_comm_bootstrap_backend",
        "overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "ep_overlap_early_attn_memory_release",
        "variable_seq_lengths", "overlap_p2p_comm", "batch_p2p_comm", "batch_p2p_sync", "use_ring_exchange_p2p",
        "deallocate_pipeline_outputs", "defer_embedding_wgrad_compute", "wgrad_deferral_limit",
        "overlap_p2p_comm_warmup_flush", "cpu_offloading", "cpu_offloading_num_layers", "_cpu_offloading_context",
        "cpu_offloading_activations", "cpu_offloading_weights", "cpu_offloading_double_buffering",
        "num_microbatches_with_partial_activation_checkpoints", "recompute_granularity", "recompute_method",
        "recompute_num_layers", "distribute_saved_activations", "recompute_modules", "moe_layer_recompute",
        "enable_cuda_graph", "cuda_graph_use_single_mempool", "cuda_graph_retain_backward_graph",
        "cuda_graph_warmup_steps", "external_cuda_graph", "cuda_graph_impl", "cuda_graph_scope",
        "fine_grained_activation_offloading", "offload_modules", "min_offloaded_tensor_size"),
    "initialisation (the weights come from the checkpoint)": (
        "perform_initialization", "use_cpu_initialization", "init_method", "output_layer_init_method",
        "init_method_std", "embedding_init_method", "embedding_init_method_std", "init_model_with_meta_device"),
    "callbacks, logging and inference settings": (
        "timers", "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
        "barrier_with_L1_time", "log_max_attention_logit", "moe_per_layer_logging", "config_logger_dir",
        "inference_sampling_seed", "qk_clip_alpha", "qk_clip_threshold", "calculate_per_token_loss",
        "relative_attention_num_buckets", "relative_attention_max_distance", "bert_binary_head"),
    "dropout: a training regularisation (moefold trains without dropout; the function is the same)": (
        "hidden_dropout", "attention_dropout"),
    "implied by other arguments (gated_linear_unit / activation_func: --swiglu; num_moe_experts: --num-experts; "
    "the flag that enables a refused feature refuses it)": (
        "gated_linear_unit", "activation_func", "num_moe_experts", "use_rotary_position_embeddings",
        "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff",
        "dsa_indexer_use_sparse_loss", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups",
        "mamba_num_heads", "rope_scaling_factor", *_MLA_ONLY),
}


def _refuse(what: str) -> ValueError:
    return ValueError(f"this Megatron model has {what}, which moefold does not build")


def _get(args: dict[str, Any], name: str, default: Any = None) -> Any:
    """``args[name]``, or under an older spelling (``ALIASES``), or ``default``."""
    for key in (name, *ALIASES.get(name, ())):
        if key in args:
            return args[key]
    return default


def check_refused(args: dict[str, Any]) -> None:
    """One-line ValueError for the first ``REFUSED`` argument whose value is not its default."""
    for name, (default, what) in REFUSED.items():
        value = _get(args, name, default)
        if value != default and not (default is None and value in ((), [], "")):
            raise _refuse(f"{what} (--{name.replace('_', '-')}={value!r})")


def _one(value: Any) -> Any:
    """Megatron-LM stores several balancing losses as a list: the one value (a list of one)."""
    if isinstance(value, (list, tuple)):
        if len(value) > 1:
            raise _refuse(f"several balancing losses {list(value)}")
        return value[0] if value else None
    return value


def _pattern(freq: Any) -> int | tuple[int, ...]:
    return tuple(int(v) for v in freq) if isinstance(freq, (list, tuple)) else int(freq)


def _window(a: dict[str, Any], num_layers: int, mtp: int) -> dict[str, Any]:
    """--window-size (left, right) and --window-attn-skip-freq (Megatron-Core's ``is_layer_window_attention``)."""
    window, skip = a.get("window_size"), a.get("window_attn_skip_freq")
    if not window or window[0] in (None, -1):
        return {"sliding_window": None}
    if len(window) > 1 and window[1] not in (0, None):
        raise _refuse(f"a window that looks ahead (--window-size={tuple(window)})")
    if skip is None:
        return {"sliding_window": int(window[0]) + 1}
    if mtp:
        raise _refuse(f"--window-attn-skip-freq={skip!r} with MTP layers (their window is untested)")
    pattern = tuple(int(bool(skip[i])) for i in range(num_layers)) if isinstance(skip, (list, tuple)) else \
        tuple(int((i + 1) % int(skip) != 0) for i in range(num_layers))
    return {"sliding_window": int(window[0]) + 1, "sliding_window_pattern": None if all(pattern) else pattern}


def _family(softmax: bool, pre: bool, qk_norm: bool, shared: int, expert_bias: bool, qkv_bias: bool,
            partial: bool, sinks: bool) -> str:
    """The HF family whose semantics the model has (what an HF export would write); qwen3_moe otherwise."""
    if sinks:
        return "gpt_oss"
    if not softmax and expert_bias:
        return "glm4_moe"
    if softmax and not pre and not qk_norm and not shared and not qkv_bias and not partial:
        return "mixtral"
    return "qwen3_moe"


def _gpt_oss(a: dict[str, Any], shared: int, mtp: int) -> dict[str, Any]:
    """GPT-OSS's features in Megatron's arguments: attention sinks (``--softmax-type learnable``), biases on every
    linear (``--add-bias-linear``: q/k/v, o, router, experts), quick GeGLU (gate * sigmoid(1.702 gate)) with an
    offset on the linear half and a clamp. Megatron puts the biases, the activation, offset and clamp on every MLP;
    moefold's are the routed experts', so a model with dense layers, shared experts or MTP layers is refused."""
    g = a.get
    softmax_type = g("softmax_type", "vanilla")
    if softmax_type not in ("vanilla", "learnable"):
        raise _refuse(f"a softmax offset other than learnable sinks (--softmax-type={softmax_type!r})")
    biases, quick = g("add_bias_linear") is True, bool(g("quick_geglu"))
    offset, clamp = float(g("glu_linear_offset") or 0.0), g("activation_func_clamp_value")
    if not (g("swiglu", True) or quick):
        raise _refuse("an activation other than SwiGLU or quick GeGLU (neither --swiglu nor --quick-geglu)")
    every_mlp = [f for f, on in (("--add-bias-linear", biases), ("--quick-geglu", quick),
                                 (f"--glu-linear-offset={offset}", offset), (f"--activation-func-clamp-value={clamp}",
                                                                           clamp is not None)) if on]
    moe = _pattern(g("moe_layer_freq", 1))
    dense = not g("num_experts") or (isinstance(moe, tuple) and not all(moe)) or (isinstance(moe, int) and moe > 1)
    if every_mlp and (dense or shared or mtp):
        raise _refuse(f"{', '.join(every_mlp)} with dense layers, shared experts or MTP layers (moefold has them on "
                      "the routed experts only)")
    return dict(attention_sinks=softmax_type == "learnable", moe_router_bias=biases, moe_expert_linear_bias=biases,
                moe_swiglu_alpha=1.702 if quick else 1.0, moe_glu_linear_offset=offset,
                moe_activation_clamp=None if clamp is None else float(clamp))


def config_from_megatron(args: dict[str, Any], vocab_size: int, name: str = "megatron") -> ModelConfig:
    """The moefold ``ModelConfig`` of a Megatron-LM ``args`` dict (``vocab_size``: the embedding's rows); one-line
    ValueError naming the argument for a model moefold does not build."""
    a = dict(args)
    g = a.get
    check_refused(a)
    if _get(a, "normalization", "RMSNorm") != "RMSNorm":
        raise _refuse(f"--normalization {_get(a, 'normalization')}")
    if g("position_embedding_type", "rope") != "rope":
        raise _refuse(f"--position-embedding-type {g('position_embedding_type')}")
    heads, hidden, layers = int(a["num_attention_heads"]), int(a["hidden_size"]), int(a["num_layers"])
    experts = int(g("num_experts") or 0)
    softmax = g("moe_router_score_function", "softmax") == "softmax"
    pre = bool(g("moe_router_pre_softmax"))
    shared = int(g("moe_shared_expert_intermediate_size") or 0)
    qk_norm, qkv_bias = bool(g("qk_layernorm")), bool(g("add_qkv_bias"))
    partial = float(g("rotary_percent", 1.0) or 1.0)
    mtp = int(g("mtp_num_layers") or 0)
    features = _gpt_oss(a, shared, mtp)
    biases = features["moe_router_bias"]
    return ModelConfig(
        name=name, family=_family(softmax, pre, qk_norm, shared, bool(g("moe_router_enable_expert_bias")), qkv_bias,
                                  partial != 1.0, features["attention_sinks"]), **features,
        vocab_size=vocab_size, hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
        num_query_groups=int(g("num_query_groups")) if g("group_query_attention") and g("num_query_groups") else None,
        head_dim=int(g("kv_channels")) if g("kv_channels") and int(g("kv_channels")) != hidden // heads else None,
        qk_norm=qk_norm, attention_bias=qkv_bias or biases, attention_out_bias=None if biases else (
            False if qkv_bias else None),
        partial_rotary_factor=partial, **_window(a, layers, mtp),
        rope_theta=float(g("rotary_base", 10000)), max_position_embeddings=int(g("max_position_embeddings") or 4096),
        norm_eps=float(_get(a, "layernorm_epsilon", 1e-5)), ffn_hidden_size=int(g("ffn_hidden_size") or 0),
        tie_word_embeddings=not g("untie_embeddings_and_output_weights", False),
        num_experts=experts, moe_ffn_hidden_size=int(g("moe_ffn_hidden_size") or g("ffn_hidden_size") or 0),
        moe_topk=int(g("moe_router_topk") or 2), moe_score_function=str(g("moe_router_score_function") or "softmax"),
        moe_pre_softmax=pre, moe_norm_topk_prob=not (softmax and pre),
        moe_topk_scaling_factor=float(g("moe_router_topk_scaling_factor") or 1.0),
        moe_num_groups=g("moe_router_num_groups"), moe_group_topk=g("moe_router_group_topk"),
        moe_expert_bias=bool(g("moe_router_enable_expert_bias")), moe_shared_expert_ffn_size=shared,
        moe_shared_expert_gate=bool(g("moe_shared_expert_gate")),
        moe_layer_freq=_pattern(g("moe_layer_freq", 1)),
        moe_aux_loss_coeff=float(_one(g("moe_aux_loss_coeff", 0.0)) or 0.0),
        moe_load_balancing_type=str(_one(g("moe_router_load_balancing_type", "aux_loss"))),
        moe_z_loss_coeff=g("moe_z_loss_coeff"), moe_input_jitter_eps=g("moe_input_jitter_eps"),
        moe_router_dtype=g("moe_router_dtype") or "fp32",
        moe_bias_update_rate=float(g("moe_router_bias_update_rate", 1e-3)),
        moe_expert_capacity_factor=g("moe_expert_capacity_factor"),
        moe_token_drop_policy=g("moe_token_drop_policy", "probs"),
        moe_pad_expert_input_to_capacity=bool(g("moe_pad_expert_input_to_capacity")),
        moe_router_force_load_balancing=bool(g("moe_router_force_load_balancing")),
        moe_apply_probs_on_input=bool(g("moe_apply_probs_on_input")),
        moe_router_quantile_balancing_ema=float(g("moe_router_quantile_balancing_ema") or 0.0),
        moe_latent_size=int(g("moe_latent_size")) if g("moe_latent_size") else None,
        mtp_num_layers=mtp, mtp_loss_scaling_factor=float(g("mtp_loss_scaling_factor", 0.1)),
    )


def megatron_args_from_config(c: ModelConfig) -> dict[str, Any]:
    """Megatron-LM's architecture arguments for ``c`` (ValueError for what Megatron-Core cannot express), in
    core_v0.16.1's spelling (``layernorm_epsilon``; ``norm_epsilon`` too, for older readers)."""
    if c.attention == "mla":
        raise ValueError("--to megatron: multi-latent attention models are not exported (Megatron-Core's local "
                         "layer spec cannot build MLA without Transformer Engine, so the export is untested)")
    out_bias = c.attention_bias if c.attention_out_bias is None else c.attention_out_bias
    biases = (c.attention_bias, out_bias, c.moe_router_bias, c.moe_expert_linear_bias)
    if any(biases[1:]) and not all(biases):
        raise ValueError(f"--to megatron: biases on some linears only (attention q/k/v, o, router, experts: "
                         f"{biases}); Megatron's --add-bias-linear puts them on all, --add-qkv-bias on q/k/v only")
    every_mlp = all(biases) or c.moe_swiglu_alpha != 1.0 or c.moe_activation_clamp is not None \
        or c.moe_glu_linear_offset != 0.0
    dense = any(not c.is_moe_layer(i) for i in range(c.num_layers))
    if every_mlp and (dense or c.moe_shared_expert_ffn_size or c.mtp_num_layers):
        raise ValueError("--to megatron: expert biases, quick GeGLU, an offset or a clamp are on every MLP in Megatron "
                         "(moefold's on the routed experts): not with dense layers, shared experts or MTP layers")
    if c.moe_swiglu_alpha not in (1.0, 1.702):
        raise ValueError(f"--to megatron: moe_swiglu_alpha={c.moe_swiglu_alpha}: Megatron has SwiGLU (1) and quick "
                         "GeGLU (1.702)")
    unsupported = [k for k, v in (("qk_norm_scope='projection'", c.qk_norm_scope != "head"),
                                  ("yarn", c.yarn is not None), ("layer_types", c.layer_types is not None),
                                  ("attention_output_gate", c.attention_output_gate),
                                  ("norm_zero_centered_gamma", c.norm_zero_centered_gamma)) if v]
    if unsupported:
        raise ValueError(f"--to megatron: {', '.join(unsupported)} not exported (the Megatron-LM arguments moefold "
                         "reads back cannot express them)")
    softmax = c.moe_score_function == "softmax"
    if c.num_experts and not softmax and c.moe_topk > 1 and not c.moe_norm_topk_prob:
        raise ValueError("--to megatron: sigmoid routing without renormalising the top-k probabilities has no "
                         "Megatron equivalent (Megatron renormalises whenever topk > 1)")
    if c.moe_num_groups and c.moe_group_score_topk not in (None, c.moe_topk // c.moe_group_topk):
        raise ValueError(f"--to megatron: group scores of the top {c.moe_group_score_topk} experts; Megatron sums "
                         f"the top topk // group_topk = {c.moe_topk // c.moe_group_topk}")
    pattern = [1 if c.is_moe_layer(i) else 0 for i in range(c.num_layers)]
    window = c.sliding_window
    skip = None if window is None or c.sliding_window_pattern is None else list(c.sliding_window_pattern)
    return {
        "num_layers": c.num_layers, "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
        "group_query_attention": c.kv_heads != c.num_attention_heads, "num_query_groups": c.kv_heads,
        "kv_channels": c.attention_head_dim, "qk_layernorm": c.qk_norm, "ffn_hidden_size": c.ffn_hidden_size or None,
        "normalization": "RMSNorm", "layernorm_epsilon": c.norm_eps, "norm_epsilon": c.norm_eps,
        "swiglu": c.moe_swiglu_alpha == 1.0, "quick_geglu": c.moe_swiglu_alpha != 1.0,
        "glu_linear_offset": c.moe_glu_linear_offset, "activation_func_clamp_value": c.moe_activation_clamp,
        "add_bias_linear": all(biases), "add_qkv_bias": c.attention_bias and not all(biases),
        "softmax_type": "learnable" if c.attention_sinks else "vanilla", "position_embedding_type": "rope",
        "rotary_base": int(c.rope_theta) if float(c.rope_theta).is_integer() else c.rope_theta,
        "rotary_percent": c.partial_rotary_factor, "max_position_embeddings": c.max_position_embeddings,
        "untie_embeddings_and_output_weights": not c.tie_word_embeddings, "padded_vocab_size": c.vocab_size,
        "window_size": (window - 1, 0) if window else None, "window_attn_skip_freq": skip,
        "num_experts": c.num_experts or None, "moe_ffn_hidden_size": c.moe_ffn_hidden_size or None,
        "moe_router_topk": c.moe_topk, "moe_router_score_function": c.moe_score_function,
        "moe_router_pre_softmax": softmax and c.moe_pre_softmax and not c.moe_norm_topk_prob,
        "moe_router_topk_scaling_factor": c.moe_topk_scaling_factor if c.moe_topk_scaling_factor != 1.0 else None,
        "moe_router_num_groups": c.moe_num_groups, "moe_router_group_topk": c.moe_group_topk,
        "moe_router_enable_expert_bias": c.moe_expert_bias, "moe_router_bias_update_rate": c.moe_bias_update_rate,
        "moe_shared_expert_intermediate_size": c.moe_shared_expert_ffn_size or None,
        "moe_shared_expert_gate": c.moe_shared_expert_gate, "moe_layer_freq": pattern if c.num_experts else 1,
        "moe_router_load_balancing_type": c.moe_load_balancing_type, "moe_aux_loss_coeff": c.moe_aux_loss_coeff,
        "moe_z_loss_coeff": c.moe_z_loss_coeff, "moe_input_jitter_eps": c.moe_input_jitter_eps,
        "moe_router_dtype": c.moe_router_dtype, "moe_expert_capacity_factor": c.moe_expert_capacity_factor,
        "moe_token_drop_policy": c.moe_token_drop_policy,
        "moe_pad_expert_input_to_capacity": c.moe_pad_expert_input_to_capacity,
        "moe_router_force_load_balancing": c.moe_router_force_load_balancing,
        "moe_apply_probs_on_input": c.moe_apply_probs_on_input,
        "mtp_num_layers": c.mtp_num_layers or None, "mtp_loss_scaling_factor": c.mtp_loss_scaling_factor,
        # Megatron-Core 0.18/0.19 arguments: written only when used, so older readers (0.16.1) see no new names
        **({"moe_router_quantile_balancing_ema": c.moe_router_quantile_balancing_ema}
           if c.moe_load_balancing_type == "quantile_balancing" else {}),
        **({"moe_latent_size": c.moe_latent_size} if c.moe_latent_size else {}),
    }
