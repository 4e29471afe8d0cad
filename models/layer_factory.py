"""ModelConfig -> component configs and modules: the one place the flat config is translated.

``attention_config``/``linear_attention_config``/``router_config``/``moe_config``/``mlp_config`` derive the
typed component configs; ``build_block(config, index, dims, options)`` builds transformer block ``index``
(GQA or MLA attention, or Gated DeltaNet as ``config.layer_type(index)`` says; dense MLP or MoE FFN as
``config.is_moe_layer(index)`` says).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moefold.dense.attention import GQAAttention
from moefold.dense.attention_config import AttentionConfig, MLAConfig
from moefold.dense.block import TransformerBlock
from moefold.dense.dsa import DSAttention
from moefold.dense.dsa_indexer import DSAConfig
from moefold.dense.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from moefold.dense.mla import MLAttention
from moefold.dense.mlp import DenseMLP, MLPConfig
from moefold.dense.rope import YarnConfig
from moefold.dispatch.config import DispatchConfig, DispatcherKind
from moefold.dispatch.deepep import check_flex_topk
from moefold.models.config import ModelConfig
from moefold.models.options import ModelOptions
from moefold.moe.activation import GatedActivation
from moefold.moe.build import build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelDims


def yarn_config(config: ModelConfig) -> YarnConfig | None:
    y = config.yarn
    if y is None:
        return None
    return YarnConfig(factor=y.factor, original_max_position_embeddings=y.original_max_position_embeddings,
                      beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim,
                      truncate=y.truncate, attention_factor=y.attention_factor)


def attention_config(config: ModelConfig, options: ModelOptions, index: int = 0) -> AttentionConfig | MLAConfig:
    """The attention of layer ``index`` (layers differ only in their sliding window)."""
    c, o = config, options
    common = {"hidden_size": c.hidden_size, "num_heads": c.num_attention_heads, "norm_eps": c.norm_eps,
              "bias": c.attention_bias, "rope_theta": c.rope_theta, "yarn": yarn_config(c), "cp_comm": o.cp_comm,
              "recompute": o.recompute, "init_std": o.init_std}
    if c.attention == "mla":
        if o.max_attention_logit:
            raise ValueError(f"{c.name}: --qk-clip is implemented for GQA attention, not MLA (its q_pe/k_pe split)")
        m = c.mla
        return MLAConfig(kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                         qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, q_lora_rank=m.q_lora_rank,
                         rope_interleave=m.rope_interleave, latent_norm_eps=m.latent_norm_eps, **common)
    return AttentionConfig(num_query_groups=c.num_query_groups, head_dim=c.head_dim, qk_norm=c.qk_norm,
                           qk_norm_scope=c.qk_norm_scope, sliding_window=c.layer_sliding_window(index),
                           sinks=c.attention_sinks, rotary_dim=c.rotary_dim if c.partial_rotary_factor < 1 else None,
                           out_bias=c.attention_out_bias, output_gate=c.attention_output_gate,
                           zero_centered_gamma=c.norm_zero_centered_gamma, max_logit=o.max_attention_logit,
                           **common)


def dsa_config(config: ModelConfig) -> DSAConfig | None:
    """The lightning indexer of every MLA layer (DeepSeek-V3.2), or None."""
    d = config.dsa
    return None if d is None else DSAConfig(index_n_heads=d.index_n_heads, index_head_dim=d.index_head_dim,
                                            index_topk=d.index_topk, relu=d.relu, loss_coeff=d.loss_coeff,
                                            rope_interleave=d.rope_interleave)


def linear_attention_config(config: ModelConfig, options: ModelOptions) -> GatedDeltaNetConfig:
    """The Gated DeltaNet of the ``linear_attention`` layers."""
    la = config.linear_attention
    if la is None:
        raise ValueError(f"{config.name}: no linear_attention sizes (LinearAttentionDims)")
    return GatedDeltaNetConfig(hidden_size=config.hidden_size, num_key_heads=la.num_key_heads,
                               num_value_heads=la.num_value_heads, key_head_dim=la.key_head_dim,
                               value_head_dim=la.value_head_dim, conv_kernel_size=la.conv_kernel_size,
                               norm_eps=config.norm_eps, backend=options.linear_attention_backend,
                               recompute=options.recompute, init_std=options.init_std)


def router_config(config: ModelConfig, options: ModelOptions) -> RouterConfig:
    """The router of every MoE layer. HF semantics per family:

    - Mixtral: softmax over the top-k logits (= softmax over all, renormalised over the k).
    - Qwen3-MoE: softmax over all experts (``pre_softmax``), renormalised iff ``norm_topk_prob``.
    - DeepSeek-V3: sigmoid, group-limited (group score = sum of the top 2), expert bias for selection,
      renormalised and scaled by ``routed_scaling_factor``.
    """
    c = config
    pre = c.moe_pre_softmax and c.moe_score_function == "softmax"
    norm = c.moe_norm_topk_prob
    if c.moe_score_function == "softmax" and not pre:
        norm = None  # post-top-k softmax is normalised by definition
    return RouterConfig(
        num_experts=c.num_experts, topk=c.moe_topk, score_function=c.moe_score_function, pre_softmax=pre,
        norm_topk_prob=norm,
        topk_scaling_factor=c.moe_topk_scaling_factor if c.moe_topk_scaling_factor != 1.0 else None,
        num_groups=c.moe_num_groups, group_topk=c.moe_group_topk, group_score_topk=c.moe_group_score_topk,
        load_balancing_type=c.moe_load_balancing_type, aux_loss_coeff=c.moe_aux_loss_coeff,
        aux_loss_counts=c.moe_aux_loss_counts,
        enable_expert_bias=c.moe_expert_bias, bias_update_rate=c.moe_bias_update_rate,
        z_loss_coeff=c.moe_z_loss_coeff, input_jitter_eps=c.moe_input_jitter_eps, router_dtype=c.moe_router_dtype,
        expert_capacity_factor=c.moe_expert_capacity_factor, token_drop_policy=c.moe_token_drop_policy,
        expert_rank_capacity_factor=c.moe_expert_rank_capacity_factor,
        pad_expert_input_to_capacity=c.moe_pad_expert_input_to_capacity,
        force_load_balancing=c.moe_router_force_load_balancing, init_std=options.init_std, bias=c.moe_router_bias)


def moe_config(config: ModelConfig, options: ModelOptions, dims: ParallelDims) -> MoEConfig:
    """The MoE layers' config: the flat ``ModelConfig`` / ``ModelOptions`` fields into the composed one."""
    c, o = config, options
    experts = ExpertsConfig(ffn_hidden_size=c.moe_ffn_hidden_size, bias=c.moe_expert_linear_bias,
                            glu=GatedActivation(c.moe_swiglu_alpha, c.moe_activation_clamp, c.moe_glu_linear_offset),
                            gemm_backend=o.gemm_backend, init_std=o.init_std, fp8=o.fp8)
    shared = None
    if c.moe_shared_expert_ffn_size or c.moe_shared_expert_gate:
        shared = SharedExpertsConfig(c.moe_shared_expert_ffn_size, gate=c.moe_shared_expert_gate, init_std=o.init_std)
    return MoEConfig(num_experts=c.num_experts, router=router_config(c, o), experts=experts,
                     dispatch=DispatchConfig(o.resolved_dispatcher(dims.ep, dims.etp), o.flex, fp8=o.fp8.dispatch),
                     shared=shared, apply_probs_on_input=c.moe_apply_probs_on_input)


