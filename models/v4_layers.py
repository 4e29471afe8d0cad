"""DeepSeek-V4's blocks from a ``ModelConfig`` with a ``v4`` section (``models.v4_dims``): the layer factory's V4 part.

Block ``i``: ``dense.block.TransformerBlock`` with ``hyper`` (mHC: ``hc_mult`` residual streams ``[S, B, N, H]``)
around ``dense.compressed_attention.CompressedAttention`` of kind ``v4.attention_kinds[i]`` and an MoE layer,
hash-routed (``moe.hash_router``, fed the token ids) for ``i < v4.num_hash_layers`` and top-k with the correction
bias after. The routed and the shared experts' SwiGLU are clamped at ``moe_activation_clamp`` (HF ``swiglu_limit``).

Layouts: the compressed attention holds every head and the whole sequence on one rank (its compressor windows
and indexer read the sequence from position 0), so ``check_v4_layout`` refuses tp > 1 and cp > 1; the experts
split over ep/etp as every MoE layer's.
"""

from __future__ import annotations

import dataclasses

import torch

from moefold.dense.block import TransformerBlock
from moefold.dense.compressed_attention import CompressedAttention, V4AttentionConfig
from moefold.dense.hyper_connections import HyperConfig
from moefold.dense.rope import YarnConfig
from moefold.dispatch.config import DispatchConfig
from moefold.models.config import ModelConfig
from moefold.models.options import ModelOptions
from moefold.moe.build import build_moe_layer
from moefold.moe.config import MoEConfig, SharedExpertsConfig
from moefold.moe.layer import MoELayer
from moefold.parallel.dims import ParallelDims


def check_v4_layout(config: ModelConfig, dims: ParallelDims) -> None:
    """One line naming the layout a V4 model cannot take, and why."""
    if dims.tp > 1 or dims.cp > 1:
        raise ValueError(f"{config.name}: tp={dims.tp}, cp={dims.cp}: DeepSeek-V4's compressed attention holds "
                         "every head and the whole sequence on one rank (its compressor windows and indexer read the "
                         "sequence from position 0); use tp=1 and cp=1 (ep, etp, pp and dp split it)")


def v4_attention_config(config: ModelConfig, options: ModelOptions, index: int) -> V4AttentionConfig:
    """The attention of layer ``index``. MTP blocks do not exist for V4 (``check_v4_model``)."""
    v4 = config.v4
    y = v4.compress_yarn
    yarn = None if y is None else YarnConfig(
        factor=y.factor, original_max_position_embeddings=y.original_max_position_embeddings, beta_fast=y.beta_fast,
        beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim, truncate=y.truncate,
        attention_factor=y.attention_factor)
    return V4AttentionConfig(
        hidden=config.hidden_size, heads=config.num_attention_heads, head_dim=config.head_dim,
        q_lora_rank=v4.q_lora_rank, o_groups=v4.o_groups, o_lora_rank=v4.o_lora_rank, rope_dim=v4.rope_head_dim,
        window=v4.sliding_window, kind=v4.attention_kinds[index], rate=v4.rate(index), rope_theta=config.rope_theta,
        compress_rope_theta=v4.compress_rope_theta, compress_yarn=yarn, index_heads=v4.index_n_heads,
        index_head_dim=v4.index_head_dim, index_topk=v4.index_topk, norm_eps=config.norm_eps,
        init_std=options.init_std)


def v4_moe_config(config: ModelConfig, options: ModelOptions, hashed: bool) -> MoEConfig:
    """The MoE config of a hash-routed (no correction bias) or a top-k layer; the shared expert clamped as the
    routed ones."""
    from moefold.models.layer_factory import moe_config  # the layer factory imports this module

    base = moe_config(config, options, ParallelDims.single())
    router = dataclasses.replace(base.router, enable_expert_bias=base.router.enable_expert_bias and not hashed)
    shared = base.shared
    if shared is not None:
        shared = SharedExpertsConfig(shared.ffn_size, gate=shared.gate, init_std=shared.init_std,
                                     output_init_std=shared.output_init_std, clamp=config.moe_activation_clamp)
    return dataclasses.replace(base, router=router, shared=shared, dispatch=DispatchConfig(
        options.dispatcher, options.flex, fp8=options.fp8.dispatch))


def build_v4_block(config: ModelConfig, index: int, dims: ParallelDims, options: ModelOptions, *,
                   device: torch.device | str | None = None) -> TransformerBlock:
    """V4 block ``index`` for this rank's layout (``device="meta"`` builds without memory)."""
    v4, dtype = config.v4, options.torch_dtype
    attention = CompressedAttention(v4_attention_config(config, options, index), device=device)
    if dtype is not None:
        attention.to(dtype=dtype)
        attention.sinks.data = attention.sinks.data.float()   # HF keeps the sink logits fp32
    hashed = v4.is_hash_layer(index)
    moe: MoELayer = build_moe_layer(v4_moe_config(config, options, hashed), config.hidden_size, dims,
                                    sequence_parallel=False, dtype=dtype, device=device,
                                    hash_vocab_size=config.vocab_size if hashed else None)
    hyper = HyperConfig(n_hc=v4.hc_mult, sinkhorn_iters=v4.hc_sinkhorn_iters, eps=v4.hc_eps,
                        init_std=options.init_std)
    return TransformerBlock(config.hidden_size, attention, moe, config.norm_eps, recompute=options.recompute,
                            hyper=hyper, dtype=dtype, device=device)


__all__ = ["build_v4_block", "check_v4_layout", "v4_attention_config", "v4_moe_config"]
