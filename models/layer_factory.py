"""ModelConfig -> component configs and modules: each section of the model handed to the component it configures.

``attention_config``/``linear_attention_config``/``router_config``/``moe_config``/``mlp_config`` give the
typed component configs (the MoE sections by name: ``ModelRouter.component`` ...), with the run's choices of how
they compute (``ModelOptions``); ``build_block(config, index, dims, options)`` builds transformer block ``index``
(GQA or MLA attention, Gated DeltaNet or Mamba-2 as ``config.layer_type(index)`` says; dense MLP or MoE FFN as
``config.is_moe_layer(index)`` says; in a stack of one-sublayer layers, Nemotron-H's, a block holds only its mixer
or only its FFN: ``ModelConfig.has_mixer`` / ``has_ffn``).
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
from moefold.dense.mamba2 import Mamba2Config, Mamba2Mixer
from moefold.dense.mla import MLAttention
from moefold.dense.mlp import DenseMLP, MLPConfig
from moefold.dense.rope import YarnConfig
from moefold.dispatch.config import DispatchConfig, DispatcherKind
from moefold.dispatch.deepep import check_flex_topk
from moefold.models.config import ModelConfig
from moefold.models.options import ModelOptions
from moefold.moe.activation import ExpertActivation
from moefold.moe.build import build_moe_layer
from moefold.moe.config import MoEConfig
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
    """The attention of layer ``index`` (layers differ only in their sliding window): the model's attention section
    by ``dense.attention_config``'s names, with the model's width and norm eps and the run's choices."""
    a, o = config.self_attention, options
    common = {"hidden_size": config.hidden_size, "num_heads": a.num_attention_heads, "norm_eps": config.norm_eps,
              "bias": a.bias, "rope_theta": a.rope_theta, "yarn": yarn_config(config), "cp_comm": o.cp_comm,
              "recompute": o.recompute, "init_std": o.init_std}
    if a.kind == "mla":
        if o.max_attention_logit:
            raise ValueError(f"{config.name}: --qk-clip is implemented for GQA attention, not MLA (its q_pe/k_pe "
                             "split)")
        m = a.mla
        return MLAConfig(kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                         qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, q_lora_rank=m.q_lora_rank,
                         rope_interleave=m.rope_interleave, latent_norm_eps=m.latent_norm_eps, **common)
    return AttentionConfig(num_query_groups=a.num_query_groups, head_dim=a.head_dim, qk_norm=a.qk_norm,
                           qk_norm_scope=a.qk_norm_scope, sliding_window=config.layer_sliding_window(index),
                           sinks=a.sinks, rotary_dim=config.rotary_dim if a.partial_rotary_factor < 1 else None,
                           out_bias=a.out_bias, output_gate=a.output_gate,
                           zero_centered_gamma=config.norm_zero_centered_gamma, max_logit=o.max_attention_logit,
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


def mamba_config(config: ModelConfig, options: ModelOptions | None = None) -> Mamba2Config:
    """The Mamba-2 mixer of the ``mamba`` layers (Nemotron-H)."""
    m = config.mamba
    if m is None:
        raise ValueError(f"{config.name}: no mamba sizes (MambaDims)")
    low, high = m.time_step_limit
    return Mamba2Config(hidden_size=config.hidden_size, num_heads=m.num_heads, head_dim=m.head_dim,
                        state_size=m.state_size, num_groups=m.num_groups, conv_kernel=m.conv_kernel,
                        conv_bias=m.conv_bias, proj_bias=m.proj_bias, chunk_size=m.chunk_size,
                        time_step_limit=(low, float("inf") if high is None else high),
                        norm_eps=config.norm_eps, backend=options.mamba_backend if options else "torch")


def router_config(config: ModelConfig, options: ModelOptions) -> RouterConfig:
    """The router of every MoE layer: the model's router section (``ModelRouter.component``)."""
    return config.moe.router.component(config.num_experts, options.init_std)


def moe_config(config: ModelConfig, options: ModelOptions, dims: ParallelDims) -> MoEConfig:
    """The MoE layers' config: the model's MoE sections, each handed on by name, with how they run (``options``)."""
    c, o = config.moe, options
    # the model's FFN activation: SwiGLU, or Nemotron-H's ungated squared ReLU for routed and shared experts alike
    activation = ExpertActivation(config.ffn_activation)
    experts = c.experts.component(gemm_backend=o.gemm_backend, init_std=o.init_std, fp8=o.fp8, activation=activation)
    shared = c.shared.component(o.init_std)
    if shared is not None:
        shared = dataclasses.replace(shared, activation=activation)
    return MoEConfig(num_experts=c.num_experts, router=router_config(config, o), experts=experts,
                     dispatch=dispatch_config(o),
                     shared=shared, apply_probs_on_input=c.apply_probs_on_input,
                     latent_size=c.latent_size)


def dispatch_config(options: ModelOptions) -> DispatchConfig:
    """The MoE layers' dispatcher config: the run's ``options.dispatch`` as it is, with FP8 dispatch
    (``--moe-fp8-dispatch``, ``FP8Config.dispatch``) put in when on (``DispatchConfig`` then checks the pair)."""
    d = options.dispatch
    return dataclasses.replace(d, fp8=True) if options.fp8.dispatch else d


def mlp_config(config: ModelConfig, options: ModelOptions) -> MLPConfig:
    return MLPConfig(hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
                     activation=config.ffn_activation, init_std=options.init_std)


def check_layout(config: ModelConfig, dims: ParallelDims, options: ModelOptions) -> None:
    """Fail early, naming the numbers, when ``config`` cannot be split over ``dims``."""
    if config.v4 is not None:
        from moefold.models.v4_layers import check_v4_layout

        check_v4_layout(config, dims)
    attention_config(config, options).check_parallel(dims.tp, dims.cp)
    if "mamba" in (config.layer_types or ()):
        # --mamba-backend mamba_ssm without its packages, or groups tp and cp cannot split: refused here, in one line
        mamba_config(config, options).check_parallel(dims.tp, dims.cp)
    if "linear_attention" in (config.layer_types or ()):   # the layout does not depend on the kernel backend
        layout_only = dataclasses.replace(options, linear_attention_backend="torch")
        linear_attention_config(config, layout_only).check_parallel(dims.tp, dims.cp)
    if config.vocab_size % dims.tp:
        raise ValueError(f"vocab_size={config.vocab_size} is not divisible by tp={dims.tp}")
    if any(not config.is_moe_layer(i) and config.has_ffn(i) for i in range(config.num_layers)):
        mlp_config(config, options).check_parallel(dims.tp)
    if config.num_experts:
        moe = moe_config(config, options, dims)
        moe.check_layout(tp=dims.tp, ep=dims.ep, etp=dims.etp)
        if moe.dispatch.kind is DispatcherKind.FLEX:
            check_flex_topk(config.moe_topk, dims.etp)


def build_attention(config: ModelConfig, dims: ParallelDims, options: ModelOptions, index: int = 0,
                    **kw: Any) -> GQAAttention | MLAttention | DSAttention | GatedDeltaNet | Mamba2Mixer:
    """The token mixer of layer ``index``, as ``config.layer_type(index)`` says (``kw``: dtype/device)."""
    if config.layer_type(index) == "mamba":
        return Mamba2Mixer(mamba_config(config, options), dims.tp_group, dims.cp_group,
                           sequence_parallel=_sp(options, dims), init_std=options.init_std, **kw)
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
    if config.v4 is not None:   # DeepSeek-V4: compressed attentions, hash/top-k MoE, mHC streams
        from moefold.models.v4_layers import build_v4_block

        return build_v4_block(config, index, dims, options, device=device)
    kw = {"dtype": options.torch_dtype, "device": device}
    mixer = build_attention(config, dims, options, index, **kw) if config.has_mixer(index) else None
    ffn = build_ffn(config, is_moe_block(config, index), dims, options, **kw) if config.has_ffn(index) else None
    return TransformerBlock(config.hidden_size, mixer, ffn, config.norm_eps,
                            sequence_parallel=_sp(options, dims), recompute=options.recompute,
                            zero_centered_gamma=config.norm_zero_centered_gamma, **kw)


def _sp(options: ModelOptions, dims: ParallelDims) -> bool:
    return options.sequence_parallel and dims.tp > 1