def mlp_config(config: ModelConfig, options: ModelOptions) -> MLPConfig:
    return MLPConfig(hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
                     init_std=options.init_std)


def check_layout(config: ModelConfig, dims: ParallelDims, options: ModelOptions) -> None:
    """Fail early, naming the numbers, when ``config`` cannot be split over ``dims``."""
    attention_config(config, options).check_parallel(dims.tp, dims.cp)
    if "linear_attention" in (config.layer_types or ()):   # the layout does not depend on the kernel backend
        layout_only = dataclasses.replace(options, linear_attention_backend="torch")
        linear_attention_config(config, layout_only).check_parallel(dims.tp, dims.cp)
    if config.vocab_size % dims.tp:
        raise ValueError(f"vocab_size={config.vocab_size} is not divisible by tp={dims.tp}")
    if any(not config.is_moe_layer(i) for i in range(config.num_layers)):
        mlp_config(config, options).check_parallel(dims.tp)
    if config.num_experts:
        moe = moe_config(config, options, dims)
        moe.check_layout(tp=dims.tp, ep=dims.ep, etp=dims.etp)
        if moe.dispatch.kind is DispatcherKind.FLEX:
            check_flex_topk(config.moe_topk, dims.etp)


def build_attention(config: ModelConfig, dims: ParallelDims, options: ModelOptions, index: int = 0,
                    **kw: Any) -> GQAAttention | MLAttention | DSAttention | GatedDeltaNet:
    """The token mixer of layer ``index``, as ``config.layer_type(index)`` says (``kw``: dtype/device)."""
    if config.layer_type(index) == "linear_attention":
        return GatedDeltaNet(linear_attention_config(config, options), dims.tp_group, dims.cp_group,
                             sequence_parallel=_sp(options, dims), **kw)
    att = attention_config(config, options, index)
    if config.dsa is not None:
        return DSAttention(att, dsa_config(config), dims.tp_group, dims.cp_group, sequence_parallel=_sp(options, dims),
                           **kw)
    cls = MLAttention if isinstance(att, MLAConfig) else GQAAttention
    return cls(att, dims.tp_group, dims.cp_group, sequence_parallel=_sp(options, dims), **kw)


def build_ffn(config: ModelConfig, moe: bool, dims: ParallelDims, options: ModelOptions,
              **kw: Any) -> MoELayer | DenseMLP:
    """The MoE layer or the dense MLP (``kw``: dtype/device)."""
    if moe:
        return build_moe_layer(moe_config(config, options, dims), config.hidden_size, dims,
                               sequence_parallel=_sp(options, dims), **kw)
    return DenseMLP(mlp_config(config, options), dims.tp_group, sequence_parallel=_sp(options, dims), **kw)


def is_moe_block(config: ModelConfig, index: int) -> bool:
    """Block ``index`` has an MoE FFN. Indices >= num_layers are MTP blocks: MoE whenever the model
    has experts (DeepSeek-V3's MTP layer is an MoE layer)."""
    if index >= config.num_layers:
        return config.num_experts > 0
    return config.is_moe_layer(index)


def build_block(config: ModelConfig, index: int, dims: ParallelDims, options: ModelOptions, *,
                device: torch.device | str | None = None) -> TransformerBlock:
    """Transformer block ``index`` (0-based global layer index; MTP blocks continue after the
    main layers) for this rank's layout. Parameters and buffers go to ``device`` (None: the default device;
    ``device="meta"`` builds without memory)."""
    kw = {"dtype": options.torch_dtype, "device": device}
    return TransformerBlock(config.hidden_size, build_attention(config, dims, options, index, **kw),
                            build_ffn(config, is_moe_block(config, index), dims, options, **kw), config.norm_eps,
                            sequence_parallel=_sp(options, dims), recompute=options.recompute,
                            zero_centered_gamma=config.norm_zero_centered_gamma, **kw)


def _sp(options: ModelOptions, dims: ParallelDims) -> bool:
    return options.sequence_parallel and dims.tp > 1
